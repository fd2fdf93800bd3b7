"""User errors print as one line and exit 2; under torchrun a line every rank would print is
printed once."""

from __future__ import annotations

import pytest

from torchtune_grpo.errors import UserError, first_to_report, reported_as_one_line


def test_outside_torchrun_every_line_is_reported(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert first_to_report("error: x") and first_to_report("error: x")


def test_under_torchrun_a_line_is_reported_once_per_launch(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    assert first_to_report("error: x")
    assert not first_to_report("error: x")  # the second rank
    assert first_to_report("error: y")  # another error is another line
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")  # the next launch reports again
    assert first_to_report("error: x")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert first_to_report("error: x") and first_to_report("error: x")


def test_the_second_rank_exits_2_silently(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-c")
    monkeypatch.delenv("TUNE_GRPO_DEBUG", raising=False)
    for _ in range(2):
        with pytest.raises(SystemExit) as raised, reported_as_one_line():
            raise UserError("config key 'group_size' must be >= 2\n(got 0)")
        assert raised.value.code == 2
    assert capsys.readouterr().err == "error: config key 'group_size' must be >= 2; (got 0)\n"
