"""benchmarks/decode_kernels.py: the packed-weight A/B runs and reports both settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_kernels.py"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_ab_alternates_both_settings_and_samples_the_same_tokens(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("decode_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--shape", "step", "--rollouts", "1", "--new-tokens", "2",
                            "--threads", "1", "--out", str(tmp_path / "ab.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "F.linear" in out and "packed (oneDNN)" in out
    assert "same tokens: True" in out
    import json

    result = json.loads((tmp_path / "ab.json").read_text())
    assert len(result["linear_s"]) == len(result["packed_s"]) == 1 and result["same_tokens"]


def test_smollm2_shape_without_the_model_exits_2(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("decode_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--shape", "smollm2", "--model-dir", str(tmp_path)]) == 2
    assert "prepare-model smollm2" in capsys.readouterr().err
