"""benchmarks.decode_kernels: the A/B runs and reports both settings of a feature."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_kernels


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_ab_alternates_both_settings_and_samples_the_same_tokens(capsys, tmp_path):
    threads = torch.get_num_threads()
    try:
        assert decode_kernels.main(["--shape", "step", "--rollouts", "1", "--new-tokens", "2",
                            "--threads", "1", "--out", str(tmp_path / "ab.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "F.linear" in out and "packed (oneDNN)" in out
    assert "same tokens: True" in out
    import json

    result = json.loads((tmp_path / "ab.json").read_text())
    assert len(result["off_s"]) == len(result["on_s"]) == 1 and result["same_tokens"]
    assert result["compare"] == "packed"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_decode_attention_ab_switches_the_one_step_path_and_restores_it(capsys, monkeypatch):
    from torchtune_grpo.backends import cpu_decode as packed_decode

    real = packed_decode.attend_decode_step
    calls = []
    monkeypatch.setattr(packed_decode, "attend_decode_step",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    counting = packed_decode.attend_decode_step
    threads = torch.get_num_threads()
    try:
        assert decode_kernels.main(["--shape", "step", "--rollouts", "1", "--new-tokens", "3",
                            "--threads", "1", "--compare", "decode-attention"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "attend_projected" in out and "attend_decode_step" in out
    assert "same tokens: True" in out
    # on: the one-step path ran (2 layers x 2 decode steps per rollout, warm-up and timed);
    # off: it did not; and it is back in place afterwards
    assert len(calls) == 2 * 2 * 2
    assert packed_decode.attend_decode_step is counting


def test_smollm2_shape_without_the_model_exits_2(tmp_path, capsys):
    assert decode_kernels.main(["--shape", "smollm2", "--model-dir", str(tmp_path)]) == 2
    assert "prepare-model smollm2" in capsys.readouterr().err
