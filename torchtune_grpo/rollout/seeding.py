"""Counter-based seeds: every random number of a run is a pure function of integers.

No random-generator state is kept anywhere. A seed is derived from the integers that identify
what it is for (``mix_seeds(seed, step, prompt index)`` for a prompt's rollout,
``mix_seeds(seed, epoch, 0x5EED)`` for an epoch's shuffle, ...), and sampling draws its uniform
numbers from ``(seed, decode step)`` (:func:`counter_uniform`). So a rollout does not depend on
the number of ranks, on how rows are batched, or on whether the run was resumed, and nothing but
the step has to be checkpointed.

All functions work elementwise on int64 tensors (or Python ints), with 32-bit arithmetic that
never overflows int64, and broadcast like any tensor operation.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["counter_uniform", "hash32", "mix_seeds", "rollout_seeds"]

_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor | int) -> torch.Tensor:
    """A 32-bit integer mixing function, applied elementwise.

    Only the low 32 bits of each input count (negative values wrap as two's complement).

    Args:
        x: int, or an integer tensor of any shape ``[*]``.

    Returns:
        ``[*]`` int64 (a 0-d tensor for an int), every value in ``[0, 2**32)``.
    """
    x = torch.as_tensor(x, dtype=torch.long) & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def mix_seeds(*parts: torch.Tensor | int) -> torch.Tensor:
    """Combine integers (or integer tensors, broadcast together) into one 32-bit seed each.

    Order matters: ``mix_seeds(a, b) != mix_seeds(b, a)`` in general.

    Args:
        *parts: ints, or integer tensors whose shapes broadcast to ``[*]``.

    Returns:
        ``[*]`` int64 seeds in ``[0, 2**32)`` (0-d when every part is an int).
    """
    out = hash32(0x9E3779B9)
    for part in parts:
        out = hash32(out ^ hash32(part))
    return out


def counter_uniform(seeds: torch.Tensor, counter: int) -> torch.Tensor:
    """One uniform number in ``(0, 1)`` per seed, a pure function of ``(seed, counter)``.

    Sampling driven by these numbers depends only on each row's own seed and decode step,
    never on which other rows share its batch, on the number of ranks, or on generator state.

    Args:
        seeds: ``[n]`` int64 seeds.
        counter: the decode step.

    Returns:
        ``[n]`` float64.
    """
    bits = mix_seeds(seeds, counter)
    return (bits.double() + 0.5) / 2.0**32


#: Salt mixed with the draw index into the rollout seeds of extra draws.
EXTRA_ROLLOUT_SALT = 0xD5A


def rollout_seeds(seed: int, step: int, indices: Any, draw: int = 0) -> torch.Tensor:
    """``[B]`` per-prompt rollout seeds of a batch of step ``step``.

    Draw 0 (the step's main batch) is ``mix_seeds(seed, step, index)``; extra draw ``k >= 1`` of
    dynamic sampling mixes ``k`` in as well, so a prompt drawn again in the same step (by an
    extra draw or on a dataset smaller than the draws) gets other samples, and each extra
    draw's rollouts are a pure function of ``(seed, step, k, index)``.

    Args:
        seed: run seed.
        step: zero-based step.
        indices: ``[B]`` dataset indices (tensor or list).
        draw: 0 for the main batch, ``k`` for extra draw ``k``.
    """
    indices = torch.as_tensor(indices, dtype=torch.long)
    if draw == 0:
        return mix_seeds(seed, step, indices)
    return mix_seeds(seed, step, indices, EXTRA_ROLLOUT_SALT, draw)
