"""The pure tensor parts :class:`~torchtune_grpo.algorithm.loss.GRPOLoss` is composed of.

Shapes: ``mask [N, T]`` bool response mask, ``lengths [N]`` float32 response tokens per
sequence, ``adv [N, 1]``; inputs are float32 and zeroed at padded positions with :func:`masked`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "LOG_RATIO_CLAMP",
    "PolicyTerm",
    "BehaviourWeight",
    "masked",
    "clamped_log_ratio",
    "sequence_mean_per_token",
    "importance_ratio",
    "ppo_clipped_surrogate",
    "apply_dual_clip",
    "cispo_surrogate",
    "behaviour_weight",
    "drop_above_cap",
    "truncate_at_cap",
    "kl_per_token",
    "approx_kl_to_old",
    "aggregate",
    "normalizer_contribution",
    "safe_normalizer",
]

#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``: beyond that a
#: token is far outside any trust region, and an unclamped ``exp`` would turn its (zero) gradient
#: into NaN.
LOG_RATIO_CLAMP = 20.0


class PolicyTerm(NamedTuple):
    """The per-token policy term and which tokens the clip acted on (all ``[N, T]``).

    Attributes:
        loss (Tensor): float32 per-token policy loss.
        clipped_low (Tensor): bool, tokens clipped at the lower bound ``1 - epsilon_low``.
        clipped_high (Tensor): bool, tokens clipped at the upper bound ``1 + epsilon_high``.
        dual_clipped (Tensor): bool, tokens capped by the dual clip (all False without it).
    """

    loss: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor


class BehaviourWeight(NamedTuple):
    """The off-policy weight ``pi_prox / mu`` of each token (all ``[N, T]``, constants).

    Attributes:
        raw (Tensor): float32 untruncated weight (the mask as float32 without a correction).
        applied (Tensor): float32 weight multiplying the policy term, after truncation or
            dropping.
        dropped (Tensor): bool, response tokens dropped by the decoupled cap.
    """

    raw: Tensor
    applied: Tensor
    dropped: Tensor


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` on response tokens, 0 elsewhere.

    Args:
        x (Tensor): ``[N, T]`` float32.
        mask (Tensor): ``[N, T]`` bool.

    Returns:
        Tensor: ``[N, T]`` float32; padded positions hold an exact 0 (and pass no gradient).
    """
    return torch.where(mask, x, torch.zeros((), dtype=torch.float32, device=x.device))


