"""Group-relative advantages: GRPO's group z-score, Dr. GRPO, RLOO and REINFORCE++.

``N = prompts * G`` completions lie in contiguous groups of ``G``; each completion gets one
advantage, relative to its group. Batch-wide statistics are float64 sums over every rank, so
the advantages do not depend on how many ranks share the batch. ``docs/losses.md`` gives the
formulas of each estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_ESTIMATORS", "ADVANTAGE_SCALES", "DEFAULT_EPS", "DEFAULT_ESTIMATOR",
           "DEFAULT_SCALE", "AdvantageOutput", "group_advantages"]

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
ADVANTAGE_SCALES = ("group", "batch", "none")
#: Default ``estimator`` (also of the config's ``advantages.estimator``).
DEFAULT_ESTIMATOR = "grpo"
#: ``scale`` of the ``grpo`` estimator when none is given (the config's ``advantages.scale:
#: null``).
DEFAULT_SCALE = "group"
#: Default ``eps`` (also of the config's ``advantages.eps``).
DEFAULT_EPS = 1e-6


class AdvantageOutput(NamedTuple):
    """Result of :func:`group_advantages`.

    Attributes:
        advantages (Tensor): ``[N]`` float32, one advantage per completion.
        zero_std_groups (Tensor): ``[N // G]`` bool, True for groups whose rewards are all equal
            (their advantages are exactly zero, except under ``reinforce_pp``).
    """

    advantages: Tensor
    zero_std_groups: Tensor


def _unbiased_std(x: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased standard deviation that is ``0`` (not NaN) for a single sample.

    Args:
        x (Tensor): values, any shape.
        dim (int | None): dimension to reduce; ``None`` reduces over all elements.

    Returns:
        Tensor: standard deviation, reduced over ``dim``.
    """
    count = x.numel() if dim is None else x.shape[dim]
    if count < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim))
    return x.std() if dim is None else x.std(dim=dim)


