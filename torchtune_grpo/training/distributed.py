"""Process-group helpers shared by the recipes: one code path for 1 or many ranks.

Without torchrun's environment (``RANK``/``WORLD_SIZE``) nothing is initialised and every
reduction is the identity, so the single-device recipe and a one-process run of the
distributed recipe execute the same code. gloo has no ``ReduceOp.AVG``: means are SUM / n.
:func:`gathered_for_inference` holds an FSDP2 model's full weights through a no-grad phase
(rollout, reference log-probs, evaluation) instead of gathering them on every forward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def launched_by_torchrun() -> bool:
    """True when torchrun (or ``tune run --nproc_per_node``) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group when launched by torchrun.

    Args:
        device: the device this rank trains on (``nccl`` for CUDA, ``gloo`` otherwise).
        timeout_s: collective timeout: a rank that waits longer on a dead peer raises instead
            of hanging.

    Returns:
        ``(world_size, rank)``; ``(1, 0)`` without torchrun.
    """
    if not launched_by_torchrun():
        return 1, 0
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_world_size(), dist.get_rank()


#: The ranks the collectives below reach: None = the whole world (the default); a
#: ``ProcessGroup`` = that group (the trainer ranks of the asynchronous recipe); ``LOCAL`` = this
#: process alone (a rollout rank: its engine answers to no other rank).
LOCAL = "local"
_SCOPE: Any = None


def set_scope(scope: Any) -> None:
    """Make :func:`world_size`, :func:`rank`, :func:`all_reduce`, :func:`all_ranks_true`,
    :func:`all_gather_object` and :func:`barrier` act on ``scope``: None (every rank of the
    default process group), a ``ProcessGroup`` (its members; call only on members) or
    :data:`LOCAL` (this process alone: reductions are the identity).

    The synchronous recipes never call it. The asynchronous recipe sets its trainer ranks'
    group on the trainers and :data:`LOCAL` on the rollout ranks, so the shared GRPO step runs
    unchanged on each role.
    """
    global _SCOPE
    _SCOPE = scope


def scope() -> Any:
    """The current scope (see :func:`set_scope`)."""
    return _SCOPE


def _group_size() -> int:
    if _SCOPE == LOCAL or not dist.is_initialized():
        return 1
    return dist.get_world_size(_SCOPE)


def world_size() -> int:
    """Number of ranks in the current scope (1 without a process group)."""
    return _group_size()


def rank() -> int:
    """This rank within the current scope (0 without a process group)."""
    if _SCOPE == LOCAL or not dist.is_initialized():
        return 0
    return dist.get_rank(_SCOPE)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a tensor in place over the current scope and return it. ``op``: ``sum``,
    ``max`` or ``min``."""
    if _group_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op], group=_SCOPE)
    return tensor


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is True on every rank of the scope (a collective: call it on all)."""
    if _group_size() <= 1:
        return flag
    t = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_SCOPE)
    return int(t.item()) == 0


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank of the scope, in rank order (``[obj]`` alone)."""
    if _group_size() <= 1:
        return [obj]
    gathered: list[Any] = [None] * _group_size()
    dist.all_gather_object(gathered, obj, group=_SCOPE)
    return gathered


def barrier() -> None:
    """Barrier over the scope when a process group exists."""
    if _SCOPE != LOCAL and dist.is_initialized():
        dist.barrier(group=_SCOPE)


def destroy() -> None:
    """Tear the process group down, if any (and reset the scope)."""
    set_scope(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_modules(models: tuple[nn.Module | None, ...]) -> list[nn.Module]:
    """Every FSDP2-wrapped module (``fully_shard``) inside ``models``, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    found = []
    for model in models:
        for module in () if model is None else model.modules():
            if isinstance(module, FSDPModule) and id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    return found


@contextlib.contextmanager
def gathered_for_inference(*models: nn.Module | None, enabled: bool = True) -> Iterator[None]:
    """All-gather the FSDP2-sharded ``models``' weights once and hold them for the block.

    FSDP2 gathers a layer's weights before each forward through it and, with
    ``reshard_after_forward`` (the config's ``fsdp_reshard_after_forward``, default true),
    frees them after. A rollout runs one forward per decode step, so it would all-gather every
    layer ``max_generated_tokens`` times. Inside this block every FSDP module of ``models`` is
    unsharded once (``FSDPModule.unshard``) and set not to reshard after forward
    (``set_reshard_after_forward(False)``), so the forwards in it reuse the gathered weights;
    on exit (also on an exception) every module is resharded (``FSDPModule.reshard``: the full
    weights are freed before the update) and its own ``reshard_after_forward`` setting is
    restored. The cost is one full, unsharded copy of the weights for the block's duration
    (``tune-grpo estimate-memory`` counts it in the rollout and reference phases).

    A no-op when ``enabled`` is False or no model is FSDP-sharded (one device), and for
    ``None`` entries (e.g. no reference model). Works with LoRA (adapters are parameters of the
    same FSDP modules), activation checkpointing (a no-grad forward recomputes nothing) and
    CPU offload (the gathered copy lives on the device). Use it only around no-grad work: a
    backward inside would find the parameters in the wrong state. A collective: every rank
    must enter and leave the block together.

    Args:
        models: FSDP2 roots (as built by :func:`torchtune_grpo.policy.model.build_model`) or
            plain modules or None.
        enabled: False keeps FSDP's per-forward gathering (``rollout_gather_weights: false``).
    """
    modules = _fsdp_modules(models) if enabled else []
    if not modules:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    for model in models:  # decide the roots first, as their first forward would
        if isinstance(model, FSDPModule):
            model._get_fsdp_state()._lazy_init()
    # set_reshard_after_forward is public but has no getter: remember the exact per-group
    # setting (the root's special "never reshard" included) to put it back afterwards
    saved = []
    for module in modules:
        state = module._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
    try:
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
        handles = [module.unshard(async_op=True) for module in modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for module in modules:
            module.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info
