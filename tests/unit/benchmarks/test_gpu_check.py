"""``scripts/gpu_check.sh`` / ``benchmarks.gpu_check``: the one-line preflight errors, the
time guards and skips, the metric-log parsing; and ``scripts/device_kit.sh``'s arguments.

Nothing here downloads anything. The whole check on CPU (``--device cpu --tiny``, about two
minutes) is the slow test at the end.
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
    """With the budget spent, the benchmark and the quickstart are skipped, each naming the
    seconds left and needed; nothing is started."""
    clock = gpu_check.Clock(budget=100.0, start=time.monotonic() - 95.0)
    env = gpu_check.child_env("cpu")
    for part in (gpu_check.part_gpu_benchmark, gpu_check.part_quickstart):
        result = part(_args(tmp_path), clock, env, "cpu")
        assert result.status == "skipped" and result.seconds == 0
        assert result.detail.startswith("time guard: 5 s of the 100 s budget left, the part "
                                        "needs ~"), result.detail
    assert not list(tmp_path.iterdir())


def test_fsdp2_skips_say_why(tmp_path):
    """The 2-process run: skipped on CPU (GPU-only) and on one GPU (needs 2), with reasons."""
    clock = gpu_check.Clock(budget=450.0)
    env = gpu_check.child_env("cpu")
    cpu = gpu_check.part_fsdp2(_args(tmp_path), clock, env, "cpu", gpus=0)
    assert cpu.status == "skipped" and cpu.detail.startswith("GPU-only: --device cpu")
    one = gpu_check.part_fsdp2(_args(tmp_path, "cuda"), clock, env, "cuda", gpus=1)
    assert one.status == "skipped"
    assert one.detail.startswith("needs 2 GPUs, this machine has 1")


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
    """The whole check on CPU: preflight, gpu.py tiny and the quickstart run (it learns);
    the FSDP2 part is skipped with its reason; well within the 450 s budget."""
    out = tmp_path / "out"
    proc = _check("--device", "cpu", "--tiny", kit=tmp_path / "no_kit", out=out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {p["name"]: p["status"] for p in summary["parts"]}
    assert status == {"preflight": "ran", "gpu_benchmark": "ran", "quickstart": "ran",
                      "fsdp2": "skipped"}
    assert summary["elapsed_s"] < summary["budget_s"]
    assert json.loads((out / "gpu.json").read_text())["shapes"]["tiny"]["params"] > 0
    before, after = gpu_check.heldout_accuracy(out / "quickstart" / "run")
    assert after > before
