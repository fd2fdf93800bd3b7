"""The GRPO policy loss: one configurable module for GRPO, DAPO, Dr. GRPO, GSPO and CISPO.

:class:`GRPOLoss` checks its options (:mod:`~torchtune_grpo.algorithm.loss_checks`) and
composes the pure parts of :mod:`~torchtune_grpo.algorithm.loss_parts`; ``docs/losses.md``
gives the formulas. A micro-batch's loss is ``local_sum / normalizer``, with ``normalizer`` the
global sum of :meth:`GRPOLoss.normalizer_contribution` over the optimizer step on every rank, so
summed gradients (not averaged across ranks) equal the whole global batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from torchtune_grpo.algorithm.loss_checks import (
    AGGREGATIONS,
    CLIP_MODES,
    IMPORTANCE_LEVELS,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    check_loss_config,
    check_loss_inputs,
)
from torchtune_grpo.algorithm.loss_parts import (
    BehaviourWeight,
    PolicyTerm,
    aggregate,
    apply_dual_clip,
    approx_kl_to_old,
    behaviour_weight,
    cispo_surrogate,
    clamped_log_ratio,
    drop_above_cap,
    importance_ratio,
    kl_per_token,
    masked,
    normalizer_contribution,
    ppo_clipped_surrogate,
    safe_normalizer,
    truncate_at_cap,
)

__all__ = [
    "AGGREGATIONS",
    "CLIP_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "OFF_POLICY_CORRECTIONS",
    "GRPOLoss",
    "summarize_loss_stats",
]

# Stats reduced with MAX; every other stat is reduced with SUM.
_MAX_STATS = ("ratio_max", "is_weight_max")


class GRPOLoss(nn.Module):
    """Clipped GRPO policy loss with the variants of GRPO, DAPO, Dr. GRPO, GSPO and CISPO.

    Args:
        epsilon (float): clip range: ratios are clipped to ``[1 - epsilon, 1 + epsilon]``.
        epsilon_low (float | None): lower clip range; ``None`` uses ``epsilon``. In ``[0, 1]``.
        epsilon_high (float | None): upper clip range; ``None`` uses ``epsilon``.
        dual_clip (float | None): bound ``c > 1``: for negative advantages the per-token loss is
            capped at ``-c * A``. ``None`` disables it. PPO mode only.
        importance_level (str): ``"token"`` (GRPO) or ``"sequence"`` (GSPO).
        aggregation (str): ``"sequence_mean"``, ``"token_mean"`` (default) or ``"constant"``.
        max_generated_tokens (int | None): the constant of ``"constant"`` aggregation (required
            for it).
        kl_coeff (float): weight of the KL penalty towards the reference policy; ``0`` disables
            it.
        kl_estimator (str): ``"k1"``, ``"k2"`` or ``"k3"`` (see
            :func:`~torchtune_grpo.algorithm.loss_parts.kl_per_token`).
        entropy_coeff (float): weight of the entropy bonus (subtracted); ``0`` disables it.
        clip_mode (str): ``"ppo"`` (clipped surrogate) or ``"cispo"`` (token-level only).
        off_policy_correction (str): ``"none"`` (default), ``"decoupled"`` or ``"tis"``: how the
            policy term is re-weighted by ``pi_prox / mu``. With a correction, :meth:`forward`
            needs ``behavior_logprobs`` and ``old_logprobs`` are the proximal policy's.
        is_weight_cap (float | None): cap ``C > 1`` on the behaviour weight: ``"decoupled"`` drops
            tokens above it (optional), ``"tis"`` truncates at it (required). ``None`` with
            ``"none"``.

    Raises:
        ValueError: for an out-of-range or inconsistent argument, naming it.
    """

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        dual_clip: float | None = None,
        importance_level: Literal["token", "sequence"] = "token",
        aggregation: Literal["sequence_mean", "token_mean", "constant"] = "token_mean",
        max_generated_tokens: int | None = None,
        kl_coeff: float = 0.0,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        entropy_coeff: float = 0.0,
        clip_mode: Literal["ppo", "cispo"] = "ppo",
        off_policy_correction: Literal["none", "decoupled", "tis"] = "none",
        is_weight_cap: float | None = None,
    ) -> None:
        super().__init__()
        config = check_loss_config(
            epsilon,
            epsilon_low,
            epsilon_high,
            dual_clip,
            importance_level,
            aggregation,
            max_generated_tokens,
            kl_coeff,
            kl_estimator,
            entropy_coeff,
            clip_mode,
            off_policy_correction,
            is_weight_cap,
        )
        self.epsilon_low = config.epsilon_low
        self.epsilon_high = config.epsilon_high
        self.dual_clip = config.dual_clip
        self.importance_level = config.importance_level
        self.aggregation = config.aggregation
        self.max_generated_tokens = config.max_generated_tokens
        self.kl_coeff = config.kl_coeff
        self.kl_estimator = config.kl_estimator
        self.entropy_coeff = config.entropy_coeff
        self.clip_mode = config.clip_mode
        self.off_policy_correction = config.off_policy_correction
        self.is_weight_cap = config.is_weight_cap

    @property
    def needs_reference(self) -> bool:
        """bool: whether :meth:`forward` needs ``ref_logprobs`` (``kl_coeff != 0``)."""
        return self.kl_coeff != 0.0

    @property
    def needs_proximal_logprobs(self) -> bool:
        """bool: whether an off-policy correction is on (:meth:`forward` then needs
        ``behavior_logprobs`` and proximal-policy ``old_logprobs``).
        """
        return self.off_policy_correction != "none"

    @property
    def needs_entropy(self) -> bool:
        """bool: whether :meth:`forward` needs ``entropy`` (``entropy_coeff != 0``)."""
        return self.entropy_coeff != 0.0

    def extra_repr(self) -> str:
        """Summary of the configuration for ``print(module)``."""
        return (
            f"clip_mode={self.clip_mode}, epsilon_low={self.epsilon_low}, "
            f"epsilon_high={self.epsilon_high}, dual_clip={self.dual_clip}, "
            f"importance_level={self.importance_level}, aggregation={self.aggregation}, "
            f"max_generated_tokens={self.max_generated_tokens}, kl_coeff={self.kl_coeff}, "
            f"kl_estimator={self.kl_estimator}, entropy_coeff={self.entropy_coeff}, "
            f"off_policy_correction={self.off_policy_correction}, "
            f"is_weight_cap={self.is_weight_cap}"
        )

    def normalizer_contribution(self, response_mask: Tensor) -> Tensor:
        """This micro-batch's share of the global normalizer.

        Sum it over every micro-batch of the optimizer step and all ranks before the first forward.

        Args:
            response_mask (Tensor): ``[N, T]`` bool, True on response tokens.

        Returns:
            Tensor: scalar float32: ``N`` for ``"sequence_mean"``, the number of True entries for
            ``"token_mean"``, ``N * max_generated_tokens`` for ``"constant"``.
        """
        if response_mask.dim() != 2:
            raise ValueError(
                f"response_mask must be [N, T], got shape {tuple(response_mask.shape)}"
            )
        return normalizer_contribution(response_mask, self.aggregation, self.max_generated_tokens)

    def forward(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        normalizer: float | Tensor,
        ref_logprobs: Tensor | None = None,
        entropy: Tensor | None = None,
        behavior_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, normalised by the global ``normalizer``.

        Args:
            logprobs (Tensor): ``[N, T]`` log-probs of the sampled tokens under the current policy
                (with gradient).
            old_logprobs (Tensor): ``[N, T]`` log-probs the ratio is taken against (constants): the
                sampler's, or the proximal policy's with a correction.
            advantages (Tensor): ``[N]`` one advantage per sequence (constants).
            response_mask (Tensor): ``[N, T]`` bool, True on response tokens.
            normalizer (float | Tensor): global sum of :meth:`normalizer_contribution` for this
                optimizer step; ``0`` gives a zero loss.
            ref_logprobs (Tensor | None): ``[N, T]`` reference log-probs; required when
                :attr:`needs_reference`.
            entropy (Tensor | None): ``[N, T]`` per-token entropy (with gradient); required when
                :attr:`needs_entropy`.
            behavior_logprobs (Tensor | None): ``[N, T]`` rollout engine's log-probs (constants);
                required when :attr:`needs_proximal_logprobs`.

        Returns:
            tuple[Tensor, dict[str, Tensor]]: the scalar float32 loss and detached float32 stats to
            be summed over micro-batches and ranks (``ratio_max``, ``is_weight_max``: max):
            ``loss``, ``policy_loss``, ``kl_loss``, ``entropy_loss`` (divided by ``normalizer``),
            ``normalizer_share``, ``tokens``, ``sequences``, ``ratio_sum``, ``ratio_max``,
            ``clip_low_sum``, ``clip_high_sum``, ``dual_clip_sum``, ``approx_kl_sum``, ``kl_sum``,
            ``entropy_sum``, ``is_weight_sum``, ``is_weight_max`` (raw) and ``is_dropped_sum``.

        Raises:
            ValueError: on inconsistent shapes or a missing required input.
        """
        check_loss_inputs(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            normalizer,
            ref_logprobs,
            entropy,
            behavior_logprobs,
            kl_coeff=self.kl_coeff,
            entropy_coeff=self.entropy_coeff,
            off_policy_correction=self.off_policy_correction,
        )
        mask = response_mask.bool()
        lengths = mask.to(torch.float32).sum(dim=1)  # [N]
        logp = masked(logprobs.float(), mask)  # [N, T]
        old = masked(old_logprobs.detach().float(), mask)  # [N, T]
        adv = advantages.detach().float().unsqueeze(1)  # [N, 1]

        token_log_ratio = clamped_log_ratio(logp, old)  # [N, T]
        ratio = importance_ratio(token_log_ratio, lengths, self.importance_level)  # [N, T]
        term = self._policy_term(ratio, adv, logp)
        weight = self._behaviour_weight(old, behavior_logprobs, mask, lengths)
        pg = term.loss if self.off_policy_correction == "none" else term.loss * weight.applied
        pg = masked(pg, mask)  # [N, T]

        per_token = pg
        kl = ent = None
        if ref_logprobs is not None:
            ref = masked(ref_logprobs.detach().float(), mask)
            kl = masked(kl_per_token(logp, ref, self.kl_estimator), mask)  # [N, T]
            if self.kl_coeff != 0.0:
                per_token = per_token + self.kl_coeff * kl
        if entropy is not None:
            ent = masked(entropy.float(), mask)  # [N, T]
            if self.entropy_coeff != 0.0:
                per_token = per_token - self.entropy_coeff * ent

        norm = safe_normalizer(normalizer, logp.device)
        loss = aggregate(per_token, lengths, self.aggregation) / norm
        with torch.no_grad():
            stats = self._stats(
                loss, pg, kl, ent, mask, lengths, norm, ratio, token_log_ratio, term, weight
            )
        return loss, stats

    def _policy_term(self, ratio: Tensor, adv: Tensor, logp: Tensor) -> PolicyTerm:
        """The ``[N, T]`` policy term of :attr:`clip_mode` from the ``[N, T]`` ratio."""
        lower, upper = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        if self.clip_mode == "cispo":
            return cispo_surrogate(ratio, adv, logp, lower, upper)
        term = ppo_clipped_surrogate(ratio, adv, lower, upper)
        return apply_dual_clip(term, adv, self.dual_clip)

    def _behaviour_weight(
        self, old: Tensor, behavior_logprobs: Tensor | None, mask: Tensor, lengths: Tensor
    ) -> BehaviourWeight:
        """The ``[N, T]`` weight of :attr:`off_policy_correction` (1 per response token for
        ``"none"``, where it is not applied)."""
        none_dropped = torch.zeros_like(mask)
        if self.off_policy_correction == "none":
            fmask = mask.to(torch.float32)
            return BehaviourWeight(fmask, fmask, none_dropped)
        assert behavior_logprobs is not None
        behav = masked(behavior_logprobs.detach().float(), mask)
        raw = behaviour_weight(old, behav, lengths, self.importance_level)
        if self.is_weight_cap is None:
            return BehaviourWeight(raw, raw, none_dropped)
        if self.off_policy_correction == "decoupled":
            return BehaviourWeight(raw, *drop_above_cap(raw, mask, self.is_weight_cap))
        return BehaviourWeight(raw, truncate_at_cap(raw, self.is_weight_cap), none_dropped)

    def _stats(
        self,
        loss: Tensor,
        pg: Tensor,
        kl: Tensor | None,
        ent: Tensor | None,
        mask: Tensor,
        lengths: Tensor,
        norm: Tensor,
        ratio: Tensor,
        token_log_ratio: Tensor,
        term: PolicyTerm,
        weight: BehaviourWeight,
    ) -> dict[str, Tensor]:
        """The stats of :meth:`forward` (see there), as float32 scalars; call under no_grad."""
        zero = torch.zeros((), dtype=torch.float32, device=loss.device)
        if kl is not None and self.kl_coeff != 0.0:
            kl_loss = self.kl_coeff * aggregate(kl, lengths, self.aggregation) / norm
        else:
            kl_loss = zero
        if ent is not None and self.entropy_coeff != 0.0:
            entropy_loss = -self.entropy_coeff * aggregate(ent, lengths, self.aggregation) / norm
        else:
            entropy_loss = zero
        masked_ratio = masked(ratio, mask)
        masked_raw_weight = masked(weight.raw, mask)
        stats = {
            "loss": loss.detach(),
            "policy_loss": aggregate(pg, lengths, self.aggregation) / norm,
            "kl_loss": kl_loss,
            "entropy_loss": entropy_loss,
            "normalizer_share": self.normalizer_contribution(mask) / norm,
            "tokens": mask.to(torch.float32).sum(),
            "sequences": torch.tensor(
                float(mask.shape[0]), dtype=torch.float32, device=loss.device
            ),
            "ratio_sum": masked_ratio.sum(),
            "ratio_max": masked_ratio.max() if masked_ratio.numel() else zero,
            "clip_low_sum": (term.clipped_low & mask).sum().to(torch.float32),
            "clip_high_sum": (term.clipped_high & mask).sum().to(torch.float32),
            "dual_clip_sum": (term.dual_clipped & mask).sum().to(torch.float32),
            "approx_kl_sum": masked(approx_kl_to_old(token_log_ratio), mask).sum(),
            "kl_sum": kl.sum() if kl is not None else zero,
            "entropy_sum": ent.sum() if ent is not None else zero,
            "is_weight_sum": masked(weight.applied, mask).sum(),
            "is_weight_max": masked_raw_weight.max() if masked_raw_weight.numel() else zero,
            "is_dropped_sum": weight.dropped.sum().to(torch.float32),
        }
        return {k: v.detach().to(torch.float32).reshape(()) for k, v in stats.items()}


