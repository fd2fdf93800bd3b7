"""``scripts/gpu_check.sh`` / ``benchmarks.gpu_check``: the one-line preflight errors, the
time guards and skips, the summary lines of the parts' figures, the metric-log parsing; and
``scripts/device_kit.sh``'s arguments.

Nothing here downloads anything. The check on CPU (``--device cpu --tiny --skip quickstart``,
about 1.5 minutes on 2 busy cores) is the slow test at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[3]


def _check(*args: str, kit: Path, out: Path, timeout: float = 240
           ) -> subprocess.CompletedProcess:
    """``bash scripts/gpu_check.sh ARGS`` with ``DEVICE_KIT=kit`` and ``--out out``."""
    env = {**os.environ, "DEVICE_KIT": str(kit), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args, "--out",
                           str(out)], capture_output=True, text=True, env=env, timeout=timeout)


def _broken_kit(tmp_path: Path, python: str | None = None) -> Path:
    """A kit folder whose ``torchao`` raises at import (it shadows the installed one)."""
    kit = tmp_path / "kit" / "site-packages"
    (kit / "torchao").mkdir(parents=True)
    (kit / "torchao" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    if python:
        (kit.parent / "MANIFEST.txt").write_text(f"# device kit for Python {python}: x\n")
    return kit


def test_preflight_import_failure_is_one_line(tmp_path):
    """A package that does not import: one ``error:`` line naming it and the kit, exit 2,
    and the summary records the failed preflight."""
    out = tmp_path / "out"
    proc = _check("--device", "cpu", "--tiny", kit=_broken_kit(tmp_path), out=out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("error: cannot import torchao (ImportError: broken on purpose)")
    assert "lacks it" in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [("preflight", "failed")]


def test_preflight_names_a_kit_for_another_python(tmp_path):
    """A kit built for another Python: the line says to rebuild it for this one."""
    here = "%d.%d" % sys.version_info[:2]
    proc = _check("--device", "cpu", "--tiny", kit=_broken_kit(tmp_path, "3.99"),
                  out=tmp_path / "out")
    assert proc.returncode == 2
    assert (f"the kit is for Python 3.99 but this is Python {here}: rebuild it with "
            f"`bash scripts/device_kit.sh --python-version {here}`") in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_preflight_without_cuda_is_one_line(tmp_path):
    """The default ``--device cuda`` where CUDA is absent: one line that says what to run."""
    proc = _check(kit=tmp_path / "no_kit", out=tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("error: no CUDA device: torch ")
    assert "bash scripts/gpu_check.sh --device cpu --tiny" in lines[0]


def test_arguments(tmp_path, capsys, monkeypatch):
    """``--device cpu`` needs ``--tiny``; the budget must be positive; ``$OUT`` is the default
    folder; the quickstart runs in bf16 by default."""
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "cpu"])
    assert "add --tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget", "0"])
    assert "--budget must be positive" in capsys.readouterr().err
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gpu_check.parse_args([])
    assert args.out == tmp_path.resolve() and args.dtype == "bf16" and args.device == "cuda"


def _args(tmp_path: Path, device: str = "cpu"):
    """Parsed arguments of a check writing under ``tmp_path``."""
    return gpu_check.parse_args(["--device", device, "--tiny", "--out", str(tmp_path)])


def test_time_guards_skip_by_name(tmp_path):
    """With the budget spent, the parts are skipped, each naming the seconds left and needed;
    nothing is started."""
    clock = gpu_check.Clock(budget=100.0, start=time.monotonic() - 95.0)
    env = gpu_check.child_env("cpu")
    results = [gpu_check.part_child(name, _args(tmp_path), clock, env, "cpu")
               for name in ("optimizer", "decode", "grpo_step", "fsdp_gather")]
    results.append(gpu_check.part_quickstart(_args(tmp_path), clock, env, "cpu"))
    for result in results:
        assert result.status == "skipped" and result.seconds == 0
        assert result.detail.startswith("time guard: 5 s of the 100 s budget left, the part "
                                        "needs ~"), result.detail
    assert not list(tmp_path.iterdir())


def test_summary_lines_of_the_parts_figures(tmp_path):
    """Each part's JSON becomes one summary line: the optimizers (a failure with its reason),
    decode ms and syncs per token, the GRPO step's phases and peak against the estimate, the
    log-prob gap read from the step's figures, the gathered decode; no figures, no gap."""
    line = gpu_check.describe("optimizer", {"params": 3.9e8, "backend": "nccl", "optimizers": {
        "torchao._AdamW(bf16_stochastic_round)": {"status": "failed", "error": "the optimizer "
                                                  "x failed to compile its step"},
        "torchtune_grpo.optim.AdamW": {"status": "ran", "first_step_s": 0.2, "step_ms": 4.25}}})
    assert line == ("390.00M params over nccl FSDP2: torchao._AdamW(bf16_stochastic_round) "
                    "FAILED (the optimizer x failed to compile its step); "
                    "torchtune_grpo.optim.AdamW 0.2 s first step, 4.2 ms/step")
    line = gpu_check.describe("decode", {"stop_check_interval": 16, "rows": {
        "eager_16": {"ms_per_token": 31.0, "syncs_per_token": 0.0625,
                     "cuda_sync_warnings_per_token": 0.125},
        "compiled_16": {"ms_per_token": 9.5, "syncs_per_token": None,
                        "cuda_sync_warnings_per_token": 0.0625}}})
    assert line == ("stop_check_interval 16: eager 16 rows 31.0 ms/token, 0.06 syncs/token, "
                    "0.12 sync warnings/token; compiled 16 rows 9.5 ms/token, 0.06 sync "
                    "warnings/token")
    step = {"config": "grpo/qwen2_5_3B_full", "params": 3.09e9, "device": "cuda",
            "batch_size": 16, "group_size": 16, "max_generated_tokens": 512,
            "estimated_peak_bytes": 40 * 2**30, "steps": [
                {"time/generation": 30.0, "time/update": 12.5, "time/weight_sync": 0.0,
                 "peak_memory_bytes": 38.5 * 2**30, "generation/logprob_diff_max": 0.25,
                 "generation/logprob_diff_mean": 0.02}]}
    assert gpu_check.describe("grpo_step", step) == (
        "grpo/qwen2_5_3B_full at 3.09B params, 16 x 16 x 512: step 1 generation 30.0 / "
        "update 12.5 s; peak 38.50 GiB vs estimate 40.00 GiB")
    args = _args(tmp_path)
    assert gpu_check.part_logprob_gap(args).status == "skipped"
    (tmp_path / "grpo_step.json").write_text(json.dumps(step))
    gap = gpu_check.part_logprob_gap(args)
    assert gap.status == "ran" and "step 1 max 0.25, mean 0.02" in gap.detail
    assert gpu_check.describe("fsdp_gather", {
        "backend": "nccl", "tokens_equal": True,
        "decode_seconds": {"gathered_once": 1.0, "per_forward": 3.0}}) == (
        "nccl: tokens equal to unsharded True, decode 1.00 s gathered once vs 3.00 s per "
        "forward")


