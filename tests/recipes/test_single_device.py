"""Single-device recipe, gradient accumulation exactness (in-process runs, one rank)."""

from __future__ import annotations

import pytest
import torch

from tests.recipes._helpers import metrics, quickstart_overrides, run_tune
from torchtune_grpo.config import load_config
from torchtune_grpo.recipe import GRPORecipe

pytestmark = pytest.mark.slow


LENGTH_REWARD = [{"_component_": "tests.recipes.components.length_reward", "success": True,
                  "success_threshold": 3.0}]


def train_in_process(base, out, *overrides: str, rewards=None) -> GRPORecipe:
    """Run the recipe in this process (no torchrun, no FSDP) and return it."""
    cfg = load_config("grpo/quickstart_cpu", quickstart_overrides(base, out, *overrides)[2:])
    if rewards is not None:
        cfg.rewards = rewards
    recipe = GRPORecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    return recipe


def _weights(recipe):
    return {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_gradient_accumulation_gives_the_same_update(base_model, tmp_path, aggregation):
    common = ["num_steps=1", "batch_size=4", "group_size=4", "temperature=1.5",
              f"loss.aggregation={aggregation}", "loss.max_generated_tokens=5",
              # SGD: the update is proportional to the gradient (Adam's first step is ~sign(g),
              # which amplifies rounding noise in near-zero gradients)
              "optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5",
              "~optimizer.weight_decay", "clip_grad_norm=null"]
    one = train_in_process(base_model, tmp_path / "g1", *common, rewards=LENGTH_REWARD)
    # the native engine's log-probs are the policy's (tempered, restricted vocabulary)
    assert 0 <= one.last_metrics["generation/logprob_diff_max"] < 1e-4
    assert one.last_metrics["time/weight_sync"] < 0.1  # nothing to copy
    assert 0.1 < one.last_metrics["peak_memory_gb"] < 20  # CPU: the process's peak RSS
    for accum, fbs in ((2, 8), (4, 4)):
        other = train_in_process(base_model, tmp_path / f"g{accum}", *common,
                                 f"gradient_accumulation_steps={accum}",
                                 f"forward_batch_size={fbs}", rewards=LENGTH_REWARD)
        assert other.last_metrics["reward/mean"] == one.last_metrics["reward/mean"]
        w1, w2 = _weights(one), _weights(other)
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-5, atol=1e-7)
    # the step did change the weights
    from safetensors.torch import load_file
    start = load_file(str(base_model / "model.safetensors"))
    assert not torch.equal(start["model.embed_tokens.weight"], w1["tok_embeddings.weight"])


def test_bad_accumulation_is_rejected_before_loading(base_model, tmp_path):
    from torchtune_grpo.config import ConfigError

    cfg = load_config("grpo/quickstart_cpu", quickstart_overrides(
        base_model, tmp_path, "batch_size=6", "gradient_accumulation_steps=4")[2:])
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
    cfg = load_config(f"grpo/quickstart_cpu_{variant}", [
        f"model_dir={base_model}", f"output_dir={tmp_path}", "num_steps=2", "batch_size=4",
        "progress_bar=false", "eval_every_n_steps=null", "eval_at_start=false"])
    recipe = GRPORecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    assert (recipe.ref_model is not None) == (variant == "kl")
    assert recipe.step == 2 and (tmp_path / "step_2" / "CHECKPOINT_COMPLETE").is_file()


def test_masking_truncated_completions_removes_them_from_the_loss(base_model, tmp_path):
    # two tokens are rarely enough for "abcd" + stop: most completions are truncated
    common = ["num_steps=1", "batch_size=4", "group_size=4", "temperature=1.5",
              "max_generated_tokens=2", "optimizer._component_=torch.optim.SGD",
              "optimizer.lr=0.5", "~optimizer.weight_decay"]
    rewards = [{"_component_": "tests.recipes.components.length_reward", "success": True},
               {"_component_": "torchtune_grpo.rlhf.rewards.OverlongPenalty",
                "cache_tokens": 1}]
    kept = train_in_process(base_model, tmp_path / "k", *common, rewards=rewards)
    masked = train_in_process(base_model, tmp_path / "m", *common,
                              "mask_truncated_completions=true", rewards=rewards)
    assert kept.last_metrics["truncated_fraction"] > 0.5
    assert kept.last_metrics["reward/overlong"] < 0.0  # truncated rows hit the soft penalty
    # the same rollouts; the masked update ignores the truncated completions
    assert masked.last_metrics["reward/mean"] == kept.last_metrics["reward/mean"]
    assert masked.last_metrics["grad_norm"] != kept.last_metrics["grad_norm"]
    for name in ("loss", "grad_norm"):
        assert masked.last_metrics[name] == masked.last_metrics[name]  # not NaN
