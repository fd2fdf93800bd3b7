"""Two ways the update does less work for the same step (in-process runs, one rank):
``skip_zero_advantage_sequences`` (rollouts with advantage 0 left out of its passes) and
``share_prompt_forward`` (a group's prompt run once)."""

from __future__ import annotations

import pytest
import torch

from tests.recipes._helpers import quickstart_config, train_metrics
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow

# SGD: the update is proportional to the gradient, so equal updates mean equal gradients
REWARD = [{"_component_": "tests.recipes.components.half_tied_length_reward", "success": True,
           "success_threshold": 3.0}]
COMMON = ["num_steps=1", "batch_size=8", "group_size=4", "temperature=1.0",
          "optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5",
          "~optimizer.weight_decay", "clip_grad_norm=null", "forward_batch_size=8"]


def _run(base, out, *overrides):
    cfg = quickstart_config(base, out, *COMMON, *overrides)
    cfg.rewards = REWARD
    recipe = GRPORecipe(cfg)
    recipe.setup()
    rows = []
    inner = recipe.policy_update.micro_batch_logprobs

    def counting(model, traj, idx, **kwargs):
        if kwargs.get("return_entropy"):  # the update's passes (not the reference's)
            rows.append(int(idx.numel()))
        return inner(model, traj, idx, **kwargs)

    recipe.policy_update.micro_batch_logprobs = counting
    recipe.train()
    recipe.cleanup()
    weights = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    return weights, rows, train_metrics(out)[-1]


def test_skipping_zero_advantage_rollouts_keeps_the_update(base_model, tmp_path):
    # half the groups tie (advantage 0), the others vary
    skip_w, skip_rows, skip = _run(base_model, tmp_path / "skip")
    full_w, full_rows, full = _run(base_model, tmp_path / "full",
                                   "skip_zero_advantage_sequences=false")
    assert 0 < full["zero_std_group_fraction"] < 1, full  # both kinds of group in the batch
    assert full["grad_norm"] > 0
    tied = round(full["zero_std_group_fraction"] * 8) * 4
    # the tied groups' rows, and any row whose reward equals its group's mean, are skipped
    assert sum(full_rows) == 32 and 0 < sum(skip_rows) <= 32 - tied
    assert skip["reward/mean"] == full["reward/mean"]
    # at the first step the ratio is 1 and the advantages sum to 0: the loss is a rounding
    # residue near 0, the gradient is not
    for key in ("loss", "policy_loss"):
        assert skip[key] == pytest.approx(full[key], abs=1e-6), key
    assert skip["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    before = _run(base_model, tmp_path / "lr0", "optimizer.lr=0.0")[0]
    assert any(not torch.equal(full_w[k], before[k]) for k in full_w)  # the step moved weights
    for key in full_w:
        torch.testing.assert_close(skip_w[key], full_w[key], rtol=1e-5, atol=1e-7)


def test_nothing_skipped_with_a_kl_term(base_model, tmp_path):
    _, rows, row = _run(base_model, tmp_path / "kl", "loss.kl_coeff=0.1")
    assert 0 < row["zero_std_group_fraction"]
    assert sum(rows) == 32



def test_shared_prompt_forward_keeps_the_update(base_model, tmp_path):
    """``share_prompt_forward`` (groups run their prompt once) against the unshared packed
    forward: the same step, to float rounding."""
    shared_w, _, shared = _run(base_model, tmp_path / "shared")
    plain_w, _, plain = _run(base_model, tmp_path / "plain", "share_prompt_forward=false")
    assert 0 < plain["zero_std_group_fraction"] < 1 and plain["grad_norm"] > 0
    assert shared["reward/mean"] == plain["reward/mean"]
    assert shared["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for key in plain_w:
        torch.testing.assert_close(shared_w[key], plain_w[key], rtol=1e-5, atol=1e-7)