def test_heldout_accuracy_from_the_metric_log(tmp_path):
    """``eval/pass@1`` of the first and the last evaluation rows of a DiskLogger file."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "log_1.txt").write_text(
        "Step 0 | eval/pass@1:0.17 eval/pass@1/ci95_low:0.13 \n"
        "Step 1 | reward/mean:0.24 loss:2.2e-08 \n"
        "Step 20 | eval/pass@1:0.9966666666666667 \n")
    assert gpu_check.heldout_accuracy(tmp_path) == (0.17, 0.9966666666666667)
    assert gpu_check.heldout_accuracy(tmp_path / "missing") == (None, None)


def test_summary_lists_every_part(tmp_path):
    """``summary.txt`` has one line per part with its status; ``summary.json`` the same."""
    args = _args(tmp_path)
    parts = [gpu_check.Part("preflight", "ran", 3.0, "ok"),
             gpu_check.Part("fsdp2", "skipped", detail="GPU-only")]
    text = gpu_check.summarize(parts, args, gpu_check.Clock(450.0), {"gpus": 0})
    assert "preflight      RAN      (3 s) ok" in text
    assert "fsdp2          SKIPPED  GPU-only" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [p["status"] for p in saved["parts"]] == ["ran", "skipped"]


def test_shipped_configs_resolve_from_the_checkout():
    """On ``PYTHONPATH`` without an install (the GPU machine), ``--config grpo/NAME`` reads the
    checkout's own ``configs/``."""
    from torchtune_grpo.config.loading import resolve_config_path, shipped_config_dir

    assert shipped_config_dir() == ROOT / "configs"
    assert resolve_config_path("grpo/quickstart_cpu") == (
        ROOT / "configs" / "grpo" / "quickstart_cpu.yaml")


@pytest.mark.parametrize("argv, message", [
    (["--python-version", "twelve"], "--python-version must look like 3.12, got 'twelve'"),
    (["--bogus"], "unknown argument '--bogus'"),
])
def test_device_kit_argument_errors(argv, message):
    """``device_kit.sh`` rejects a bad argument before downloading anything (exit 2)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_kit.sh"), *argv],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.slow
def test_cpu_tiny_check(tmp_path):
    """The check on CPU but for the quickstart (the recipe tests train it): the optimizers on
    a one-rank gloo FSDP2 layer (torchao's with stochastic rounding fails on the shards, with
    the recipe's one line; the shipped one runs), decode figures, two GRPO steps of the 3B
    config's settings at the tiny shape with their log-prob gap, the gathered FSDP2 decode
    equal to the unsharded one; the compiled decode skipped by name as GPU-only."""
    out = tmp_path / "out"
    proc = _check("--device", "cpu", "--tiny", "--skip", "quickstart", kit=tmp_path / "no_kit",
                  out=out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {p["name"]: p["status"] for p in summary["parts"]}
    assert status == {"preflight": "ran", "optimizer": "ran", "decode": "ran",
                      "grpo_step": "ran", "logprob_gap": "ran", "quickstart": "skipped",
                      "fsdp_gather": "ran"}
    figures = {name: json.loads((out / f"{name}.json").read_text())
               for name in ("optimizer", "decode", "grpo_step", "fsdp_gather")}
    optimizers = figures["optimizer"]["optimizers"]
    assert optimizers["torchao._AdamW(bf16_stochastic_round)"]["status"] == "failed"
    assert "mixed torch.Tensor and DTensor" in (
        optimizers["torchao._AdamW(bf16_stochastic_round)"]["error"])
    assert optimizers["torchtune_grpo.optim.AdamW"]["status"] == "ran"
    assert set(figures["decode"]["rows"]) == {"eager_16", "eager_64"}
    assert figures["decode"]["rows"]["eager_16"]["syncs_per_token"] >= 0
    assert figures["decode"]["compiled"].startswith("skipped: GPU-only")
    steps = figures["grpo_step"]["steps"]
    assert len(steps) == 2 and all(s["time/update"] > 0 for s in steps)
    assert figures["grpo_step"]["optimizer"] == "torchtune_grpo.optim.AdamW"
    assert figures["fsdp_gather"]["tokens_equal"] is True
