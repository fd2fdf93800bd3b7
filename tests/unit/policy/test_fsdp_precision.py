"""FSDP2 gradient reduction in float32 for a bf16 policy (``fsdp_reduce_dtype``,
:func:`~torchtune_grpo.policy.model.shard_policy`).

Fast: the key is checked and reaches ``build_model``; every ``fully_shard`` call gets the
mixed-precision policy. Slow (``distributed``): three gloo ranks each run one backward of
a bf16 tiny model on their own tokens, through
:func:`~torchtune_grpo.policy.model.build_model` with ``reduce_dtype`` float32 and bf16. Each
rank also runs the same backward on an unsharded copy: those are the gradients FSDP2 reduces. With
float32 reduction the sharded gradient is exactly the bf16 rounding of the float32 average of
the three; with bf16 reduction it is not (the partial sum of two ranks is rounded to bf16 before
the third is added). Two ranks could not tell them apart: a bf16 sum of two bf16 numbers is
rounded once, as the float32 one is.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.policy import model as policy_model
from torchtune_grpo.policy.model import meta_model, shard_policy
from torchtune_grpo.quickstart.tiny import TINY_MODEL_DIMS, tiny_llama

# the spawned ranks import this module: the config and training imports stay in the tests

RANKS = 3
TINY = {"_component_": "torchtune_grpo.quickstart.tiny.tiny_llama", "num_layers": 1}


def test_every_fsdp_unit_gets_the_mixed_precision_policy(monkeypatch):
    calls = []
    monkeypatch.setattr(policy_model, "fully_shard",
                        lambda module, **kwargs: calls.append((module, kwargs)))
    model = meta_model(OmegaConf.create({**TINY, "num_layers": 2}))
    shard_policy(model, dtype=torch.bfloat16, reduce_dtype=torch.float32, cpu_offload=True,
                 reshard_after_forward=False, dp_mesh="mesh")
    assert [m for m, _ in calls] == [model.layers[1], model.layers[0], model]
    for _, kwargs in calls:
        mp = kwargs["mp_policy"]
        assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
        assert kwargs["reshard_after_forward"] is False and kwargs["mesh"] == "mesh"
        assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"


@pytest.mark.parametrize("value, expected", [(None, torch.float32), ("bf16", torch.bfloat16)])
def test_the_config_key_reaches_the_model_build(value, expected, monkeypatch):
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.schema import with_defaults
    from torchtune_grpo.training import parts

    overrides = [] if value is None else [f"fsdp_reduce_dtype={value}"]
    cfg = with_defaults(load_config("grpo/quickstart_cpu", overrides))
    seen = {}
    monkeypatch.setattr(parts.config, "instantiate", lambda *a, **k: None)
    monkeypatch.setattr(parts, "load_weights", lambda checkpointer: {})
    monkeypatch.setattr(parts, "check_finite", lambda *a, **k: None)
    monkeypatch.setattr(parts, "build_model", lambda *a, **k: seen.update(k))
    parts.build_policy(cfg, None, is_lora=False, needs_reference=False,
                       device=torch.device("cpu"), dtype=torch.bfloat16, world_size=2,
                       is_rank_zero=True, dp_mesh=None)
    assert seen["reduce_dtype"] == expected


def test_a_bad_reduce_dtype_names_the_key():
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import ConfigError, validate_config

    with pytest.raises(ConfigError, match="'fsdp_reduce_dtype' must be fp32 or bf16"):
        validate_config(load_config("grpo/quickstart_cpu", ["fsdp_reduce_dtype=fp16"]))


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return out


def _backward(model, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, TINY_MODEL_DIMS["vocab_size"], (2, 12), generator=g)
    weights = torch.randn(2, 12, TINY_MODEL_DIMS["vocab_size"], generator=g)
    (model(tokens).float() * weights).sum().backward()


def _worker(rank: int, port: int, state_path: str, out_dir: str) -> None:
    from torchtune_grpo import distributed as D
    from torchtune_grpo.policy.model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    D.init_distributed(torch.device("cpu"))
    try:
        state = torch.load(state_path)
        cfg = OmegaConf.create(TINY)
        out = {}
        plain = build_model(cfg, state, device=torch.device("cpu"), dtype=torch.bfloat16,
                            world_size=1)
        _backward(plain, rank)
        out["local"] = _grads(plain)
        for name, reduce_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = build_model(cfg, state, device=torch.device("cpu"), dtype=torch.bfloat16,
                                world_size=RANKS, reduce_dtype=reduce_dtype)
            _backward(model, rank)
            out[name] = _grads(model)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
        D.WORLD.barrier()
    finally:
        D.destroy()


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_gradients_are_reduced_in_float32(tmp_path):
    """A CPU (gloo) test of what FSDP2 does on NCCL too: the reduction's dtype."""
    import torch.multiprocessing as mp

    from tests.recipes._helpers import free_port

    torch.manual_seed(0)
    torch.save(tiny_llama(num_layers=1).state_dict(), tmp_path / "state.pt")
    mp.spawn(_worker, args=(free_port(), str(tmp_path / "state.pt"), str(tmp_path)),
             nprocs=RANKS, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RANKS)]
    rounded_differently = 0
    for name, got in runs[0]["fp32"].items():
        local = [run["local"][name].float() for run in runs]
        assert all(g.dtype == torch.bfloat16 for g in (got, runs[0]["bf16"][name]))
        expected = ((local[0] + local[1] + local[2]) / RANKS).bfloat16()
        assert torch.equal(got, expected), name
        bf16 = runs[0]["bf16"][name]
        rounded_differently += int((bf16 != expected).sum())
        # two bf16 roundings of partial sums: within 2**-8 of the summands' magnitudes each
        scale = (local[0].abs() + local[1].abs() + local[2].abs()) / RANKS
        assert ((bf16.float() - expected.float()).abs() <= 2**-6 * scale).all(), name
    assert rounded_differently > 0