def summarize_loss_stats(
    stats_list: Sequence[dict[str, Tensor]],
    all_reduce: Callable[[Tensor, str], Tensor] | None = None,
) -> dict[str, float]:
    """Turn the stats of many micro-batches (and ranks) into exact global metrics.

    A collective when ``all_reduce`` is given (one ``"sum"``, one ``"max"``): every rank calls it
    with the same stat names.

    Args:
        stats_list (Sequence[dict[str, Tensor]]): :meth:`GRPOLoss.forward`'s stats of each
            micro-batch on this rank.
        all_reduce (Callable[[Tensor, str], Tensor] | None): ``f(tensor, op)`` with ``op`` in
            ``{"sum", "max"}``; ``None`` for a single process.

    Returns:
        dict[str, float]: ``loss``, ``policy_loss``, ``kl``, ``entropy``, ``clip_fraction``
        (with ``/low`` and ``/high``), ``ratio/mean``, ``ratio/max``, ``approx_kl``,
        ``is_weight/mean``, ``is_weight/max``, ``is_weight/dropped_fraction``; token means are 0
        without response tokens.

    Raises:
        ValueError: if ``stats_list`` is empty or its dicts have different keys.
    """
    if len(stats_list) == 0:
        raise ValueError("stats_list is empty; pass the stats of at least one forward() call")
    keys = sorted(stats_list[0])
    for i, s in enumerate(stats_list):
        if sorted(s) != keys:
            raise ValueError(f"stats_list[{i}] has keys {sorted(s)}, expected {keys}")
    sum_keys = [k for k in keys if k not in _MAX_STATS]
    max_keys = [k for k in keys if k in _MAX_STATS]

    sums = torch.stack(
        [torch.stack([s[k].detach().float().reshape(()) for k in sum_keys]) for s in stats_list]
    ).sum(dim=0)
    maxes = (
        torch.stack(
            [torch.stack([s[k].detach().float().reshape(()) for k in max_keys]) for s in stats_list]
        ).amax(dim=0)
        if max_keys
        else None
    )
    if all_reduce is not None:
        sums = all_reduce(sums.clone(), "sum")
        if maxes is not None:
            maxes = all_reduce(maxes.clone(), "max")
    total = dict(zip(sum_keys, sums.tolist()))
    if maxes is not None:
        total.update(zip(max_keys, maxes.tolist()))

    def per_token(name: str) -> float:
        tokens = total.get("tokens", 0.0)
        return total.get(name, 0.0) / tokens if tokens > 0 else 0.0

    steps = total.get("normalizer_share", 0.0)
    step_scale = 1.0 / steps if steps > 0 else 1.0
    low, high = per_token("clip_low_sum"), per_token("clip_high_sum")
    return {
        "loss": total.get("loss", 0.0) * step_scale,
        "policy_loss": total.get("policy_loss", 0.0) * step_scale,
        "kl": per_token("kl_sum"),
        "entropy": per_token("entropy_sum"),
        "clip_fraction": low + high,
        "clip_fraction/low": low,
        "clip_fraction/high": high,
        "ratio/mean": per_token("ratio_sum"),
        "ratio/max": total.get("ratio_max", 0.0),
        "approx_kl": per_token("approx_kl_sum"),
        "is_weight/mean": per_token("is_weight_sum"),
        "is_weight/max": total.get("is_weight_max", 0.0),
        "is_weight/dropped_fraction": per_token("is_dropped_sum"),
    }
