"""Group-relative advantages for GRPO.

Every prompt is sampled ``group_size`` (``G``) times; the ``N = prompts * G`` completions are laid
out contiguously, so rows ``g*G .. g*G + G - 1`` form the group of prompt ``g``. A completion's
advantage is its reward relative to the other completions of its group:

* ``scale="group"`` (GRPO, DeepSeekMath): ``(r - mean_g) / (std_g + eps)``
* ``scale="batch"``: ``(r - mean_g) / (std_batch + eps)``, one scale for the whole batch (group
  mean, batch std), so that groups with a small spread are not blown up; TRL calls this
  ``scale_rewards="batch"``.
* ``scale="none"`` (Dr. GRPO): ``r - mean_g``, no division at all.

Standard deviations are the *unbiased* sample standard deviation (Bessel's correction, divisor
``G - 1``), which is what ``torch.std`` returns by default and what the GRPO paper's reference
implementations (e.g. TRL) use. With ``G = 1`` the sample standard deviation is undefined; every
advantage is then zero anyway (each group is its own mean) and the group is flagged zero-std.

A group whose rewards are all equal carries no learning signal; it is flagged in
``zero_std_groups`` and its advantages are exactly ``0.0`` (not a rounding residue of
``r - mean``), whatever ``scale`` is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_SCALES", "DEFAULT_EPS", "DEFAULT_SCALE", "AdvantageOutput",
           "group_advantages"]

ADVANTAGE_SCALES = ("group", "batch", "none")
#: Default ``scale`` (also of the config's ``advantages.scale``).
DEFAULT_SCALE = "group"
#: Default ``eps`` (also of the config's ``advantages.eps``).
DEFAULT_EPS = 1e-6


class AdvantageOutput(NamedTuple):
    """Result of :func:`group_advantages`.

    Attributes:
        advantages (Tensor): ``[N]`` float32, one advantage per completion.
        zero_std_groups (Tensor): ``[N // G]`` bool, True for groups whose rewards are all equal
            (their advantages are exactly zero).
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


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = DEFAULT_SCALE,
    eps: float = DEFAULT_EPS,
) -> AdvantageOutput:
    """Group-relative advantages of ``N`` completions in contiguous groups of ``group_size``.

    Pure function: the input is not modified and no state is kept.

    Args:
        rewards (Tensor): ``[N]`` rewards (any real dtype), ``N = prompts * group_size``, groups
            contiguous.
        group_size (int): ``G``, the number of completions per prompt; must divide ``N``.
        scale (str): ``"group"`` divides by the group's unbiased std (GRPO), ``"batch"`` by the
            unbiased std of all ``N`` rewards, ``"none"`` does not divide (Dr. GRPO).
        eps (float): added to the standard deviation before dividing; ``>= 0``.

    Returns:
        AdvantageOutput: ``advantages [N]`` float32 and ``zero_std_groups [N // G]`` bool.

    Raises:
        ValueError: if ``rewards`` is not 1-D or not finite, ``group_size`` is not a positive
            integer dividing ``N``, ``scale`` is unknown or ``eps`` is negative.
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
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")

    r = rewards.detach().to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf; check the reward functions' outputs")
    groups = r.view(n // group_size, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    zero_std = groups.amax(dim=1) == groups.amin(dim=1)
    centered = groups - mean

    if scale == "group":
        std = _unbiased_std(groups, dim=1).unsqueeze(1)
        adv = centered / (std + eps)
    elif scale == "batch":
        adv = centered / (_unbiased_std(r) + eps)
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
        mask_truncated_completions: drop completions that hit ``max_generated_tokens``
            without a stop token (DAPO's overlong filtering): their reward judges an unfinished
            answer.
        exclude_zero_std_groups: drop groups with equal rewards: their advantage is 0, so they
            only dilute a token- or sequence-mean normaliser (and add KL/entropy terms).

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
