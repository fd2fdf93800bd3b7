"""``benchmarks.gpu``: its command line, its shapes, its HF folder, and the CPU tiny run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[3]

FAKE_VLLM = '''
"""A stand-in for vLLM: returns max_tokens zeros per prompt (tests the plumbing only)."""
from pathlib import Path
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, max_tokens, **kwargs):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, **kwargs):
        assert (Path(model) / "config.json").is_file() and kwargs["skip_tokenizer_init"]

    def generate(self, inputs, params, use_tqdm=False):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)])
                for _ in inputs]
'''


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the script in a fresh interpreter (``python -m benchmarks.gpu``)."""
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300)


def test_help():
    """``--help`` exits 0 and names the flags and torchtune's builders."""
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--device", "--shapes", "--tiny", "--time-budget", "--peak-tflops"):
        assert flag in proc.stdout
    assert "qwen2_5_0_5b" in proc.stdout and "qwen2_5_3b" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "0.5b", "7b"], "unknown shape(s) '7b'; choose from 0.5b, 3b"),
    (["--time-budget", "0"], "--time-budget must be positive, got 0"),
    (["--peak-tflops", "-1"], "--peak-tflops must be positive, got -1"),
    (["--device", "tpu"], "--device must be cuda, cuda:N or cpu, got 'tpu'"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_argument_errors_are_clear(argv, message, capsys):
    """A bad argument exits 2 with a message naming the value (and the choices)."""
    with pytest.raises(SystemExit) as info:
        gpu.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    """The default ``--device cuda`` on a machine without CUDA says what to do instead."""
    assert gpu.main(["--time-budget", "10"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_shapes_are_torchtunes_qwen2_5():
    """The dims given to ``qwen2`` build exactly what the ``qwen2_5`` builders build."""
    from torchtune import config
    from torchtune.models.qwen2 import qwen2

    for name, builder in gpu.BUILDERS.items():
        with torch.device("meta"):
            ours = qwen2(**gpu.SHAPES[name])
            theirs = config._utils._get_component_from_path(builder)()
        assert {k: v.shape for k, v in ours.state_dict().items()} == {
            k: v.shape for k, v in theirs.state_dict().items()}
        assert ours.max_seq_len == theirs.max_seq_len


def test_step_flops_formula():
    """6 N per trained token plus 2 N per prefill, generated and reference token."""
    tokens = {"trained": 10, "prefill": 3, "generated": 5, "reference": 10}
    assert gpu.step_flops(7, tokens) == 6 * 7 * 10 + 2 * 7 * (3 + 5 + 10)


def test_peak_table(monkeypatch):
    """``--peak-tflops`` wins; otherwise the table by device name; none for CPU."""
    assert gpu.peak_tflops("cpu", 123.0) == (123.0, "--peak-tflops")
    assert gpu.peak_tflops("cpu", None)[0] is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert gpu.peak_tflops("cuda", None)[0] == 989.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    assert gpu.peak_tflops("cuda", None)[0] == 312.0


def test_hf_folder_is_the_same_model(tmp_path):
    """The folder vLLM loads (config.json + weights) is the torchtune model: same logits in
    ``transformers``' ``Qwen2ForCausalLM``."""
    transformers = pytest.importorskip("transformers")
    from torchtune.models.qwen2 import qwen2
    from torchtune.training import FullModelHFCheckpointer

    dims = gpu.TINY
    folder = tmp_path / "model"
    gpu.write_random_qwen2(dims, folder, "cpu", "fp32")
    ckpt = FullModelHFCheckpointer(str(folder), ["model.safetensors"], "QWEN2",
                                   str(tmp_path / "out"))
    state = ckpt.load_checkpoint()["model"]
    model = qwen2(**dims)
    model.load_state_dict(state)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.randint(0, dims["vocab_size"], (2, 12))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-4


def _check_report(report: dict) -> None:
    """The JSON of a tiny CPU run has every key, every part ran, the numbers are positive."""
    for key in ("device", "device_name", "torch", "dtype", "peak_tflops", "peak_tflops_source",
                "matmul_tflops", "shapes", "skipped", "elapsed_s", "markdown", "time_budget_s"):
        assert key in report, key
    assert report["matmul_tflops"] > 0 and report["skipped"] == []
    shape = report["shapes"]["tiny"]
    assert shape["params"] > 0
    native = shape["generation"]["native"]
    assert native["tokens_per_second"] > 0 and native["seconds"] > 0
    step = shape["grpo_step"]
    for part in ("generation", "scoring", "reference", "update", "total"):
        assert step["mean_seconds"][part] > 0, part
    for key in ("trained", "prefill", "generated", "reference"):
        assert step["mean_tokens"][key] > 0, key
    assert step["flops_per_step"] > 0 and step["achieved_tflops"] > 0
    assert step["mfu_vs_matmul"] > 0 and step["mfu_vs_peak"] is None  # no CPU peak in the table
    assert step["peak_memory_bytes"] > 0 and step["estimated_peak_bytes"] > 0
    assert "| tiny |" in report["markdown"]


def test_tiny_cpu_run(tmp_path):
    """The command of the docs with ``--device cpu --tiny``: every part runs, JSON complete."""
    out = tmp_path / "gpu.json"
    proc = _run("--device", "cpu", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _check_report(report)
    vllm = report["shapes"]["tiny"]["generation"]["vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert vllm == {"skipped": "vllm is not installed (import vllm fails)"}
        assert "vLLM (tiny): vllm is not installed" in proc.stdout
    assert "| shape | params |" in proc.stdout


def test_tiny_cpu_run_with_vllm_plumbing(tmp_path, monkeypatch):
    """With an importable (fake) vLLM the worker subprocess runs and its tokens/s come back."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    _check_report(report)
    vllm = report["shapes"]["tiny"]["generation"]["vllm"]
    w = gpu.TINY_WORKLOAD
    assert vllm["tokens"] == w.prompts * w.group * w.new_tokens
    assert vllm["tokens_per_second"] > 0 and vllm["enforce_eager"] is True
