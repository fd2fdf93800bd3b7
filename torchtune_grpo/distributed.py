"""Process-group helpers shared by the recipes: one code path for 1 or many ranks.

Without torchrun's environment (``RANK``/``WORLD_SIZE``) nothing is initialised and every
reduction is the identity, so the single-device recipe and a one-process run of the
distributed recipe execute the same code. gloo has no ``ReduceOp.AVG``: means are SUM / n.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


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


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a tensor in place and return it. ``op``: ``sum``, ``max`` or ``min``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op])
    return tensor


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is True on every rank (a collective: call it on all ranks)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item()) == 0


def barrier() -> None:
    """Barrier when a process group exists."""
    if dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """Tear the process group down, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
