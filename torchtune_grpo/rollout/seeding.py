"""Counter-based seeds: every random number of a run is a pure function of integers.

A seed is mixed from the integers naming its use (``mix_seeds(seed, step, prompt index)``
for a rollout); sampling draws from ``(seed, decode step)`` (:func:`counter_uniform`). The
functions work elementwise on int64 tensors or ints, with 32-bit arithmetic, and broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["counter_uniform", "decode_uniforms", "hash32", "mix_seeds", "rollout_seeds"]

_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor | int) -> torch.Tensor:
    """A 32-bit integer mixing function, elementwise on the low 32 bits of each input.

    Args:
        x: int, or an integer tensor of any shape ``[*]``.

    Returns:
        ``[*]`` int64 (0-d for an int), every value in ``[0, 2**32)``.
    """
    x = torch.as_tensor(x, dtype=torch.long) & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def mix_seeds(*parts: torch.Tensor | int) -> torch.Tensor:
    """Combine integers (or integer tensors, broadcast together) into one 32-bit seed each;
    order matters.

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

    Args:
        seeds: ``[n]`` int64 seeds.
        counter: the decode step.

    Returns:
        ``[n]`` float64.
    """
    bits = mix_seeds(seeds, counter)
    return (bits.double() + 0.5) / 2.0**32


def decode_uniforms(seeds: torch.Tensor, steps: int, device: torch.device | str) -> torch.Tensor:
    """Every uniform number of a rollout, drawn on ``device`` up front: column ``t`` equals
    ``counter_uniform(seeds, t)`` exactly (the same integer hash), so the decode loop reads a
    column per step instead of copying fresh numbers from the host each token.

    Args:
        seeds: ``[n]`` int64 seeds (any device).
        steps: the most decode steps.
        device: where the numbers are made and kept.

    Returns:
        ``[n, steps]`` float64 on ``device``.
    """
    counters = torch.arange(steps, dtype=torch.long, device=device)
    bits = mix_seeds(seeds.to(device=device, dtype=torch.long).unsqueeze(1), counters)
    return (bits.double() + 0.5) / 2.0**32


#: Salt mixed with the draw index into the rollout seeds of extra draws.
EXTRA_ROLLOUT_SALT = 0xD5A


def rollout_seeds(seed: int, step: int, indices: Any, draw: int = 0) -> torch.Tensor:
    """``[B]`` per-prompt rollout seeds of step ``step``: ``mix_seeds(seed, step, index)`` for
    draw 0; extra draw ``k`` of dynamic sampling also mixes in ``k``.

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
