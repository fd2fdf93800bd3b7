"""The parts of the vLLM generator that need no vLLM: weight conversion, LoRA merging, the
conversion of vLLM completions into a Trajectory, and the early errors.

The engine itself is tested in tests/vllm_engine (scripts/test_vllm.sh).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torchtune.models.convert_weights import tune_to_hf

from torchtune_grpo.quickstart.tiny import TINY_MODEL_DIMS, tiny_llama
from torchtune_grpo.rollout import vllm_engine as vg
from torchtune_grpo.rollout.native import NativeGenerator

HF_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}


def test_weight_items_equal_torchtune_full_conversion():
    torch.manual_seed(0)
    model = tiny_llama()
    convert = vg.torchtune_to_hf_converter("LLAMA3_2", HF_CONFIG)
    streamed = dict(vg.hf_weight_items(model, convert))
    whole = tune_to_hf(model.state_dict(), num_heads=4, num_kv_heads=2, dim=64)
    assert streamed.keys() == whole.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in streamed
    for name, tensor in whole.items():
        assert torch.equal(streamed[name], tensor), name


def test_lora_adapters_are_merged_before_the_copy():
    from torchtune.models.llama3_2 import lora_llama3_2

    torch.manual_seed(0)
    model = lora_llama3_2(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0,
                          **TINY_MODEL_DIMS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_()  # adapters that change the weights (B starts at zero)
    convert = vg.torchtune_to_hf_converter("LLAMA3_2", HF_CONFIG)
    items = dict(vg.hf_weight_items(model, convert, lora={"rank": 4, "alpha": 8.0}))
    assert not any("lora" in k for k in items)
    q = model.layers[0].attn.q_proj
    merged = q.weight + (8.0 / 4) * q.lora_b.weight @ q.lora_a.weight
    expected = tune_to_hf({"layers.0.attn.q_proj.weight": merged.detach()}, num_heads=4,
                          num_kv_heads=2, dim=64)["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(items["model.layers.0.self_attn.q_proj.weight"], expected)


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="'GEMMA'.*LLAMA3, LLAMA3_2, QWEN2"):
        vg.torchtune_to_hf_converter("GEMMA", HF_CONFIG)


def _completion(ids, logprobs):
    return SimpleNamespace(token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=lp)}
                                                    for t, lp in zip(ids, logprobs)])


def test_completions_become_a_padded_trajectory():
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[False, True, True], [True, True, True]])
    completions = [_completion([10, 257], [-0.5, -0.25]),  # ends on the stop id
                   _completion([11, 12, 13], [-1.0, -2.0, -3.0])]  # truncated
    traj = vg._trajectory(prompts, mask, completions, {257}, pad_id=0,
                          device=torch.device("cpu"))
    assert traj.tokens.tolist() == [[0, 5, 6, 10, 257, 0], [7, 8, 9, 11, 12, 13]]
    assert traj.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert traj.logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert traj.stopped.tolist() == [True, False]
    assert torch.equal(traj.prompt_mask, mask)


def test_missing_vllm_fails_before_any_model_is_built(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ImportError, match=r"torchtune-grpo\[vllm\]"):
        vg.VLLMGenerator()


def test_generator_knobs_are_checked(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vg.VLLMGenerator(gpu_memory_utilization=1.5)
    gen = vg.VLLMGenerator()
    assert not gen.needs_policy_logprobs(top_k=None)
    assert gen.needs_policy_logprobs(top_k=20)  # vLLM reports top-k-renormalised log-probs
    assert vg.VLLMGenerator(recompute_logprobs=True).needs_policy_logprobs(top_k=None)
    assert not NativeGenerator().needs_policy_logprobs(top_k=20)
