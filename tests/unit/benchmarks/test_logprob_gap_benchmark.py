"""benchmarks.logprob_gap: importable, and a missing model is one line and exit 2 (the run
itself needs the real SmolLM2: ``python -m benchmarks.logprob_gap``)."""

from __future__ import annotations

from benchmarks import logprob_gap


def test_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert logprob_gap.main(["--model-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepare-model smollm2" in err[0]
    assert [name for name, _, _ in logprob_gap.PAIRS][0] == "engine bf16 vs trainer bf16"
