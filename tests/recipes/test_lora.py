"""LoRA GRPO: only adapters train, the reference is the adapter-free policy, saves load back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torchtune.models.convert_weights import hf_to_tune

from tests.recipes._helpers import (
    LENGTH_REWARD,
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    assert_same_metrics,
    assert_same_weights,
    expect_killed,
    launch,
    metrics,
    quickstart_overrides,
    run_tune,
    train_in_process,
    train_metrics,
)
from torchtune_grpo.policy.forward import response_logprobs
from torchtune_grpo.policy.positions import attention_mask, position_ids
from torchtune_grpo.quickstart.tiny import tiny_llama

pytestmark = pytest.mark.slow

LORA = ["model._component_=torchtune.models.llama3_2.lora_llama3_2",
        "model.lora_attn_modules=[q_proj,v_proj,output_proj]", "model.lora_rank=4",
        "model.lora_alpha=8", "model.apply_lora_to_mlp=true"]


def _hf_to_tune(path):
    return hf_to_tune(load_file(str(path)), num_heads=4, num_kv_heads=2, dim=64, head_dim=16)


def test_lora_trains_adapters_only_and_uses_base_as_reference(base_model, tmp_path):
    recipe = train_in_process(
        base_model, tmp_path / "lora", *LORA, "num_steps=2", "batch_size=4", "group_size=4",
        "temperature=1.5", "loss.kl_coeff=0.05", "optimizer.lr=0.05", rewards=LENGTH_REWARD)
    assert recipe.is_lora and recipe.ref_model is None  # no second copy of the weights
    base = _hf_to_tune(base_model / "model.safetensors")
    adapters, frozen = 0, 0
    for name, param in recipe.model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
            adapters += 1
        else:
            assert not param.requires_grad
            assert torch.equal(param.detach(), base[name]), name
            frozen += 1
    assert adapters > 0 and frozen > 0
    assert any("lora_b" in n and p.abs().sum() > 0 for n, p in recipe.model.named_parameters())
    assert train_metrics(tmp_path / "lora")[-1]["kl"] > 0  # the adapted policy left the base

    # reference log-probs (adapters disabled) equal a plain base model's
    plain = tiny_llama()
    plain.load_state_dict(base)
    prompts = torch.tensor([[256, 49, 43, 50, 61, 52, 265], [260, 256, 55, 43, 55, 61, 265]])
    padding = prompts != 260
    from torchtune_grpo.algorithm.trajectory import Trajectory

    traj = Trajectory(tokens=prompts, prompt_mask=padding[:, :5], response_mask=padding[:, 5:],
                      logprobs=torch.zeros(2, 2), stopped=torch.ones(2, dtype=torch.bool),
                      pad_id=260)
    ref = recipe.reference_logprobs(traj)
    expected, _ = response_logprobs(plain, prompts, prompt_len=5, mask=attention_mask(padding),
                                    input_pos=position_ids(padding),
                                    temperature=recipe.cfg.temperature,
                                    logit_bias=recipe.logit_bias)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)

    # the saved merged weights reproduce the adapted policy
    step = tmp_path / "lora" / "step_2"
    assert (step / "adapter_config.json").is_file()
    assert list(step.glob("adapter_model.*"))
    merged = tiny_llama()
    merged.load_state_dict(_hf_to_tune(step / "model-00001-of-00001.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(merged(prompts), recipe.model(prompts), rtol=1e-4, atol=1e-4)


def test_lora_resume_and_two_processes(base_model, tmp_path):
    """Two processes; killed after step 3 and resumed from step_2, a run saves the same adapters
    and merged weights, bitwise, as one that was never interrupted."""
    def args(out, *extra):
        return quickstart_overrides(base_model, out, *LORA, "num_steps=3", "batch_size=4",
                                    "loss.kl_coeff=0.02", "save_every_n_steps=2",
                                    LENGTH_REWARD_OVERRIDE, *extra)

    full = tmp_path / "full"
    run_tune([*launch(2), *args(full)], cwd=tmp_path)
    out = tmp_path / "run"
    expect_killed([*launch(2), *args(
        out, "metric_logger._component_=crash_helpers.KillAfterStepLogger",
        "metric_logger.kill_at_step=3")], tmp_path)
    assert (out / "step_2" / "adapter_config.json").is_file()
    assert not (out / "step_3").exists()
    run_tune([*launch(2), *args(out, "resume_from_checkpoint=true")], cwd=tmp_path)
    assert [int(r["step"]) for r in metrics(out)] == [1, 2, 3]
    assert_same_weights(full / "step_3", out / "step_3")  # adapters and merged weights
    assert_same_metrics(full, out, steps=[3])
    assert_not_degenerate(full, weights=(base_model, full / "step_2", full / "step_3"))