def clamped_log_ratio(logp: Tensor, base_logp: Tensor) -> Tensor:
    """Per-token ``log(p / p_base)``, clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``.

    Args:
        logp (Tensor): ``[N, T]`` log-probs of the numerator policy.
        base_logp (Tensor): ``[N, T]`` log-probs of the denominator policy.

    Returns:
        Tensor: ``[N, T]`` clamped log-ratio.
    """
    return (logp - base_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_mean_per_token(x: Tensor, lengths: Tensor) -> Tensor:
    """Mean of a masked per-token quantity over each sequence's response tokens, on every token.

    Args:
        x (Tensor): ``[N, T]``, zero at padded positions.
        lengths (Tensor): ``[N]`` response tokens per sequence (a sequence without any gives 0).

    Returns:
        Tensor: ``[N, T]`` (an expanded view of ``[N, 1]``): row ``i`` holds
        ``sum_t x_it / max(|o_i|, 1)``.
    """
    return (x.sum(dim=1) / lengths.clamp(min=1)).unsqueeze(1).expand_as(x)


def importance_ratio(token_log_ratio: Tensor, lengths: Tensor, level: str) -> Tensor:
    """The importance ratio ``pi / pi_old`` at token (GRPO) or sequence (GSPO) level.

    Args:
        token_log_ratio (Tensor): ``[N, T]`` from :func:`clamped_log_ratio`, 0 on padding.
        lengths (Tensor): ``[N]`` response tokens per sequence.
        level (str): ``"token"``: ``r_it = exp(x_it)``; ``"sequence"``:
            ``s_i = exp(mean_t x_it)``, repeated on each token of sequence ``i``.

    Returns:
        Tensor: ``[N, T]`` ratio.
    """
    if level == "sequence":
        return torch.exp(sequence_mean_per_token(token_log_ratio, lengths))
    return torch.exp(token_log_ratio)


def ppo_clipped_surrogate(ratio: Tensor, adv: Tensor, lower: float, upper: float) -> PolicyTerm:
    """PPO's clipped surrogate ``l = -min(r * A, clip(r, lower, upper) * A)``.

    Args:
        ratio (Tensor): ``[N, T]`` importance ratio.
        adv (Tensor): ``[N, 1]`` advantages (constants).
        lower (float): lower clip bound ``1 - epsilon_low``.
        upper (float): upper clip bound ``1 + epsilon_high``.

    Returns:
        PolicyTerm: ``[N, T]`` loss and clip indicators (``dual_clipped`` all False).
    """
    clipped_ratio = ratio.clamp(lower, upper)
    loss = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    below, above = (adv < 0) & (ratio < lower), (adv > 0) & (ratio > upper)
    return PolicyTerm(loss, below, above, torch.zeros_like(below))


def apply_dual_clip(term: PolicyTerm, adv: Tensor, c: float | None) -> PolicyTerm:
    """Dual clip: for ``A < 0`` the per-token loss is capped, ``l = min(l, -c * A)``.

    Args:
        term (PolicyTerm): from :func:`ppo_clipped_surrogate`.
        adv (Tensor): ``[N, 1]`` advantages.
        c (float | None): the bound, ``> 1``; ``None`` returns ``term`` unchanged.

    Returns:
        PolicyTerm: ``term`` with the capped ``[N, T]`` loss and ``dual_clipped`` set on the
        tokens the cap changed.
    """
    if c is None:
        return term
    cap = -c * adv
    dual_active = (adv < 0) & (term.loss > cap)
    loss = torch.where(adv < 0, torch.minimum(term.loss, cap), term.loss)
    return term._replace(loss=loss, dual_clipped=dual_active)


def cispo_surrogate(
    ratio: Tensor, adv: Tensor, logp: Tensor, lower: float, upper: float
) -> PolicyTerm:
    """CISPO's ``l = -sg(clip(r, lower, upper)) * A * logp`` (``sg``: stop-gradient).

    Args:
        ratio (Tensor): ``[N, T]`` token-level importance ratio.
        adv (Tensor): ``[N, 1]`` advantages.
        logp (Tensor): ``[N, T]`` log-probs of the current policy (with gradient).
        lower (float): lower clip bound.
        upper (float): upper clip bound.

    Returns:
        PolicyTerm: ``[N, T]`` loss and clip indicators (``dual_clipped`` all False).
    """
    clipped_ratio = ratio.clamp(lower, upper)
    loss = -(clipped_ratio.detach() * adv * logp)
    below, above = ratio < lower, ratio > upper
    return PolicyTerm(loss, below, above, torch.zeros_like(below))


def behaviour_weight(old: Tensor, behav: Tensor, lengths: Tensor, level: str) -> Tensor:
    """The raw off-policy weight ``pi_prox / mu = exp(clamp(old - behav))`` (a constant).

    Args:
        old (Tensor): ``[N, T]`` proximal-policy log-probs, 0 on padding.
        behav (Tensor): ``[N, T]`` behaviour-policy (sampler) log-probs, 0 on padding.
        lengths (Tensor): ``[N]`` response tokens per sequence.
        level (str): ``"token"`` or ``"sequence"`` (the exp of the mean clamped log-weight over
            the sequence's response tokens, repeated on each token).

    Returns:
        Tensor: ``[N, T]`` untruncated weight.
    """
    log_w = clamped_log_ratio(old, behav)
    if level == "sequence":
        log_w = sequence_mean_per_token(log_w, lengths)
    return torch.exp(log_w)


def drop_above_cap(raw_weight: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's cap: response tokens with ``w > cap`` get weight 0.

    Args:
        raw_weight (Tensor): ``[N, T]`` from :func:`behaviour_weight`.
        mask (Tensor): ``[N, T]`` bool response mask.
        cap (float): the cap ``C > 1``.

    Returns:
        tuple[Tensor, Tensor]: the ``[N, T]`` applied weight and the ``[N, T]`` bool dropped
        tokens.
    """
    dropped = mask & (raw_weight > cap)
    zero = torch.zeros((), dtype=torch.float32, device=raw_weight.device)
    return torch.where(dropped, zero, raw_weight), dropped


def truncate_at_cap(raw_weight: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling: ``min(w, cap)``.

    Args:
        raw_weight (Tensor): ``[N, T]`` from :func:`behaviour_weight`.
        cap (float): the cap ``C > 1``.

    Returns:
        Tensor: ``[N, T]`` applied weight.
    """
    return raw_weight.clamp(max=cap)


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimator of ``KL(pi || pi_ref)``, with ``x = log pi - log pi_ref``.

    ``"k1"``: ``x``; ``"k2"``: ``x**2 / 2``; ``"k3"``: ``exp(-x) + x - 1`` (``-x`` clamped).

    Args:
        logprobs (Tensor): ``[N, T]`` log-probs of the sampled tokens under the policy.
        ref_logprobs (Tensor): ``[N, T]`` the same under the reference.
        estimator (str): ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Tensor: ``[N, T]`` per-token estimate.
    """
    log_ratio = logprobs - ref_logprobs  # log pi/pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    d = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log pi_ref/pi
    return torch.exp(d) - d - 1.0


def approx_kl_to_old(token_log_ratio: Tensor) -> Tensor:
    """k3 estimate of ``KL(pi_old || pi)`` per token, ``(r - 1) - log r`` (a diagnostic).

    Args:
        token_log_ratio (Tensor): ``[N, T]`` token-level ``log r`` from :func:`clamped_log_ratio`.

    Returns:
        Tensor: ``[N, T]`` estimate.
    """
    return (torch.exp(token_log_ratio) - 1.0) - token_log_ratio


def aggregate(per_token: Tensor, lengths: Tensor, aggregation: str) -> Tensor:
    """Un-normalised local sum of a masked per-token quantity.

    Args:
        per_token (Tensor): ``[N, T]``, zero at padded positions.
        lengths (Tensor): ``[N]`` response tokens per sequence.
        aggregation (str): ``"sequence_mean"``: ``sum_i sum_t l_it / max(|o_i|, 1)``;
            ``"token_mean"`` and ``"constant"``: ``sum_it l_it`` (they differ only in the
            normalizer, see :func:`normalizer_contribution`).

    Returns:
        Tensor: scalar.
    """
    if aggregation == "sequence_mean":
        return (per_token.sum(dim=1) / lengths.clamp(min=1)).sum()
    return per_token.sum()


def normalizer_contribution(
    mask: Tensor, aggregation: str, max_generated_tokens: int | None
) -> Tensor:
    """A micro-batch's share of the global normalizer the local sums are divided by.

    Args:
        mask (Tensor): ``[N, T]`` response mask.
        aggregation (str): ``"sequence_mean"``: ``N``; ``"token_mean"``: the number of
            response tokens; ``"constant"`` (Dr. GRPO): ``N * max_generated_tokens``.
        max_generated_tokens (int | None): required for ``"constant"``.

    Returns:
        Tensor: scalar float32 on ``mask``'s device.
    """
    n = mask.shape[0]
    device = mask.device
    if aggregation == "token_mean":
        return mask.bool().sum().to(torch.float32)
    if aggregation == "sequence_mean":
        return torch.tensor(float(n), dtype=torch.float32, device=device)
    assert max_generated_tokens is not None
    return torch.tensor(float(n * max_generated_tokens), dtype=torch.float32, device=device)


def safe_normalizer(normalizer: float | Tensor, device: torch.device) -> Tensor:
    """The global normalizer as a float32 scalar on ``device``, 0 (an empty batch) becoming 1.

    Args:
        normalizer (float | Tensor): a number or a one-element tensor (detached here).
        device (torch.device): the device of the loss.

    Returns:
        Tensor: scalar float32.
    """
    if isinstance(normalizer, Tensor):
        norm = normalizer.detach().to(device=device, dtype=torch.float32).reshape(())
    else:
        norm = torch.tensor(float(normalizer), dtype=torch.float32, device=device)
    return torch.where(norm > 0, norm, torch.ones_like(norm))
