"""The asynchronous recipe's pure parts: roles, staleness schedule, config checks, the
trainer's version store and the weight buffers (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.config.loading import load_config
from torchtune_grpo.config.validation import ConfigError, async_errors, validate_config
from torchtune_grpo.training.async_recipe import _validate_async
from torchtune_grpo.training.async_transport import (
    Roles,
    VersionStore,
    _buffers_like,
    _flatten_by_dtype,
    behavior_version,
    last_sent_version,
)


def test_behavior_version_is_fixed_by_step_and_staleness():
    assert [behavior_version(t, 0) for t in range(4)] == [0, 1, 2, 3]
    assert [behavior_version(t, 1) for t in range(4)] == [0, 0, 1, 2]
    assert [behavior_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]
    # 10 steps one-step-off: the last batch (step 9) is sampled by version 8
    assert last_sent_version(10, 1) == 8
    assert last_sent_version(10, 0) == 9


def test_roles_map_every_trainer_shard_to_one_rollout_rank():
    roles = Roles(world_size=8, rollout_ranks=2)
    assert roles.trainer_ranks == 6
    assert [roles.is_trainer(r) for r in range(8)] == [True] * 6 + [False] * 2
    assert roles.shards_of(6) == [0, 2, 4] and roles.shards_of(7) == [1, 3, 5]
    assert all(roles.rollout_rank_of(j) in (6, 7) and j in roles.shards_of(
        roles.rollout_rank_of(j)) for j in range(6))
    assert roles.weight_ranks == [0, 6, 7]


def _cfg(**over):
    return OmegaConf.create({"model": {"_component_": "torchtune.models.llama3_2.llama3_2"},
                             **over})


def test_async_errors_name_the_key():
    assert async_errors(_cfg(rollout_ranks=1), world_size=3) == []
    assert "below the number of processes" in async_errors(_cfg(rollout_ranks=3), 3)[0]
    assert "must divide the 3 trainer ranks" in async_errors(_cfg(rollout_ranks=2), 5)[0]
    lora = _cfg(model={"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"})
    assert "LoRA" in async_errors(lora, 3)[0]
    assert "'tools'" in async_errors(_cfg(tools=[{"_component_": "x.Y"}]), 3)[0]
    assert "'dynamic_sampling'" in async_errors(_cfg(dynamic_sampling={"max_batches": 2}), 3)[0]
    vllm = _cfg(generator={"_component_": "torchtune_grpo.rollout.vllm_engine.VLLMGenerator"})
    assert "'generator'" in async_errors(vllm, 3)[0]


def test_validation_uses_the_trainer_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    # 3 processes, 1 rollout rank: 2 trainers share the global batch of 16 (8 each)
    monkeypatch.setenv("WORLD_SIZE", "3")
    _validate_async(load_config("grpo/quickstart_cpu_async"))
    # a global batch of 15 does not divide over 2 trainer ranks
    with pytest.raises(ConfigError, match="does not divide across 2 ranks"):
        _validate_async(load_config("grpo/quickstart_cpu_async", ["global_batch_size=15"]))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="rollout_ranks"):
        _validate_async(load_config("grpo/quickstart_cpu_async"))
    with pytest.raises(ConfigError, match="max_staleness"):
        monkeypatch.setenv("WORLD_SIZE", "3")
        _validate_async(load_config("grpo/quickstart_cpu_async", ["max_staleness=-1"]))


def test_synchronous_recipe_rejects_async_keys():
    with pytest.raises(ConfigError, match="unknown config key 'rollout_ranks'"):
        validate_config(load_config("grpo/quickstart_cpu_async"))


def test_version_store_swaps_weights_in_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    store = VersionStore()
    store.keep(model, 0)
    v0 = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    v1 = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 3)
    out1 = model(x)
    with store.swapped_in(model, 0):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), v0))
        out0 = model(x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), v1))
    assert not torch.equal(out0, out1)
    store.keep(model, 1)
    store.prune(1)
    assert list(store.versions) == [1]
    full = store.gathered(model, 1, keep=True)
    assert list(full) == [n for n, _ in model.named_parameters()]
    store.keep_full(model, 5, {n: torch.zeros_like(p) for n, p in model.named_parameters()})
    with store.swapped_in(model, 5):
        assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


def test_weight_buffers_round_trip_by_dtype():
    params = [torch.randn(2, 3), torch.randn(4).to(torch.bfloat16), torch.randn(5)]
    flats = _flatten_by_dtype(params)
    assert [f.dtype for f in flats] == [torch.float32, torch.bfloat16]
    targets = [torch.zeros_like(p) for p in params]
    for flat, (empty, members) in zip(flats, _buffers_like(targets)):
        assert empty.shape == flat.shape and empty.dtype == flat.dtype
        offset = 0
        for p in members:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    assert all(torch.equal(a, b) for a, b in zip(params, targets))
