"""Process-group helpers: one code path for 1 or many ranks.

Without torchrun's environment nothing is initialised and every reduction is the identity.
"""

from __future__ import annotations

import contextlib
import gc
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


#: :attr:`Ranks.group` of a process alone: its collectives are the identity.
LOCAL = "local"


class Ranks:
    """The ranks that a recipe's collectives reach, passed explicitly to whoever reduces.

    Without an initialised process group every method acts on this process alone. gloo has no
    ``ReduceOp.AVG``: means are SUM / n.

    Args:
        group: None (the default process group), a ``ProcessGroup`` (its members; use it only
            on members) or :data:`LOCAL` (this process alone).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __repr__(self) -> str:
        return f"Ranks({self.group!r})"

    @property
    def alone(self) -> bool:
        """True when no other rank takes part (``LOCAL``, or no process group)."""
        return self.group == LOCAL or not dist.is_initialized()

    def size(self) -> int:
        """Number of ranks (1 alone)."""
        return 1 if self.alone else dist.get_world_size(self.group)

    def rank(self) -> int:
        """This process's rank among them (0 alone)."""
        return 0 if self.alone else dist.get_rank(self.group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce ``tensor`` in place and return it. ``op``: ``sum``, ``max`` or ``min``."""
        if self.size() > 1:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=self.group)
        return tensor

    def all_ranks_true(self, flag: bool | torch.Tensor, device: torch.device) -> bool:
        """True when ``flag`` is True on every rank (a collective: call it on all).

        ``flag`` may be a one-element bool tensor on ``device`` (a decode loop's "all my rows
        stopped"): it is reduced where it is, and the answer costs one host read in all.
        """
        if self.size() <= 1:
            return bool(flag)
        if isinstance(flag, torch.Tensor):
            t = (~flag.reshape(1).to(device=device, dtype=torch.bool)).long()
        else:
            t = torch.tensor([0 if flag else 1], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item()) == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``[obj]`` alone)."""
        if self.size() <= 1:
            return [obj]
        gathered: list[Any] = [None] * self.size()
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Barrier over the ranks when a process group exists."""
        if not self.alone:
            dist.barrier(group=self.group)


#: Every rank of the default process group (this process alone without torchrun).
WORLD = Ranks(None)
#: This process alone, whatever process groups exist (an asynchronous rollout rank).
ALONE = Ranks(LOCAL)


def destroy() -> None:
    """Tear every process group down, if any, while the interpreter is whole.

    Unreachable FSDP2 modules (reference cycles) keep their device mesh, and so the gloo
    backend, alive until a garbage collection; left to the interpreter's exit, the backend's
    C++ teardown can abort the process after the run's work is done. They are collected
    first.
    """
    if dist.is_initialized():
        gc.collect()
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


def _param_groups(state) -> list:
    """The FSDP parameter groups of one FSDP2 state: torch 2.13 keeps a list
    (``_fsdp_param_groups``), torch 2.11 one group or None (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


@contextlib.contextmanager
def gathered_for_inference(*models: nn.Module | None, enabled: bool = True) -> Iterator[None]:
    """All-gather the FSDP2-sharded ``models``' weights once and hold them for the block.

    Inside the block every FSDP module is unsharded once and set not to reshard after forward,
    so the no-grad forwards of a rollout reuse the gathered weights; on exit (also on an
    exception) every module is resharded and its ``reshard_after_forward`` setting restored. Costs
    one full copy of the weights for the block. A no-op when ``enabled`` is False, for ``None``
    entries and for models that are not FSDP-sharded. Use it only around no-grad work; a
    collective: every rank must enter and leave the block together.

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
                      [(g, g.post_forward_mesh_info) for g in _param_groups(state)]))
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



def fully_unsharded(model: nn.Module) -> bool:
    """Whether every FSDP2 module inside ``model`` holds its gathered (unsharded) parameters,
    as inside :func:`gathered_for_inference` (True for a model that is not sharded)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    for module in _fsdp_modules((model,)):
        for group in _param_groups(module._get_fsdp_state()):
            if any(p.sharded_state != ShardedState.UNSHARDED for p in group.fsdp_params):
                return False
    return True


def hook_free_view(model: nn.Module) -> nn.Module:
    """The module tree of ``model`` without forward hooks, for no-grad work on gathered weights.

    Each module is a shallow copy that shares its original's parameter and buffer dicts (so
    FSDP2's swap of sharded for gathered parameters, done in place on those dicts, shows in
    the view too), with its children replaced by their views and no forward hooks. Inside
    :func:`gathered_for_inference` FSDP2's hooks have nothing left to do, and a compiled
    forward cannot trace them (they are ``torch._dynamo``-disabled): the view runs the same
    arithmetic on the same tensors, as one graph. Run it only where :func:`fully_unsharded`
    holds. Attributes set on the view later (a rollout's KV caches) stay off the original.

    Args:
        model: a module, FSDP2-sharded or not.

    Returns:
        The view, built once: keep it, do not rebuild it per call.
    """
    from collections import OrderedDict

    def view(module: nn.Module) -> nn.Module:
        clone = object.__new__(type(module))  # not copy.copy: FSDPModule.__new__ re-inits
        clone.__dict__.update(module.__dict__)
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            object.__setattr__(clone, name, OrderedDict())
        for name in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called"):
            object.__setattr__(clone, name, {})
        object.__setattr__(clone, "_modules", {
            name: None if child is None else view(child)
            for name, child in module._modules.items()})
        return clone

    return view(model)


def set_seed(seed: int) -> int:
    """torchtune's ``training.set_seed`` (rank ``r`` seeds its generators with ``seed + r``),
    without its "Local seed is seed + rank" line on every run; returns ``seed``."""
    import logging

    from torchtune import training

    logger = logging.getLogger("torchtune.utils._logging")
    level = logger.level
    logger.setLevel(max(level, logging.INFO))
    try:
        return training.set_seed(seed)
    finally:
        logger.setLevel(level)


#: What gloo and NCCL say when the other end of a collective or a message died.
_PEER_DIED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "NCCL communicator was aborted")


def peer_died(exc: BaseException) -> str | None:
    """Why a collective or point-to-point call failed, when it failed because another rank's
    process died (not a fault of this rank): ``"its connection closed"``, the same words on
    every rank whatever the transport's own (addresses, ports); None for any other failure."""
    died = isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_DIED)
    return "its connection closed" if died else None