def _global_mean_std(values: Tensor, weights: Tensor,
                     reduce_sum: Callable[[Tensor], Tensor] | None,
                     *, unbiased: bool) -> tuple[float, float]:
    """Weighted mean and standard deviation of ``values`` over every rank, in float64 (two passes).

    Args:
        values: ``[N]`` this rank's values.
        weights: ``[N]`` their non-negative weights (1 each, or token counts).
        reduce_sum: sums a float64 tensor over the ranks in place and returns it (None: this
            process holds every value).
        unbiased: divide by ``sum(w) - 1`` (Bessel) instead of ``sum(w)``.

    Returns:
        ``(mean, std)``; ``(0, 0)`` when the weights sum to 0, std 0 when ``unbiased`` and the
        weights sum to 1 or less.
    """
    x, w = values.double(), weights.double()
    sums = torch.stack([w.sum(), (w * x).sum()])
    if reduce_sum is not None:
        sums = reduce_sum(sums)
    total, weighted = (float(v) for v in sums.tolist())
    if total <= 0:
        return 0.0, 0.0
    mean = weighted / total
    squares = (w * (x - mean) ** 2).sum().reshape(1)
    if reduce_sum is not None:
        squares = reduce_sum(squares)
    divisor = total - 1 if unbiased else total
    var = float(squares.item()) / divisor if divisor > 0 else 0.0
    return mean, var ** 0.5


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    estimator: str = DEFAULT_ESTIMATOR,
    scale: str | None = None,
    eps: float = DEFAULT_EPS,
    token_counts: Tensor | None = None,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> AdvantageOutput:
    """Group-relative advantages of ``N`` completions in contiguous groups of ``group_size``.

    A group whose rewards are all equal is flagged in ``zero_std_groups``; under ``grpo`` and
    ``rloo`` its advantages are exactly 0. Standard deviations are unbiased (divisor ``G - 1``).

    Args:
        rewards (Tensor): ``[N]`` rewards (any real dtype), groups contiguous.
        group_size (int): ``G``, completions per prompt; must divide ``N``.
        estimator (str): ``"grpo"``, ``"rloo"`` or ``"reinforce_pp"``.
        scale (str | None): ``grpo`` only: ``"group"`` (default when None) divides by the
            group's std, ``"batch"`` by the global batch's std, ``"none"`` does not divide.
        eps (float): added to the standard deviation before dividing; ``>= 0``.
        token_counts (Tensor | None): ``[N]`` response tokens per completion, the weights of
            ``reinforce_pp``'s token-level statistics (None: 1 each).
        reduce_sum (callable | None): sums a float64 tensor over the ranks that share the batch;
            called once, on every rank, by ``scale="batch"`` and ``reinforce_pp`` only. None: this
            process holds the whole batch.

    Returns:
        AdvantageOutput: ``advantages [N]`` float32 and ``zero_std_groups [N // G]`` bool.

    Raises:
        ValueError: if ``rewards`` is not 1-D or not finite, ``group_size`` is not a positive
            integer dividing ``N`` (at least 2 for ``rloo`` and ``reinforce_pp``), ``estimator``
            or ``scale`` is unknown, ``scale`` is given to another estimator than ``grpo``,
            ``token_counts`` does not have ``N`` non-negative entries, or ``eps`` is negative.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(
            f"rewards must be a 1-D tensor [N] with one reward per completion, got {shape}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards N={n}; pass all "
            "group_size completions of every prompt together"
        )
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if scale is not None and estimator != "grpo":
        raise ValueError(f"scale={scale!r} applies to the grpo estimator only; {estimator} has "
                         "its own normalisation (leave scale unset)")
    scale = DEFAULT_SCALE if scale is None else scale
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if estimator != "grpo" and group_size < 2:
        raise ValueError(f"estimator {estimator} needs group_size >= 2 (a baseline from the "
                         f"other completions of the group), got {group_size}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if token_counts is not None and (token_counts.shape != (n,) or bool((token_counts < 0).any())):
        raise ValueError(f"token_counts must be [N={n}] non-negative counts, got shape "
                         f"{tuple(token_counts.shape)}")

    r = rewards.detach().to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf; check the reward functions' outputs")
    groups = r.view(n // group_size, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    zero_std = groups.amax(dim=1) == groups.amin(dim=1)
    centered = groups - mean

    if estimator == "rloo":
        adv = centered * (group_size / (group_size - 1))
    elif estimator == "reinforce_pp":
        weights = (torch.ones(n, device=r.device) if token_counts is None
                   else token_counts.detach().to(r.device))
        mu, std = _global_mean_std(centered.reshape(n), weights, reduce_sum, unbiased=False)
        # std 0 (every token's c equal): nothing to scale, and c - mu is 0 already
        adv = ((centered.double() - mu) / ((std + eps) or 1.0)).float()
        return AdvantageOutput(advantages=adv.reshape(n), zero_std_groups=zero_std)
    elif scale == "group":
        std = _unbiased_std(groups, dim=1).unsqueeze(1)
        adv = centered / (std + eps)
    elif scale == "batch":
        _, std = _global_mean_std(r, torch.ones(n, device=r.device), reduce_sum, unbiased=True)
        adv = centered / (std + eps)
    else:
        adv = centered

    adv = torch.where(zero_std.unsqueeze(1), torch.zeros_like(adv), adv)
    return AdvantageOutput(advantages=adv.reshape(n), zero_std_groups=zero_std)


def loss_token_mask(
    response_mask: Tensor,
    stopped: Tensor,
    zero_std_groups: Tensor,
    *,
    mask_truncated_completions: bool = False,
    exclude_zero_std_groups: bool = False,
) -> Tensor:
    """The response tokens that count in the loss (and in its normaliser).

    Args:
        response_mask: ``[N, T]`` bool, generated tokens.
        stopped: ``[N]`` bool, the completion ended on a stop token.
        zero_std_groups: ``[N // G]`` bool, groups whose rewards were all equal.
        mask_truncated_completions: drop completions that hit ``max_generated_tokens`` without
            a stop token.
        exclude_zero_std_groups: drop groups with equal rewards.

    Returns:
        ``[N, T]`` bool.
    """
    mask = response_mask.bool()
    if mask_truncated_completions:
        mask = mask & stopped.bool().unsqueeze(1)
    if exclude_zero_std_groups:
        group_size = response_mask.shape[0] // zero_std_groups.shape[0]
        keep = ~zero_std_groups.bool().repeat_interleave(group_size)
        mask = mask & keep.unsqueeze(1)
    return mask
