"""Single-device recipe, gradient accumulation exactness (in-process runs, one rank)."""

from __future__ import annotations

import pytest
import torch

from tests.recipes._helpers import (
    LENGTH_REWARD,
    assert_not_degenerate,
    metrics,
    quickstart_config,
    quickstart_overrides,
    run_tune,
    train_in_process,
    train_metrics,
)
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow


def _weights(recipe):
    return {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}


@pytest.mark.parametrize(
    "aggregation, estimator",
    [("sequence_mean", "grpo"), ("token_mean", "grpo"), ("constant", "grpo"),
     # REINFORCE++ normalises over the whole batch: its statistics must not be per micro-batch
     ("token_mean", "reinforce_pp")],
)
def test_gradient_accumulation_gives_the_same_update(base_model, tmp_path, aggregation,
                                                     estimator):
    common = ["num_steps=1", "batch_size=4", "group_size=4", "temperature=1.5",
              f"loss.aggregation={aggregation}", "loss.max_generated_tokens=5",
              f"advantages.estimator={estimator}",
              # SGD: the update is proportional to the gradient (Adam's first step is ~sign(g),
              # which amplifies rounding noise in near-zero gradients)
              "optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5",
              "~optimizer.weight_decay", "clip_grad_norm=null"]
    one = train_in_process(base_model, tmp_path / "g1", *common, rewards=LENGTH_REWARD)
    (row,) = train_metrics(tmp_path / "g1")
    # the native engine's log-probs are the policy's (tempered, restricted vocabulary)
    assert 0 <= row["generation/logprob_diff_max"] < 1e-4
    for accum, fbs in ((2, 8), (4, 4)):
        other = train_in_process(base_model, tmp_path / f"g{accum}", *common,
                                 f"gradient_accumulation_steps={accum}",
                                 f"forward_batch_size={fbs}", rewards=LENGTH_REWARD)
        assert train_metrics(tmp_path / f"g{accum}")[-1]["reward/mean"] == row["reward/mean"]
        w1, w2 = _weights(one), _weights(other)
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-5, atol=1e-7)
    # the step did change the weights, from rewards that varied within the groups
    assert_not_degenerate(tmp_path / "g1", weights=(base_model, tmp_path / "g1" / "step_1"))


def test_native_engine_step_timing_and_memory(base_model, tmp_path):
    """Wall-clock and memory metrics of a short run (machine measurements: loose bounds)."""
    train_in_process(base_model, tmp_path, "num_steps=1", "batch_size=2", "group_size=2")
    (row,) = train_metrics(tmp_path)
    assert row["time/weight_sync"] < 1.0  # nothing to copy (the bound allows a loaded machine)
    assert 0.1 < row["peak_memory_gb"] < 20  # CPU: the process's peak RSS


def test_bad_accumulation_is_rejected_before_loading(base_model, tmp_path):
    from torchtune_grpo.config.validation import ConfigError

    cfg = quickstart_config(base_model, tmp_path, "batch_size=6", "gradient_accumulation_steps=4")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        GRPORecipe(cfg)


def test_single_device_recipe_via_tune_run(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_single_device",
              *quickstart_overrides(base_model, out, "num_steps=2",
                                    "gradient_accumulation_steps=2")], cwd=tmp_path, threads=2)
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert (out / "step_2" / "CHECKPOINT_COMPLETE").is_file()


@pytest.mark.parametrize("variant", ["dapo", "dr_grpo", "gspo", "cispo", "kl"])
def test_loss_variant_configs_train(base_model, tmp_path, variant):
    recipe = train_in_process(base_model, tmp_path, "num_steps=2", "batch_size=4",
                              config=f"grpo/quickstart_cpu_{variant}")
    assert (recipe.ref_model is not None) == (variant == "kl")
    assert recipe.step == 2 and (tmp_path / "step_2" / "CHECKPOINT_COMPLETE").is_file()


def test_masking_truncated_completions_removes_them_from_the_loss(base_model, tmp_path):
    # two tokens are rarely enough for "abcd" + stop: most completions are truncated
    common = ["num_steps=1", "batch_size=4", "group_size=4", "temperature=1.5",
              "max_generated_tokens=2", "optimizer._component_=torch.optim.SGD",
              "optimizer.lr=0.5", "~optimizer.weight_decay"]
    rewards = [{"_component_": "tests.recipes.components.length_reward", "success": True},
               {"_component_": "torchtune_grpo.rewards.components.OverlongPenalty",
                "cache_tokens": 1}]
    train_in_process(base_model, tmp_path / "k", *common, rewards=rewards)
    train_in_process(base_model, tmp_path / "m", *common, "mask_truncated_completions=true",
                     rewards=rewards)
    (k,), (m,) = train_metrics(tmp_path / "k"), train_metrics(tmp_path / "m")
    assert_not_degenerate(tmp_path / "k", tmp_path / "m")
    assert k["truncated_fraction"] > 0.5
    assert k["reward/overlong"] < 0.0  # truncated rows hit the soft penalty
    # the same rollouts; the masked update ignores the truncated completions
    assert m["reward/mean"] == k["reward/mean"]
    assert m["grad_norm"] != k["grad_norm"]
    for name in ("loss", "grad_norm"):
        assert m[name] == m[name]  # not NaN
