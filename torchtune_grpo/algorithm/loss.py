"""The GRPO policy loss: one configurable module for GRPO, DAPO, Dr. GRPO, GSPO and CISPO.

Shapes: ``N`` sequences (``prompts * group_size``, groups contiguous), ``T`` response tokens
(right-padded). ``response_mask [N, T]`` is True on real response tokens, stop token included.

:class:`GRPOLoss` checks its options (:mod:`~torchtune_grpo.algorithm.loss_checks`) and composes
the pure tensor parts of :mod:`~torchtune_grpo.algorithm.loss_parts`, whose docstrings give the
formulas (``docs/losses.md`` the papers and the choice). Per response token ``t`` of sequence
``i``, with advantage ``A_i``:

* the importance ratio ``r_it`` against ``old_logprobs``, at token level (GRPO) or sequence level
  (GSPO: ``importance_level="sequence"``), log-ratios clamped to ``[-20, 20]`` before ``exp``;
* the policy term ``l_it``: PPO's clipped surrogate with ``[1 - epsilon_low, 1 + epsilon_high]``
  (``clip_mode="ppo"``, DAPO's clip-higher when the two differ, optional ``dual_clip``) or
  CISPO's clipped, stop-gradient weight times ``A_i * logp_it`` (``clip_mode="cispo"``);
* with an ``off_policy_correction`` (asynchronous training, engine mismatch), ``old_logprobs``
  are the proximal policy's and ``l_it`` is multiplied by the constant behaviour weight
  ``pi_prox / mu = exp(old_logp_it - behav_it)`` (sequence-level with GSPO), dropped above
  ``is_weight_cap`` (``"decoupled"``) or truncated at it (``"tis"``);
* plus ``kl_coeff * kl_it`` (an estimator of ``KL(pi || pi_ref)``) and
  ``- entropy_coeff * entropy_it``, never weighted;
* summed per ``aggregation`` (per-sequence means for ``"sequence_mean"``, a plain sum for
  ``"token_mean"`` and ``"constant"``) and divided by the global normalizer.

Exact normalisation across micro-batches, gradient accumulation and ranks: the loss of a
micro-batch is ``local_sum / normalizer`` where ``normalizer`` is the *global* sum of
:meth:`GRPOLoss.normalizer_contribution` over every micro-batch of the optimizer step on every
rank. Summing the gradients of all micro-batches (accumulation, then all-reduce SUM across ranks,
i.e. *not* averaged by the data-parallel wrapper, or multiplied back by the world size) then gives
exactly the gradient of the whole global batch.
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

    The per-token objective is described in the module docstring. It is aggregated over the
    response tokens of the micro-batch and divided by the caller's global ``normalizer``, the sum
    of :meth:`normalizer_contribution`: the number of sequences for ``"sequence_mean"`` (GRPO),
    of response tokens for ``"token_mean"`` (DAPO), ``sequences * max_generated_tokens`` for
    ``"constant"`` (Dr. GRPO). A sequence with no response token contributes 0.

    Args:
        epsilon (float): clip range: ratios are clipped to ``[1 - epsilon, 1 + epsilon]``.
        epsilon_low (float | None): lower clip range (DAPO "clip-higher" sets it apart from
            ``epsilon_high``); ``None`` uses ``epsilon``. Must lie in ``[0, 1]``.
        epsilon_high (float | None): upper clip range; ``None`` uses ``epsilon``.
        dual_clip (float | None): dual-clip bound ``c > 1``: for negative advantages the
            per-token loss is capped at ``-c * A``. ``None`` disables it. PPO mode only.
        importance_level (str): ``"token"`` (GRPO) or ``"sequence"`` (GSPO, which uses
            much smaller clip ranges, e.g. ``epsilon_low=3e-4, epsilon_high=4e-4``).
        aggregation (str): ``"sequence_mean"``, ``"token_mean"`` (default) or ``"constant"``;
            see ``docs/losses.md`` for which to choose.
        max_generated_tokens (int | None): the constant of ``"constant"`` aggregation (required
            for it; usually the rollout's ``max_generated_tokens``).
        kl_coeff (float): weight of the KL penalty towards the reference policy; ``0`` disables
            it (then no reference log-probs are needed).
        kl_estimator (str): ``"k1"``, ``"k2"`` or ``"k3"`` (see
            :func:`~torchtune_grpo.algorithm.loss_parts.kl_per_token`).
        entropy_coeff (float): weight of the entropy bonus (subtracted from the loss); ``0``
            disables it.
        clip_mode (str): ``"ppo"`` (clipped surrogate) or ``"cispo"`` (clipped, stop-gradient
            importance weight times ``logp * A``; token-level only).
        off_policy_correction (str): ``"none"`` (default), ``"decoupled"`` or ``"tis"``: how the
            policy term is re-weighted by the behaviour weight
            ``pi_prox / mu = exp(old_logprobs - behavior_logprobs)`` (see the module docstring
            and ``docs/losses.md``). With a correction, :meth:`forward` needs
            ``behavior_logprobs`` and ``old_logprobs`` are the proximal policy's.
        is_weight_cap (float | None): cap ``C > 1`` on the behaviour weight: ``"decoupled"``
            drops tokens whose weight exceeds it (optional), ``"tis"`` truncates the weight to
            it (required). Must be ``None`` with ``"none"``.

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
        """bool: whether an off-policy correction is on: :meth:`forward` then needs
        ``behavior_logprobs`` (the rollout engine's) and ``old_logprobs`` must be the proximal
        policy's (the trainer's weights before the step, from a no-grad forward)."""
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

        Sum it over every micro-batch of the optimizer step and all-reduce it (SUM) across ranks
        *before* the first forward; pass the total as ``normalizer`` to every :meth:`forward`.

        Args:
            response_mask (Tensor): ``[N, T]`` bool, True on response tokens.

        Returns:
            Tensor: scalar float32 on ``response_mask``'s device: ``N`` for
            ``"sequence_mean"``, the number of True entries for ``"token_mean"``,
            ``N * max_generated_tokens`` for ``"constant"``.
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
            logprobs (Tensor): ``[N, T]`` log-probs of the sampled tokens under the current
                policy (with gradient).
            old_logprobs (Tensor): ``[N, T]`` log-probs under the policy the ratio is taken
                against (treated as constants): the policy that sampled the tokens with
                ``off_policy_correction="none"``, the proximal policy (the trainer's weights
                before the step) with a correction.
            advantages (Tensor): ``[N]`` one advantage per sequence (constants).
            response_mask (Tensor): ``[N, T]`` bool, True on response tokens.
            normalizer (float | Tensor): global sum of :meth:`normalizer_contribution` over
                all micro-batches and ranks of this optimizer step. ``0`` only when the whole
                global batch is empty, which gives a zero loss.
            ref_logprobs (Tensor | None): ``[N, T]`` reference-policy log-probs (constants);
                required when :attr:`needs_reference`.
            entropy (Tensor | None): ``[N, T]`` per-token entropy of the current policy (with
                gradient); required when :attr:`needs_entropy`, summarised whenever given.
            behavior_logprobs (Tensor | None): ``[N, T]`` log-probs of the sampled tokens under
                the behaviour policy (the rollout engine's; constants); required when
                :attr:`needs_proximal_logprobs`. With ``"none"`` its values are ignored (only its
                shape is checked).

        Returns:
            tuple[Tensor, dict[str, Tensor]]: the scalar loss (float32) and stats: detached
            float32 scalars to be *summed* over micro-batches and ranks (``ratio_max``,
            ``is_weight_max``: max):

            * ``loss``, ``policy_loss``, ``kl_loss``, ``entropy_loss``: the loss and its terms,
              already divided by ``normalizer`` (``kl_loss`` includes ``kl_coeff``,
              ``entropy_loss`` is ``-entropy_coeff * entropy`` aggregated).
            * ``normalizer_share``: this micro-batch's contribution / ``normalizer`` (sums to 1
              over one optimizer step; lets several steps be averaged).
            * ``tokens``, ``sequences``: number of response tokens and of sequences.
            * ``ratio_sum``, ``ratio_max``: importance ratio over response tokens (the
              sequence ratio, repeated on each token, with ``importance_level="sequence"``).
            * ``clip_low_sum``: response tokens with ``A < 0`` and ``r < 1 - epsilon_low``;
              ``clip_high_sum``: with ``A > 0`` and ``r > 1 + epsilon_high`` (where PPO's clip
              zeroes the gradient). For ``"cispo"``: tokens whose weight is truncated below /
              above, whatever the advantage's sign. ``dual_clip_sum``: tokens capped by the
              dual clip.
            * ``approx_kl_sum``: k3 estimate of ``KL(pi_old || pi)`` per token,
              ``(r - 1) - log r`` with the token-level ratio.
            * ``kl_sum``: the ``kl_estimator`` vs the reference (0 without ``ref_logprobs``).
            * ``entropy_sum``: the entropy (0 without ``entropy``).
            * ``is_weight_sum``: the behaviour weight applied to the policy term, after
              truncation or dropping, summed over response tokens (1 per token with ``"none"``).
            * ``is_weight_max``: the largest raw (untruncated) behaviour weight over response
              tokens: how far off-policy the batch was.
            * ``is_dropped_sum``: response tokens dropped by the ``"decoupled"`` cap.

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

    The stats are summed over ``stats_list`` (``ratio_max``, ``is_weight_max``: max), then, if
    ``all_reduce`` is given, reduced across ranks with two collective calls (one ``"sum"`` on a
    stacked vector, one ``"max"``), so every rank must call this function with the same stat
    names.

    Args:
        stats_list (Sequence[dict[str, Tensor]]): the stats returned by :meth:`GRPOLoss.forward`
            for each micro-batch on this rank (any number of optimizer steps; the losses are
            averaged over steps through ``normalizer_share``).
        all_reduce (Callable[[Tensor, str], Tensor] | None): ``f(tensor, op)`` with ``op`` in
            ``{"sum", "max"}`` returning the reduced tensor, e.g.
            :func:`torchtune_grpo.distributed.all_reduce`. ``None`` for a single process.

    Returns:
        dict[str, float]: ``loss``, ``policy_loss``, ``kl`` (mean per-token KL to the reference
        estimate), ``entropy`` (mean per token), ``clip_fraction`` (``clip_fraction/low`` +
        ``clip_fraction/high``, fractions of response tokens), ``ratio/mean``, ``ratio/max``,
        ``approx_kl`` (mean per token), ``is_weight/mean`` (mean behaviour weight applied per
        token, after truncation or dropping; 1 with ``off_policy_correction="none"``),
        ``is_weight/max`` (largest raw behaviour weight), ``is_weight/dropped_fraction``
        (fraction of response tokens dropped by the ``"decoupled"`` cap). Token means are 0 when
        there are no response tokens.

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
