"""Validation for :class:`~torchtune_grpo.algorithm.loss.GRPOLoss`: its options and its inputs.

Every error is a :class:`ValueError` that names the offending argument and, where one exists,
the setting that fixes it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "CLIP_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "OFF_POLICY_CORRECTIONS",
    "LossConfig",
    "check_loss_config",
    "check_loss_inputs",
]

AGGREGATIONS = ("sequence_mean", "token_mean", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
CLIP_MODES = ("ppo", "cispo")
OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")


class LossConfig(NamedTuple):
    """The validated options of :class:`~torchtune_grpo.algorithm.loss.GRPOLoss` (numbers as
    ``float``, ``epsilon`` resolved into both clip ranges); see its arguments."""

    epsilon_low: float
    epsilon_high: float
    dual_clip: float | None
    importance_level: str
    aggregation: str
    max_generated_tokens: int | None
    kl_coeff: float
    kl_estimator: str
    entropy_coeff: float
    clip_mode: str
    off_policy_correction: str
    is_weight_cap: float | None


def _as_float(name: str, value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _check_number(name: str, value: object, *, low: float, low_inclusive: bool = True) -> float:
    number = _as_float(name, value)
    ok = number >= low if low_inclusive else number > low
    if not ok or not math.isfinite(number):
        op = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} must be finite and {op} {low}, got {value!r}")
    return number


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_loss_config(
    epsilon: float,
    epsilon_low: float | None,
    epsilon_high: float | None,
    dual_clip: float | None,
    importance_level: str,
    aggregation: str,
    max_generated_tokens: int | None,
    kl_coeff: float,
    kl_estimator: str,
    entropy_coeff: float,
    clip_mode: str,
    off_policy_correction: str,
    is_weight_cap: float | None,
) -> LossConfig:
    """Validate the constructor arguments of ``GRPOLoss`` (same names and meaning).

    Returns:
        LossConfig: the validated options.

    Raises:
        ValueError: for an out-of-range or inconsistent argument, naming it.
    """
    epsilon = _check_number("epsilon", epsilon, low=0.0)
    eps_low = epsilon if epsilon_low is None else _check_number("epsilon_low", epsilon_low, low=0.0)
    eps_high = (
        epsilon if epsilon_high is None else _check_number("epsilon_high", epsilon_high, low=0.0)
    )
    if eps_low > 1.0:
        name = "epsilon" if epsilon_low is None else "epsilon_low"
        raise ValueError(
            f"{name} must be <= 1 (the lower clip bound 1 - epsilon_low must stay >= 0), "
            f"got {eps_low}; set epsilon_low explicitly"
        )
    if dual_clip is not None:
        dual_clip = _check_number("dual_clip", dual_clip, low=1.0, low_inclusive=False)
    _check_choice("importance_level", importance_level, IMPORTANCE_LEVELS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    if max_generated_tokens is not None and (
        isinstance(max_generated_tokens, bool)
        or not isinstance(max_generated_tokens, int)
        or max_generated_tokens < 1
    ):
        raise ValueError(
            f"max_generated_tokens must be a positive integer, got {max_generated_tokens!r}"
        )
    if aggregation == "constant" and max_generated_tokens is None:
        raise ValueError(
            "max_generated_tokens is required when aggregation='constant' (Dr. GRPO); "
            "pass the rollout's max_generated_tokens"
        )
    kl_coeff = _check_number("kl_coeff", kl_coeff, low=0.0)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    entropy_coeff = _as_float("entropy_coeff", entropy_coeff)
    if not math.isfinite(entropy_coeff):
        raise ValueError(f"entropy_coeff must be a finite number, got {entropy_coeff!r}")
    _check_choice("clip_mode", clip_mode, CLIP_MODES)
    if clip_mode == "cispo" and importance_level != "token":
        raise ValueError(
            "clip_mode='cispo' works on token-level importance weights; set "
            "importance_level='token' (or use clip_mode='ppo' for GSPO)"
        )
    if clip_mode == "cispo" and dual_clip is not None:
        raise ValueError(
            "dual_clip only applies to clip_mode='ppo'; set dual_clip=None for 'cispo'"
        )
    _check_choice("off_policy_correction", off_policy_correction, OFF_POLICY_CORRECTIONS)
    if is_weight_cap is not None:
        if off_policy_correction == "none":
            raise ValueError(
                f"is_weight_cap={is_weight_cap!r} has no effect with "
                "off_policy_correction='none'; set is_weight_cap=None or choose "
                "off_policy_correction='decoupled' or 'tis'"
            )
        is_weight_cap = _check_number("is_weight_cap", is_weight_cap, low=1.0, low_inclusive=False)
    elif off_policy_correction == "tis":
        raise ValueError(
            "is_weight_cap is required when off_policy_correction='tis' (the truncation "
            "bound of the importance weight, > 1, e.g. 2.0)"
        )
    return LossConfig(
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        dual_clip=dual_clip,
        importance_level=importance_level,
        aggregation=aggregation,
        max_generated_tokens=max_generated_tokens,
        kl_coeff=kl_coeff,
        kl_estimator=kl_estimator,
        entropy_coeff=float(entropy_coeff),
        clip_mode=clip_mode,
        off_policy_correction=off_policy_correction,
        is_weight_cap=is_weight_cap,
    )


def check_loss_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    normalizer: float | Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    behavior_logprobs: Tensor | None,
    *,
    kl_coeff: float,
    entropy_coeff: float,
    off_policy_correction: str,
) -> None:
    """Check the inputs of ``GRPOLoss.forward`` (same names; shapes there) against its options.

    Raises:
        ValueError: on inconsistent shapes, a missing required input or a negative normalizer.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("response_mask", response_mask)):
        if t.shape != shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}"
            )
    if advantages.shape != shape[:1]:
        raise ValueError(
            f"advantages must be [N] = {tuple(shape[:1])}, one per sequence, got "
            f"{tuple(advantages.shape)}"
        )
    if ref_logprobs is None and kl_coeff != 0.0:
        raise ValueError(
            f"ref_logprobs is required when kl_coeff != 0 (kl_coeff={kl_coeff}); "
            "compute the reference model's log-probs or set kl_coeff=0"
        )
    if entropy is None and entropy_coeff != 0.0:
        raise ValueError(
            f"entropy is required when entropy_coeff != 0 (entropy_coeff="
            f"{entropy_coeff}); pass return_entropy=True to the log-prob function or "
            "set entropy_coeff=0"
        )
    if behavior_logprobs is None and off_policy_correction != "none":
        raise ValueError(
            f"behavior_logprobs is required when off_policy_correction="
            f"{off_policy_correction!r}: pass the rollout engine's log-probs of the "
            "sampled tokens (and the proximal policy's as old_logprobs), or set "
            "off_policy_correction='none'"
        )
    for name, t in (
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("behavior_logprobs", behavior_logprobs),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}"
            )
    if not isinstance(normalizer, Tensor):
        if not _as_float("normalizer", normalizer) >= 0:
            raise ValueError(
                f"normalizer must be >= 0 (the global sum of normalizer_contribution), "
                f"got {normalizer!r}"
            )
    elif normalizer.numel() != 1:
        raise ValueError(
            f"normalizer must be a scalar, got a tensor of shape {tuple(normalizer.shape)}"
        )
