"""Rollout under FSDP2 gathers the weights once (``distributed.gathered_for_inference``).

The fast tests shard a tiny model over 2 gloo processes and look inside the context manager:
parameters unsharded (plain tensors, full shapes) inside, across several forwards, with one
all-gather per FSDP module on entry and none per forward; sharded (DTensors) after, with each
module's own ``reshard_after_forward`` back. The slow test runs the recipe on 2 processes
with ``rollout_gather_weights`` on and off (FSDP's per-forward gathering, the old behaviour)
and a KL term (so the reference model's pass is gathered too): the policy must be unsharded
while it generates in the first run only, and the rollouts (tokens, sampling log-probs), the
metrics and the trained weights must be identical.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    assert_same_weights,
    free_port,
    launch,
    metrics,
    quickstart_overrides,
    run_tune,
)
from torchtune_grpo.rollout.native import NativeGenerator

TINY = {"_component_": "torchtune.models.llama3_2.llama3_2", "vocab_size": 64, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "embed_dim": 32, "max_seq_len": 64}
TINY_LORA = {"_component_": "torchtune.models.llama3_2.lora_llama3_2",
             "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8,
             **{k: v for k, v in TINY.items() if k != "_component_"}}


class RecordingGenerator(NativeGenerator):
    """The native engine, writing each rollout's tokens and log-probs to ``out_dir`` (one
    ``rank{r}_call{i}.pt`` per :meth:`generate` call) so two runs can be compared exactly, and
    whether the policy's parameters were FSDP shards (DTensors) while it generated."""

    def __init__(self, out_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out_dir = Path(out_dir)
        self.calls = 0

    def generate(self, model, request):
        """:meth:`NativeGenerator.generate`, then save ``tokens`` and ``logprobs``."""
        traj = super().generate(model, request)
        rank = int(os.environ.get("RANK", "0"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": traj.tokens, "logprobs": traj.logprobs,
                    "sharded": any(_is_sharded(model))},
                   self.out_dir / f"rank{rank}_call{self.calls}.pt")
        self.calls += 1
        return traj


# ---------------------------------------------------------------------------- fast: 2 gloo ranks
def _is_sharded(model) -> list[bool]:
    from torch.distributed.tensor import DTensor

    return [isinstance(p, DTensor) for p in model.parameters()]


def _worker(rank: int, port: int, cfg_model: dict, activation_checkpointing: bool,
            queue) -> None:
    """One of 2 ranks: shard a tiny model, check the context manager, put a report on ``queue``."""
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from torchtune_grpo import distributed as D
    from torchtune_grpo.policy.model import build_model, meta_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    report: dict = {}
    try:
        D.init_distributed(torch.device("cpu"))
        cfg = OmegaConf.create(cfg_model)
        torch.manual_seed(0)
        shape = meta_model(cfg)
        state = {k: torch.randn(v.shape) * 0.1 for k, v in shape.state_dict().items()
                 if "lora" not in k}
        model = build_model(cfg, state, device=torch.device("cpu"), dtype=torch.float32,
                            world_size=2, trainable=True,
                            activation_checkpointing=activation_checkpointing)
        model.eval()
        full = {n: v.shape for n, v in shape.named_parameters()}
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        tokens = torch.randint(0, cfg_model["vocab_size"], (2, 8))

        gathers = []
        real = _fsdp_param_group.foreach_all_gather

        def counting(*args, **kwargs):
            gathers.append(1)
            return real(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counting
        with torch.no_grad():
            report["sharded_before"] = _is_sharded(model)
            outside = model(tokens)
            per_forward_outside = len(gathers)
            report["sharded_after_outside_forward"] = _is_sharded(model)
            gathers.clear()
            with D.gathered_for_inference(model, None):
                report["gathers_on_entry"] = len(gathers)
                report["sharded_inside"] = _is_sharded(model)
                insides = [model(tokens) for _ in range(3)]
                report["gathers_in_forwards"] = len(gathers) - report["gathers_on_entry"]
                report["sharded_inside_after_forwards"] = _is_sharded(model)
                report["full_shapes_inside"] = [
                    list(p.shape) == list(full[n.replace("_checkpoint_wrapped_module.", "")])
                    for n, p in model.named_parameters()]
            report["sharded_after"] = _is_sharded(model)
            gathers.clear()
            again = model(tokens)
            report["gathers_outside_after"] = len(gathers)
            report["sharded_after_forward_after"] = _is_sharded(model)
            with D.gathered_for_inference(model, enabled=False):
                report["sharded_inside_disabled"] = _is_sharded(model)
        _fsdp_param_group.foreach_all_gather = real
        report["per_forward_outside"] = per_forward_outside
        report["fsdp_modules"] = len(modules)
        report["same_outputs"] = all(torch.equal(outside, x) for x in [*insides, again])
    except Exception as exc:  # pragma: no cover - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        queue.put((rank, report))
        D.destroy()


def _run_workers(cfg_model: dict, activation_checkpointing: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, cfg_model, activation_checkpointing,
                                               queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [reports[r] for r in range(2)]


@pytest.mark.parametrize("cfg_model,ac", [(TINY, False), (TINY, True), (TINY_LORA, True)],
                         ids=["full", "activation_checkpointing", "lora"])
def test_weights_are_gathered_once_and_given_back(cfg_model, ac):
    for report in _run_workers(cfg_model, ac):
        assert "error" not in report, report.get("error")
        n = report["fsdp_modules"]
        assert n >= 3  # each layer and the root
        # outside the block FSDP gathers every module on each forward, and frees the layers
        assert report["per_forward_outside"] >= n
        assert report["sharded_before"] and all(report["sharded_before"])
        # inside: at most one all-gather per FSDP module on entry (FSDP keeps the root's
        # weights after a forward), none per forward, all full tensors
        assert n - 1 <= report["gathers_on_entry"] <= n
        assert report["gathers_in_forwards"] == 0
        assert not any(report["sharded_inside"])
        assert not any(report["sharded_inside_after_forwards"])
        assert all(report["full_shapes_inside"])
        # after: every parameter sharded again, and FSDP's own setting back (layers freed
        # after a forward, the root kept as FSDP keeps it)
        assert all(report["sharded_after"])
        assert report["gathers_outside_after"] == report["per_forward_outside"]
        assert report["sharded_after_forward_after"] == report["sharded_after_outside_forward"]
        assert all(report["sharded_inside_disabled"])
        assert report["same_outputs"]


def test_no_op_without_fsdp():
    from torchtune_grpo.distributed import gathered_for_inference
    from torchtune_grpo.quickstart.tiny import tiny_llama

    model = tiny_llama()
    before = {n: p for n, p in model.named_parameters()}
    with gathered_for_inference(model, None):
        inside = {n: p for n, p in model.named_parameters()}
    assert all(inside[n] is before[n] for n in before)


# ---------------------------------------------------------------------------- slow: the recipe
def _rollouts(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: torch.load(p) for p in sorted(folder.glob("*.pt"))}


@pytest.mark.slow
def test_gather_on_and_off_give_the_same_rollouts_and_weights(base_model, tmp_path):
    runs = {}
    for gather in ("true", "false"):
        out = tmp_path / f"gather_{gather}"
        generator = {"_component_": "tests.recipes.test_rollout_gather.RecordingGenerator",
                     "out_dir": str(out / "rollouts")}
        run_tune([*launch(2), *quickstart_overrides(
            base_model, out, "num_steps=2", "batch_size=4", "save_every_n_steps=null",
            "loss.kl_coeff=0.05", LENGTH_REWARD_OVERRIDE, f"rollout_gather_weights={gather}",
            "generator=" + json.dumps(generator))], cwd=tmp_path)
        runs[gather] = out
    on, off = runs["true"], runs["false"]
    assert_not_degenerate(on, off)
    a, b = _rollouts(on / "rollouts"), _rollouts(off / "rollouts")
    assert sorted(a) == sorted(b) == [f"rank{r}_call{i}.pt" for r in range(2) for i in range(2)]
    for name in a:
        # the recipe gathered the policy for the rollout in one run and not in the other
        assert not a[name]["sharded"] and b[name]["sharded"], name
        assert torch.equal(a[name]["tokens"], b[name]["tokens"]), name
        assert torch.equal(a[name]["logprobs"], b[name]["logprobs"]), name
    for key in ("loss", "kl", "reward/mean", "generation/logprob_diff_max", "grad_norm"):
        assert [r[key] for r in metrics(on)] == [r[key] for r in metrics(off)], key
    assert_same_weights(on / "step_2", off / "step_2")
