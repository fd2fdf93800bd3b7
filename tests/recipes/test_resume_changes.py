"""A resume honours what the user changed: a lowered learning rate takes effect as a fresh
optimizer step at that rate would, a change of what the run means stops before any model is
built, and with ``resume_allow_changes`` the change is recorded in the step's state
(in-process runs of the quickstart model: fast tier)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    model_weights,
    quickstart_config,
    run_in_process,
    train_in_process,
    train_metrics,
)
from torchtune_grpo.checkpoints.saving import load_recipe_state
from torchtune_grpo.errors import CheckpointError
from torchtune_grpo.training.recipe import GRPORecipe

# one optimizer step per GRPO step and no weight decay: Adam's step is then lr times a
# direction that the restored moments and the (identical) step-2 gradient fix
ARGS = ("global_batch_size=4", "batch_size=null", "group_size=4", "ppo_epochs=1",
        LENGTH_REWARD_OVERRIDE, "optimizer.weight_decay=0.0")


@pytest.fixture(scope="module")
def step_1(base_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_changes") / "run"
    train_in_process(base_model, out, *ARGS, "num_steps=1", "optimizer.lr=1e-4")
    return out


def _resume(base_model, step_1, out, *extra):
    shutil.copytree(step_1, out)
    return train_in_process(base_model, out, *ARGS, "num_steps=2", "resume_from_checkpoint=true",
                            *extra)


def test_a_lowered_lr_on_resume_scales_the_next_update(base_model, step_1, tmp_path):
    same = _resume(base_model, step_1, tmp_path / "same", "optimizer.lr=1e-4")
    lower = _resume(base_model, step_1, tmp_path / "lower", "optimizer.lr=1e-5")
    assert_not_degenerate(tmp_path / "same", tmp_path / "lower", steps=[2],
                          weights=(step_1 / "step_1", tmp_path / "same" / "step_2"))
    w1 = model_weights(step_1 / "step_1")
    wa = model_weights(tmp_path / "same" / "step_2")
    wb = model_weights(tmp_path / "lower" / "step_2")
    # the same rollout and gradient (both continue from step_1), so Adam's update is linear in lr
    da = torch.cat([(wa[k] - w1[k]).flatten() for k in w1])
    db = torch.cat([(wb[k] - w1[k]).flatten() for k in w1])
    assert da.norm() > 0
    # up to the rounding of fp32 weights (a few ulps of the largest weight)
    ulp = torch.finfo(torch.float32).eps * max(float(w.abs().max()) for w in w1.values())
    assert torch.allclose(db, 0.1 * da, rtol=1e-3, atol=4 * ulp)
    assert float(db.norm() / da.norm()) == pytest.approx(0.1, rel=1e-3)
    assert [r["lr"] for r in train_metrics(tmp_path / "lower")] == [pytest.approx(1e-4),
                                                                     pytest.approx(1e-5)]
    assert same.optimizer.param_groups[0]["lr"] == 1e-4
    assert lower.optimizer.param_groups[0]["lr"] == 1e-5
    # the change is kept with the steps saved after it
    history = load_recipe_state(tmp_path / "lower" / "step_2")["config_changes"]
    assert {c["key"]: (c["saved"], c["new"]) for c in history} == {
        "optimizer.lr": (1e-4, 1e-5), "num_steps": (1, 2)}


def test_a_changed_group_size_stops_before_the_model_is_built(base_model, step_1, tmp_path,
                                                              monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(step_1, out)
    built = []
    monkeypatch.setattr("torchtune_grpo.training.parts.build_policy",
                        lambda *a, **k: built.append(1))
    recipe = GRPORecipe(quickstart_config(base_model, out, *ARGS, "num_steps=2",
                                          "group_size=8", "resume_from_checkpoint=true"))
    with pytest.raises(CheckpointError, match=r"group_size was 4 in .*step_1, the config says "
                                              r"8; .*resume_allow_changes=true"):
        try:
            recipe.setup()
        finally:
            recipe.cleanup()
    assert not built


def test_resume_allow_changes_continues_and_records_the_change(base_model, step_1, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(step_1, out)
    recipe = GRPORecipe(quickstart_config(base_model, out, *ARGS, "num_steps=2", "group_size=2",
                                          "resume_allow_changes=true",
                                          "resume_from_checkpoint=true"))
    run_in_process(recipe)
    history = load_recipe_state(out / "step_2")["config_changes"]
    assert {"step": 1, "key": "group_size", "saved": 4, "new": 2, "fixed": True} in history
