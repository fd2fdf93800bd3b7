"""The GRPO policy loss: one configurable module for GRPO, DAPO, Dr. GRPO, GSPO and CISPO.

Shapes: ``N`` sequences (``prompts * group_size``, groups contiguous), ``T`` response tokens
(right-padded). ``response_mask [N, T]`` is True on real response tokens, stop token included.

Per response token ``t`` of sequence ``i`` (``A_i`` its advantage, ``r_it`` its importance ratio):

* ``clip_mode="ppo"``: ``l_it = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)``,
  and with ``dual_clip=c`` for ``A_i < 0``: ``l_it = min(l_it, -c * A_i)``.
* ``clip_mode="cispo"``: ``l_it = -sg(clip(r_it, 1 - eps_low, 1 + eps_high)) * A_i * logp_it``
  (``sg`` = stop-gradient). The value is not comparable with the PPO form; the gradient is what
  matters: it never vanishes, only the weight is truncated.
* ``importance_level="token"``: ``r_it = exp(logp_it - old_logp_it)``;
  ``"sequence"`` (GSPO): ``r_it = s_i = exp(mean_t(logp_it - old_logp_it))`` over the
  sequence's response tokens, the same ratio for every token of the sequence.

Off-policy corrections (``off_policy_correction``, for asynchronous training, where the batch was
sampled by an older policy or by an engine whose numerics differ): ``old_logp`` above is then the
*proximal* policy's log-prob (the trainer's weights before the step, ``pi_prox``) and
``behav_it`` the log-prob under the behaviour policy ``mu`` that sampled the token (the engine's).
The policy term is multiplied by the constant behaviour weight
``w_it = exp(clamp(old_logp_it - behav_it))`` (``"sequence"``: ``exp(mean_t(...))`` over the
sequence's response tokens, repeated per token), ``l_it <- sg(w'_it) * l_it``:

* ``"none"``: ``w'_it = 1`` (``old_logp`` is then the behaviour log-prob itself);
* ``"decoupled"`` (decoupled PPO): ``w'_it = w_it``; with ``is_weight_cap=C``, tokens with
  ``w_it > C`` are dropped (``w'_it = 0``) but still count in the normaliser;
* ``"tis"`` (truncated importance sampling): ``w'_it = min(w_it, C)``.

The KL and entropy terms are never weighted.

To ``l_it`` are added ``kl_coeff * kl_it`` (an estimator of ``KL(pi || pi_ref)``, see
:class:`GRPOLoss`) and ``- entropy_coeff * entropy_it``. The log-ratios fed to ``exp`` are clamped
to ``[-20, 20]``: beyond that a token is far outside any trust region and an unclamped ``exp``
would turn its (zero) gradient into NaN.

Exact normalisation across micro-batches, gradient accumulation and ranks: the loss of a
micro-batch is ``local_sum / normalizer`` where ``normalizer`` is the *global* sum of
:meth:`GRPOLoss.normalizer_contribution` over every micro-batch of the optimizer step on every
rank. Summing the gradients of all micro-batches (accumulation, then all-reduce SUM across ranks,
i.e. *not* averaged by the data-parallel wrapper, or multiplied back by the world size) then gives
exactly the gradient of the whole global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = [
    "AGGREGATIONS",
    "CLIP_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "OFF_POLICY_CORRECTIONS",
    "GRPOLoss",
    "summarize_loss_stats",
]

AGGREGATIONS = ("sequence_mean", "token_mean", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
CLIP_MODES = ("ppo", "cispo")
OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")

# Log-ratios are clamped to this range before exp() (see the module docstring).
_LOG_RATIO_CLAMP = 20.0

# Stats reduced with MAX; every other stat is reduced with SUM.
_MAX_STATS = ("ratio_max", "is_weight_max")


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


def _kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimator of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    Args:
        logprobs (Tensor): ``[N, T]`` log-probs of the sampled tokens under the policy.
        ref_logprobs (Tensor): ``[N, T]`` log-probs of the same tokens under the reference.
        estimator (str): ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Tensor: ``[N, T]`` per-token estimate.
    """
    log_ratio = logprobs - ref_logprobs  # log pi/pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    d = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log pi_ref/pi
    return torch.exp(d) - d - 1.0


