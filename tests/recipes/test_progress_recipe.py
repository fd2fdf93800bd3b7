"""A training step that runs long reports its phase while it runs (in-process, fast tier)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("show", [True, False])
def test_a_slow_training_step_reports_its_phase(base_model, tmp_path, monkeypatch, show):
    """A reward that takes a while: the step's scoring phase is reported while it runs, by rank
    0, with or without ``progress_bar`` (no terminal here: lines)."""
    import torchtune_grpo.progress as progress_module
    from tests.recipes._helpers import train_in_process

    monkeypatch.setattr(progress_module, "REPORT_EVERY_S", 0.05)
    lines: list[str] = []
    monkeypatch.setattr(progress_module._log, "info", lines.append)
    slow = [{"_component_": "tests.recipes.components.slow_length_reward", "seconds": 0.4,
             "success": True, "success_threshold": 3.0}]
    train_in_process(base_model, tmp_path / "run", "num_steps=1", "global_batch_size=2",
                     "batch_size=null", "group_size=2", f"progress_bar={str(show).lower()}",
                     rewards=slow)
    assert any(line.startswith("step 1/1: scoring 4 completions (") for line in lines), lines
