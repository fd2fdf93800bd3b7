"""A reward component's own counters (``last_counts``) reach the step's metrics."""

from __future__ import annotations

import pytest

from tests.recipes import components
from tests.recipes._helpers import quickstart_config, train_metrics
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow


def test_component_counters_are_logged_per_step(base_model, tmp_path):
    components.CountingLengthReward.calls.clear()
    cfg = quickstart_config(base_model, tmp_path, "num_steps=2", "batch_size=4",
                            "group_size=4", "temperature=1.0")
    cfg.rewards = [{"_component_": "tests.recipes.components.CountingLengthReward",
                    "name": "counting", "success": True, "success_threshold": 100.0}]
    recipe = GRPORecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    rows = train_metrics(tmp_path)
    calls = components.CountingLengthReward.calls
    assert len(rows) == 2 and len(calls) == 2  # one scoring call per step
    assert any(0 < c < 16 for c in calls), calls  # some, not all, completions counted
    assert [r["reward/counting/long"] for r in rows] == [float(c) for c in calls]