class GRPOLoss(nn.Module):
    """Clipped GRPO policy loss with the variants of GRPO, DAPO, Dr. GRPO, GSPO and CISPO.

    The per-token objective is described in the module docstring. It is aggregated over the
    response tokens (``mask``) of the micro-batch and divided by the caller's global
    ``normalizer``:

    * ``"sequence_mean"`` (GRPO): ``sum_i (sum_t m_it l_it / |o_i|) / normalizer`` with
      ``normalizer`` = number of sequences in the global batch. A sequence with no response
      token contributes 0.
    * ``"token_mean"`` (DAPO): ``sum_it m_it l_it / normalizer``, ``normalizer`` = number of
      response tokens in the global batch.
    * ``"constant"`` (Dr. GRPO): ``sum_it m_it l_it / normalizer``, ``normalizer`` =
      ``sequences * max_generated_tokens``, independent of the completions' lengths.

    KL estimators of ``KL(pi || pi_ref)`` per token, with ``x = log pi - log pi_ref``:

    * ``"k1"``: ``x``; unbiased for the KL value, high variance, can be negative.
    * ``"k2"``: ``x**2 / 2``; biased, low variance, always ``>= 0``.
    * ``"k3"``: ``exp(-x) + x - 1`` (= ``exp(ref - logp) - (ref - logp) - 1``); unbiased,
      low variance, always ``>= 0``. This is the estimator of the GRPO paper.

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
        kl_estimator (str): ``"k1"``, ``"k2"`` or ``"k3"`` (see above).
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
        epsilon = _check_number("epsilon", epsilon, low=0.0)
        eps_low = (
            epsilon if epsilon_low is None else _check_number("epsilon_low", epsilon_low, low=0.0)
        )
        eps_high = (
            epsilon
            if epsilon_high is None
            else _check_number("epsilon_high", epsilon_high, low=0.0)
        )
        if eps_low > 1.0:
            name = "epsilon" if epsilon_low is None else "epsilon_low"
            raise ValueError(
                f"{name} must be <= 1 (the lower clip bound 1 - epsilon_low must stay >= 0), "
                f"got {eps_low}; set epsilon_low explicitly"
            )
        if dual_clip is not None:
            dual_clip = _check_number("dual_clip", dual_clip, low=1.0, low_inclusive=False)
        if importance_level not in IMPORTANCE_LEVELS:
            raise ValueError(
                f"importance_level must be one of {IMPORTANCE_LEVELS}, got {importance_level!r}"
            )
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
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
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
        entropy_coeff = _as_float("entropy_coeff", entropy_coeff)
        if not math.isfinite(entropy_coeff):
            raise ValueError(f"entropy_coeff must be a finite number, got {entropy_coeff!r}")
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
        if clip_mode == "cispo" and importance_level != "token":
            raise ValueError(
                "clip_mode='cispo' works on token-level importance weights; set "
                "importance_level='token' (or use clip_mode='ppo' for GSPO)"
            )
        if clip_mode == "cispo" and dual_clip is not None:
            raise ValueError(
                "dual_clip only applies to clip_mode='ppo'; set dual_clip=None for 'cispo'"
            )
        if off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got "
                f"{off_policy_correction!r}"
            )
        if is_weight_cap is not None:
            if off_policy_correction == "none":
                raise ValueError(
                    f"is_weight_cap={is_weight_cap!r} has no effect with "
                    "off_policy_correction='none'; set is_weight_cap=None or choose "
                    "off_policy_correction='decoupled' or 'tis'"
                )
            is_weight_cap = _check_number(
                "is_weight_cap", is_weight_cap, low=1.0, low_inclusive=False
            )
        elif off_policy_correction == "tis":
            raise ValueError(
                "is_weight_cap is required when off_policy_correction='tis' (the truncation "
                "bound of the importance weight, > 1, e.g. 2.0)"
            )

        self.epsilon_low = eps_low
        self.epsilon_high = eps_high
        self.dual_clip = dual_clip
        self.importance_level = importance_level
        self.aggregation = aggregation
        self.max_generated_tokens = max_generated_tokens
        self.kl_coeff = kl_coeff
        self.kl_estimator = kl_estimator
        self.entropy_coeff = float(entropy_coeff)
        self.clip_mode = clip_mode
        self.off_policy_correction = off_policy_correction
        self.is_weight_cap = is_weight_cap

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
        n = response_mask.shape[0]
        device = response_mask.device
        if self.aggregation == "token_mean":
            return response_mask.bool().sum().to(torch.float32)
        if self.aggregation == "sequence_mean":
            return torch.tensor(float(n), dtype=torch.float32, device=device)
        assert self.max_generated_tokens is not None
        return torch.tensor(
            float(n * self.max_generated_tokens), dtype=torch.float32, device=device
        )

    def _check_inputs(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        normalizer: float | Tensor,
        ref_logprobs: Tensor | None,
        entropy: Tensor | None,
        behavior_logprobs: Tensor | None = None,
    ) -> None:
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
        if ref_logprobs is None and self.needs_reference:
            raise ValueError(
                f"ref_logprobs is required when kl_coeff != 0 (kl_coeff={self.kl_coeff}); "
                "compute the reference model's log-probs or set kl_coeff=0"
            )
        if entropy is None and self.needs_entropy:
            raise ValueError(
                f"entropy is required when entropy_coeff != 0 (entropy_coeff="
                f"{self.entropy_coeff}); pass return_entropy=True to the log-prob function or "
                "set entropy_coeff=0"
            )
        if behavior_logprobs is None and self.needs_proximal_logprobs:
            raise ValueError(
                f"behavior_logprobs is required when off_policy_correction="
                f"{self.off_policy_correction!r}: pass the rollout engine's log-probs of the "
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

    def _aggregate(self, per_token: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
        """Un-normalised local sum of a masked ``[N, T]`` per-token quantity (a scalar)."""
        if self.aggregation == "sequence_mean":
            return (per_token.sum(dim=1) / lengths.clamp(min=1)).sum()
        return per_token.sum()

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
        self._check_inputs(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            normalizer,
            ref_logprobs,
            entropy,
            behavior_logprobs,
        )
        mask = response_mask.bool()
        fmask = mask.to(torch.float32)
        lengths = fmask.sum(dim=1)  # [N]
        zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)

        logp = torch.where(mask, logprobs.float(), zero)
        old = torch.where(mask, old_logprobs.detach().float(), zero)
        adv = advantages.detach().float().unsqueeze(1)  # [N, 1]

        token_log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        if self.importance_level == "sequence":
            seq_log_ratio = token_log_ratio.sum(dim=1) / lengths.clamp(min=1)
            log_ratio = seq_log_ratio.unsqueeze(1).expand_as(logp)
        else:
            log_ratio = token_log_ratio
        ratio = torch.exp(log_ratio)  # [N, T]
        lower, upper = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        clipped_ratio = ratio.clamp(lower, upper)

        if self.clip_mode == "cispo":
            pg = -(clipped_ratio.detach() * adv * logp)
            below, above = ratio < lower, ratio > upper
            dual_active = torch.zeros_like(mask)
        else:
            pg = torch.maximum(-ratio * adv, -clipped_ratio * adv)
            below, above = (adv < 0) & (ratio < lower), (adv > 0) & (ratio > upper)
            if self.dual_clip is not None:
                cap = -self.dual_clip * adv
                dual_active = (adv < 0) & (pg > cap)
                pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
            else:
                dual_active = torch.zeros_like(mask)

        # Behaviour weight pi_prox / mu (a constant): multiplies the policy term only.
        dropped = torch.zeros_like(mask)
        if self.off_policy_correction == "none":
            raw_weight = weight = fmask
        else:
            assert behavior_logprobs is not None
            behav = torch.where(mask, behavior_logprobs.detach().float(), zero)
            log_w = (old - behav).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
            if self.importance_level == "sequence":
                seq_log_w = log_w.sum(dim=1) / lengths.clamp(min=1)
                log_w = seq_log_w.unsqueeze(1).expand_as(log_w)
            raw_weight = torch.exp(log_w)
            weight = raw_weight
            if self.is_weight_cap is not None:
                if self.off_policy_correction == "decoupled":
                    dropped = mask & (raw_weight > self.is_weight_cap)
                    weight = torch.where(dropped, zero, raw_weight)
                else:  # "tis"
                    weight = raw_weight.clamp(max=self.is_weight_cap)
            pg = pg * weight
        pg = torch.where(mask, pg, zero)

        per_token = pg
        kl = None
        if ref_logprobs is not None:
            ref = torch.where(mask, ref_logprobs.detach().float(), zero)
            kl = torch.where(mask, _kl_per_token(logp, ref, self.kl_estimator), zero)
            if self.kl_coeff != 0.0:
                per_token = per_token + self.kl_coeff * kl
        ent = None
        if entropy is not None:
            ent = torch.where(mask, entropy.float(), zero)
            if self.entropy_coeff != 0.0:
                per_token = per_token - self.entropy_coeff * ent

        if isinstance(normalizer, Tensor):
            norm = normalizer.detach().to(device=logp.device, dtype=torch.float32).reshape(())
        else:
            norm = torch.tensor(float(normalizer), dtype=torch.float32, device=logp.device)
        # Only an entirely empty global batch has normalizer 0; every local sum is then 0 too.
        safe_norm = torch.where(norm > 0, norm, torch.ones_like(norm))

        loss = self._aggregate(per_token, mask, lengths) / safe_norm

        with torch.no_grad():
            policy_loss = self._aggregate(pg, mask, lengths) / safe_norm
            kl_loss = (
                self.kl_coeff * self._aggregate(kl, mask, lengths) / safe_norm
                if kl is not None and self.kl_coeff != 0.0
                else zero
            )
            entropy_loss = (
                -self.entropy_coeff * self._aggregate(ent, mask, lengths) / safe_norm
                if ent is not None and self.entropy_coeff != 0.0
                else zero
            )
            masked_ratio = torch.where(mask, ratio, zero)
            tok_ratio = torch.exp(token_log_ratio)
            approx_kl = torch.where(mask, (tok_ratio - 1.0) - token_log_ratio, zero)
            masked_raw_weight = torch.where(mask, raw_weight, zero)
            stats = {
                "loss": loss.detach(),
                "policy_loss": policy_loss,
                "kl_loss": kl_loss,
                "entropy_loss": entropy_loss,
                "normalizer_share": self.normalizer_contribution(mask) / safe_norm,
                "tokens": fmask.sum(),
                "sequences": torch.tensor(
                    float(mask.shape[0]), dtype=torch.float32, device=logp.device
                ),
                "ratio_sum": masked_ratio.sum(),
                "ratio_max": masked_ratio.max() if masked_ratio.numel() else zero,
                "clip_low_sum": (below & mask).sum().to(torch.float32),
                "clip_high_sum": (above & mask).sum().to(torch.float32),
                "dual_clip_sum": (dual_active & mask).sum().to(torch.float32),
                "approx_kl_sum": approx_kl.sum(),
                "kl_sum": kl.sum() if kl is not None else zero,
                "entropy_sum": ent.sum() if ent is not None else zero,
                "is_weight_sum": torch.where(mask, weight, zero).sum(),
                "is_weight_max": masked_raw_weight.max() if masked_raw_weight.numel() else zero,
                "is_dropped_sum": dropped.sum().to(torch.float32),
            }
            stats = {k: v.detach().to(torch.float32).reshape(()) for k, v in stats.items()}
        return loss, stats


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
            :func:`torchtune_grpo.training.distributed.all_reduce`. ``None`` for a single process.

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
