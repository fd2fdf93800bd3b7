"""Tests for the parts of the GRPO loss, torchtune_grpo.algorithm.loss_parts.

Expected values are written out with ``math``; the last tests check that ``GRPOLoss`` is exactly
the composition of the parts.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.loss_parts import (
    LOG_RATIO_CLAMP,
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

exp = math.exp
MASK = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
LENGTHS = MASK.float().sum(dim=1)  # [2, 3, 0]


def _close(t: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-6, atol=1e-6)


def test_masked_zeroes_padding_and_blocks_its_gradient() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    x.requires_grad_()
    out = masked(x, MASK)
    _close(out.detach(), [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0]])
    out.sum().backward()
    _close(x.grad, MASK.float().tolist())


def test_clamped_log_ratio_clamps_both_ways() -> None:
    out = clamped_log_ratio(torch.tensor([0.5, 30.0, -1.0]), torch.tensor([0.25, 0.0, 40.0]))
    _close(out, [0.25, LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP])


def test_importance_ratio_token_and_sequence_level() -> None:
    x = masked(torch.tensor([[0.1, 0.3, 9.0], [0.2, -0.3, 0.2], [5.0, 5.0, 5.0]]), MASK)
    _close(
        importance_ratio(x, LENGTHS, "token"),
        [[exp(0.1), exp(0.3), 1.0], [exp(0.2), exp(-0.3), exp(0.2)], [1.0, 1.0, 1.0]],
    )
    # GSPO: exp of the mean over the response tokens, on every token; an empty row gives 1.
    s0, s1 = exp(0.4 / 2), exp(0.1 / 3)
    _close(importance_ratio(x, LENGTHS, "sequence"), [[s0] * 3, [s1] * 3, [1.0] * 3])


def test_ppo_clipped_surrogate_values_indicators_and_zero_gradient_when_clipped() -> None:
    # A > 0: inside, above the upper bound; A < 0: inside, below the lower bound.
    ratio = torch.tensor([[1.1, 1.5], [1.1, 0.5]], requires_grad=True)
    adv = torch.tensor([[2.0], [-1.0]])
    term = ppo_clipped_surrogate(ratio, adv, 0.8, 1.2)
    _close(term.loss.detach(), [[-2.2, -2.4], [1.1, 0.8]])
    assert term.clipped_high.tolist() == [[False, True], [False, False]]
    assert term.clipped_low.tolist() == [[False, False], [False, True]]
    assert not term.dual_clipped.any()
    term.loss.sum().backward()
    _close(ratio.grad, [[-2.0, 0.0], [1.0, 0.0]])


def test_clip_higher_bounds_are_asymmetric() -> None:
    ratio = torch.tensor([[1.25], [0.79]])
    term = ppo_clipped_surrogate(ratio, torch.tensor([[1.0], [-1.0]]), 1 - 0.2, 1 + 0.28)
    # 1.25 < 1.28 is not clipped above; 0.79 < 0.8 is clipped below.
    assert not term.clipped_high.any()
    assert term.clipped_low.tolist() == [[False], [True]]


def test_apply_dual_clip_caps_negative_advantages_only() -> None:
    ratio = torch.tensor([[5.0, 1.0, 3.0], [5.0, 1.0, 3.0]])
    adv = torch.tensor([[-1.0], [1.0]])
    term = ppo_clipped_surrogate(ratio, adv, 0.8, 1.2)
    assert apply_dual_clip(term, adv, None) is term
    capped = apply_dual_clip(term, adv, 3.0)
    # A=-1, r=5: -min(-5, -1.2) = 5 > 3 -> capped at 3; r=3 gives exactly 3: not counted as
    # capped. A=+1 rows are unchanged.
    _close(capped.loss, [[3.0, 1.0, 3.0], [-1.2, -1.0, -1.2]])
    assert capped.dual_clipped.tolist() == [[True, False, False], [False, False, False]]
    assert torch.equal(capped.clipped_low, term.clipped_low)


def test_cispo_gradient_is_clipped_weight_times_advantage_and_never_vanishes() -> None:
    ratio = torch.tensor([[1.5, 0.5, 1.0]], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[-2.0]])
    term = cispo_surrogate(ratio, adv, logp, 0.8, 1.2)
    _close(term.loss.detach(), [[-2.4, -3.2, -1.0]])  # -(clip(r) * A * logp)
    assert term.clipped_high.tolist() == [[True, False, False]]  # whatever the sign of A
    assert term.clipped_low.tolist() == [[False, True, False]]
    term.loss.sum().backward()
    _close(logp.grad, [[2.4, 1.6, 2.0]])  # -clip(r) * A
    assert ratio.grad is None  # stop-gradient on the weight


def test_behaviour_weight_caps() -> None:
    old = masked(torch.tensor([[0.0, 1.0, 7.0], [2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]), MASK)
    behav = torch.zeros(3, 3)
    raw = behaviour_weight(old, behav, LENGTHS, "token")
    _close(raw, [[1.0, exp(1.0), 1.0], [exp(2.0), 1.0, exp(-1.0)], [1.0] * 3])
    seq = behaviour_weight(old, behav, LENGTHS, "sequence")
    _close(seq, [[exp(0.5)] * 3, [exp(1.0 / 3)] * 3, [1.0] * 3])
    applied, dropped = drop_above_cap(raw, MASK, 2.0)
    assert dropped.tolist() == [[False, True, False], [True, False, False], [False] * 3]
    _close(applied, [[1.0, 0.0, 1.0], [0.0, 1.0, exp(-1.0)], [1.0] * 3])
    _close(truncate_at_cap(raw, 2.0), [[1.0, 2.0, 1.0], [2.0, 1.0, exp(-1.0)], [1.0] * 3])
    # Padded positions are never counted as dropped, whatever their weight.
    _, dropped = drop_above_cap(torch.full((3, 3), 9.0), MASK, 2.0)
    assert torch.equal(dropped, MASK)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_token_estimators(estimator: str) -> None:
    logp, ref = torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-0.9, -0.7, -2.0])
    xs = [-0.1, 0.2, 0.0]
    expected = {
        "k1": xs,
        "k2": [0.5 * x * x for x in xs],
        "k3": [exp(-x) + x - 1.0 for x in xs],
    }[estimator]
    _close(kl_per_token(logp, ref, estimator), expected)


def test_k3_is_finite_far_from_the_reference() -> None:
    logp = torch.tensor([-100.0], requires_grad=True)
    kl = kl_per_token(logp, torch.tensor([0.0]), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    _close(kl.detach(), [exp(LOG_RATIO_CLAMP) - LOG_RATIO_CLAMP - 1.0])


def test_approx_kl_to_old() -> None:
    _close(
        approx_kl_to_old(torch.tensor([0.0, 0.5, -0.5])),
        [0.0, exp(0.5) - 1.0 - 0.5, exp(-0.5) - 1.0 + 0.5],
    )


def test_aggregate_and_normalizer_contribution() -> None:
    per_token = masked(torch.tensor([[1.0, 3.0, 99.0], [3.0, 6.0, 9.0], [7.0, 7.0, 7.0]]), MASK)
    # sequence_mean: 4/2 + 18/3 + 0 (an empty sequence contributes 0, not NaN).
    assert aggregate(per_token, LENGTHS, "sequence_mean").item() == pytest.approx(8.0)
    for aggregation in ("token_mean", "constant"):
        assert aggregate(per_token, LENGTHS, aggregation).item() == pytest.approx(22.0)
    assert normalizer_contribution(MASK, "sequence_mean", None).item() == 3.0
    assert normalizer_contribution(MASK, "token_mean", None).item() == 5.0
    assert normalizer_contribution(MASK, "constant", 7).item() == 21.0


def test_safe_normalizer() -> None:
    cpu = torch.device("cpu")
    assert safe_normalizer(0.0, cpu).item() == 1.0
    assert safe_normalizer(4, cpu).item() == 4.0
    n = torch.tensor([[6.0]], dtype=torch.float64, requires_grad=True)
    out = safe_normalizer(n, cpu)
    assert out.shape == () and out.dtype == torch.float32 and not out.requires_grad
    assert out.item() == 6.0


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 3, generator=g) * 2
    old = logp + 0.3 * torch.randn(3, 3, generator=g)
    behav = old + 0.5 * torch.randn(3, 3, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.7])
    return logp, old, behav, adv


def test_grpo_loss_is_exactly_the_composition_of_the_parts_dapo_tis() -> None:
    """DAPO's clip-higher, token mean, with truncated importance sampling: bit for bit."""
    logp, old, behav, adv = _batch()
    loss_fn = GRPOLoss(
        epsilon_low=0.2,
        epsilon_high=0.28,
        aggregation="token_mean",
        off_policy_correction="tis",
        is_weight_cap=1.5,
    )
    norm = loss_fn.normalizer_contribution(MASK)
    loss, stats = loss_fn(logp, old, adv, MASK, normalizer=norm, behavior_logprobs=behav)

    lp, od, bh = masked(logp, MASK), masked(old, MASK), masked(behav, MASK)
    ratio = importance_ratio(clamped_log_ratio(lp, od), LENGTHS, "token")
    term = ppo_clipped_surrogate(ratio, adv.unsqueeze(1), 1.0 - 0.2, 1.0 + 0.28)
    weight = truncate_at_cap(behaviour_weight(od, bh, LENGTHS, "token"), 1.5)
    by_hand = aggregate(masked(term.loss * weight, MASK), LENGTHS, "token_mean") / norm
    assert torch.equal(loss, by_hand)
    assert stats["clip_high_sum"].item() == (term.clipped_high & MASK).sum().item()


def test_grpo_loss_is_exactly_the_composition_of_the_parts_cispo_kl() -> None:
    """CISPO with a k3 KL penalty and Dr. GRPO's constant normalizer: bit for bit."""
    logp, old, _, adv = _batch()
    ref = logp - 0.2
    loss_fn = GRPOLoss(
        clip_mode="cispo",
        epsilon_low=1.0,
        epsilon_high=0.28,
        aggregation="constant",
        max_generated_tokens=4,
        kl_coeff=0.05,
    )
    norm = loss_fn.normalizer_contribution(MASK)
    assert norm.item() == 12.0
    loss, _ = loss_fn(logp, old, adv, MASK, normalizer=norm, ref_logprobs=ref)

    lp, od = masked(logp, MASK), masked(old, MASK)
    ratio = importance_ratio(clamped_log_ratio(lp, od), LENGTHS, "token")
    term = cispo_surrogate(ratio, adv.unsqueeze(1), lp, 1.0 - 1.0, 1.0 + 0.28)
    kl = masked(kl_per_token(lp, masked(ref, MASK), "k3"), MASK)
    per_token = masked(term.loss, MASK) + 0.05 * kl
    assert torch.equal(loss, aggregate(per_token, LENGTHS, "constant") / norm)
