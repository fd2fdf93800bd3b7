"""Tests for torchtune_grpo.algorithm.loss.GRPOLoss and summarize_loss_stats.

Expected values are written out from the formulas with ``math``; they never call the code under
test.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchtune_grpo.algorithm.loss import (
    GRPOLoss,
    summarize_loss_stats,
)
from torchtune_grpo.distributed import WORLD
from torchtune_grpo.policy.logprobs import chunked_token_logprobs

exp = math.exp


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine spinning
    OpenMP threads stall for seconds; run these tests single-threaded and restore afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------
# A tiny batch: N=2 sequences, T=3 tokens. Sequence 0 has 2 response tokens, sequence 1 has 3.
# The padded position holds a wild log-prob that must not matter.
# --------------------------------------------------------------------------------------------
LOGP = [[-1.0, -0.5, -3.0], [-0.3, -1.2, -0.7]]
OLD = [[-1.1, -0.8, -0.1], [-0.5, -0.9, -0.9]]
# log ratios (logp - old):  seq 0: 0.1, 0.3 | seq 1: 0.2, -0.3, 0.2
REF = [[-0.9, -0.7, -1.5], [-0.4, -1.1, -1.0]]
# x = logp - ref:           seq 0: -0.1, 0.2 | seq 1: 0.1, -0.1, 0.3
MASK = [[True, True, False], [True, True, True]]
ADV = [1.0, -0.5]
KL_COEFF = 0.1
MAX_TOKENS = 4

# PPO per-token loss -min(r*A, clip(r, 0.8, 1.2)*A), token-level ratios:
#   (0,0) r=e^0.1=1.105 inside                  -> -e^0.1 * 1
#   (0,1) r=e^0.3=1.350 > 1.2, A>0: clipped     -> -1.2 * 1
#   (1,0) r=e^0.2=1.221, A<0: -min(-.5r, -.6)   -> 0.5 * e^0.2
#   (1,1) r=e^-0.3=0.741 < 0.8, A<0: clipped    -> 0.8 * 0.5 = 0.4
#   (1,2) as (1,0)                              -> 0.5 * e^0.2
PG_TOKEN = [[-exp(0.1), -1.2], [0.5 * exp(0.2), 0.4, 0.5 * exp(0.2)]]
# Sequence-level (GSPO) ratios: s0 = exp((0.1 + 0.3) / 2) = e^0.2 = 1.221 > 1.2 with A>0 ->
# clipped -1.2 on each token; s1 = exp((0.2 - 0.3 + 0.2) / 3) = e^(0.1/3) = 1.034 inside, A<0 ->
# 0.5 * e^(0.1/3) on each token.
PG_SEQUENCE = [[-1.2, -1.2], [0.5 * exp(0.1 / 3)] * 3]
X = [[-0.1, 0.2], [0.1, -0.1, 0.3]]
KL = {
    "k1": [[x for x in row] for row in X],
    "k2": [[0.5 * x * x for x in row] for row in X],
    "k3": [[exp(-x) + x - 1.0 for x in row] for row in X],
}


def _tensors() -> tuple[torch.Tensor, ...]:
    logp = torch.tensor(LOGP, requires_grad=True)
    return logp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(MASK), torch.tensor(REF)


def _aggregate_by_hand(per_token: list[list[float]], aggregation: str) -> float:
    if aggregation == "sequence_mean":  # mean over each sequence's tokens, then over 2 sequences
        return (sum(per_token[0]) / 2 + sum(per_token[1]) / 3) / 2
    if aggregation == "token_mean":  # 5 response tokens
        return (sum(per_token[0]) + sum(per_token[1])) / 5
    return (sum(per_token[0]) + sum(per_token[1])) / (2 * MAX_TOKENS)  # constant


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_hand_computed_loss(aggregation: str, importance_level: str, kl_estimator: str) -> None:
    loss_fn = GRPOLoss(
        epsilon=0.2,
        importance_level=importance_level,
        aggregation=aggregation,
        max_generated_tokens=MAX_TOKENS,
        kl_coeff=KL_COEFF,
        kl_estimator=kl_estimator,
    )
    logp, old, adv, mask, ref = _tensors()
    normalizer = loss_fn.normalizer_contribution(mask)
    assert normalizer.item() == {"sequence_mean": 2, "token_mean": 5, "constant": 8}[aggregation]
    loss, stats = loss_fn(logp, old, adv, mask, normalizer=normalizer, ref_logprobs=ref)

    pg = PG_TOKEN if importance_level == "token" else PG_SEQUENCE
    kl = KL[kl_estimator]
    total = [[p + KL_COEFF * k for p, k in zip(pr, kr)] for pr, kr in zip(pg, kl)]
    assert loss.item() == pytest.approx(_aggregate_by_hand(total, aggregation), rel=1e-5)
    assert stats["policy_loss"].item() == pytest.approx(
        _aggregate_by_hand(pg, aggregation), rel=1e-5
    )
    assert stats["kl_loss"].item() == pytest.approx(
        KL_COEFF * _aggregate_by_hand(kl, aggregation), rel=1e-5, abs=1e-7
    )
    assert stats["kl_sum"].item() == pytest.approx(sum(kl[0]) + sum(kl[1]), rel=1e-5, abs=1e-7)
    assert stats["tokens"].item() == 5
    if importance_level == "token":
        assert stats["clip_high_sum"].item() == 1  # (0,1)
        assert stats["clip_low_sum"].item() == 1  # (1,1)
        ratios = [exp(0.1), exp(0.3), exp(0.2), exp(-0.3), exp(0.2)]
    else:
        assert stats["clip_high_sum"].item() == 2  # both tokens of sequence 0
        assert stats["clip_low_sum"].item() == 0
        ratios = [exp(0.2)] * 2 + [exp(0.1 / 3)] * 3
    assert stats["ratio_sum"].item() == pytest.approx(sum(ratios), rel=1e-5)
    assert stats["ratio_max"].item() == pytest.approx(max(ratios), rel=1e-5)
    # approx_kl: k3 of KL(old || new) with the token ratios, (r - 1) - log r.
    lrs = [0.1, 0.3, 0.2, -0.3, 0.2]
    assert stats["approx_kl_sum"].item() == pytest.approx(
        sum(exp(v) - 1 - v for v in lrs), rel=1e-4
    )
    for v in stats.values():
        assert v.dim() == 0 and not v.requires_grad


def test_hand_computed_gradient_token_level() -> None:
    # token_mean, no KL: d loss / d logp_it = -r_it * A_i / 5 where the unclipped branch is
    # active, 0 where the clip is active, 0 on padding.
    loss_fn = GRPOLoss(aggregation="token_mean")
    logp, old, adv, mask, _ = _tensors()
    loss, _ = loss_fn(logp, old, adv, mask, normalizer=5)
    loss.backward()
    expected = [[-exp(0.1) / 5, 0.0, 0.0], [0.5 * exp(0.2) / 5, 0.0, 0.5 * exp(0.2) / 5]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected), rtol=1e-5, atol=1e-7)


def test_hand_computed_gradient_sequence_level() -> None:
    # GSPO, sequence_mean, a wide clip so nothing is clipped: per-sequence loss -s_i * A_i with
    # s_i = exp(mean log-ratio) -> d/d logp_it = -A_i * s_i / |o_i| / 2.
    loss_fn = GRPOLoss(epsilon=0.5, importance_level="sequence", aggregation="sequence_mean")
    logp, old, adv, mask, _ = _tensors()
    loss, _ = loss_fn(logp, old, adv, mask, normalizer=2)
    s0, s1 = exp(0.2), exp(0.1 / 3)
    assert loss.item() == pytest.approx((-s0 * 1.0 + s1 * 0.5) / 2, rel=1e-6)
    loss.backward()
    g0, g1 = -1.0 * s0 / 2 / 2, 0.5 * s1 / 3 / 2
    expected = [[g0, g0, 0.0], [g1, g1, g1]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected), rtol=1e-5, atol=1e-7)


def test_clip_higher_and_dual_clip_by_hand() -> None:
    logp = torch.tensor([[0.22, 1.5]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # A>0, r=e^0.22=1.246: clipped at 1.2 with epsilon=0.2, free with epsilon_high=0.28.
    pos = torch.tensor([2.0])
    sym, _ = GRPOLoss(aggregation="token_mean")(
        logp[:, :1], old[:, :1], pos, mask[:, :1], normalizer=1
    )
    dapo, _ = GRPOLoss(epsilon_high=0.28, aggregation="token_mean")(
        logp[:, :1], old[:, :1], pos, mask[:, :1], normalizer=1
    )
    assert sym.item() == pytest.approx(-1.2 * 2.0, rel=1e-6)
    assert dapo.item() == pytest.approx(-exp(0.22) * 2.0, rel=1e-6)
    # A<0, r=e^1.5=4.48: PPO loss -r*A = 4.48 * 0.5; dual clip c=3 caps it at 3 * 0.5.
    neg = torch.tensor([-0.5])
    ppo, st_ppo = GRPOLoss(aggregation="token_mean")(
        logp[:, 1:], old[:, 1:], neg, mask[:, 1:], normalizer=1
    )
    dual, st_dual = GRPOLoss(dual_clip=3.0, aggregation="token_mean")(
        logp[:, 1:], old[:, 1:], neg, mask[:, 1:], normalizer=1
    )
    assert ppo.item() == pytest.approx(exp(1.5) * 0.5, rel=1e-6)
    assert dual.item() == pytest.approx(3.0 * 0.5, rel=1e-6)
    assert st_ppo["dual_clip_sum"].item() == 0 and st_dual["dual_clip_sum"].item() == 1
    (grad,) = torch.autograd.grad(dual, logp)
    assert grad.abs().sum().item() == 0.0  # the cap is a constant


def test_cispo_by_hand() -> None:
    # -sg(clip(r, 0.8, 1.2)) * A * logp per token, token_mean over 3 tokens.
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0]])  # r = e^0.5 (clipped to 1.2), 1, e^-1 (-> 0.8)
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = GRPOLoss(clip_mode="cispo", aggregation="token_mean")(
        logp, old, adv, mask, normalizer=3
    )
    expected = -(1.2 * 2.0 * -0.5 + 1.0 * 2.0 * -1.0 + 0.8 * 2.0 * -2.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # The gradient never vanishes: -w * A / 3 on every token, even the clipped ones.
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.2 * 2 / 3, -1.0 * 2 / 3, -0.8 * 2 / 3]]), rtol=1e-6, atol=0
    )
    assert stats["clip_high_sum"].item() == 1 and stats["clip_low_sum"].item() == 1


def test_entropy_bonus_by_hand() -> None:
    loss_fn = GRPOLoss(aggregation="sequence_mean", entropy_coeff=0.01)
    assert loss_fn.needs_entropy and not loss_fn.needs_reference
    logp, old, adv, mask, _ = _tensors()
    ent = torch.tensor([[1.0, 2.0, 100.0], [0.5, 0.5, 2.0]], requires_grad=True)
    loss, stats = loss_fn(logp, old, adv, mask, normalizer=2, entropy=ent)
    total = [
        [p - 0.01 * e for p, e in zip(pr, er)]
        for pr, er in zip(PG_TOKEN, [[1.0, 2.0], [0.5, 0.5, 2.0]])
    ]
    assert loss.item() == pytest.approx(_aggregate_by_hand(total, "sequence_mean"), rel=1e-5)
    assert stats["entropy_sum"].item() == pytest.approx(6.0)
    loss.backward()
    expected = [[-0.01 / 2 / 2] * 2 + [0.0], [-0.01 / 3 / 2] * 3]
    torch.testing.assert_close(ent.grad, torch.tensor(expected), rtol=1e-6, atol=0)


def test_empty_sequence_contributes_zero_without_nan() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0], [-5.0, -5.0]])
    mask = torch.tensor([[True, False], [False, False]])
    for aggregation in ("sequence_mean", "token_mean", "constant"):
        loss_fn = GRPOLoss(aggregation=aggregation, max_generated_tokens=2, kl_coeff=0.1)
        norm = loss_fn.normalizer_contribution(mask)
        loss, stats = loss_fn(
            logp, old, torch.tensor([1.0, 3.0]), mask, normalizer=norm, ref_logprobs=old
        )
        expected = {"sequence_mean": -1.0 / 2, "token_mean": -1.0, "constant": -1.0 / 4}
        assert loss.item() == pytest.approx(expected[aggregation])
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(grad).all() and grad[1].abs().sum() == 0
        assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
@pytest.mark.parametrize("clip_mode", ["ppo", "cispo"])
def test_all_masked_batch_zero_loss_and_no_update(aggregation: str, clip_mode: str) -> None:
    torch.manual_seed(0)
    model = _TinyPolicy()
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn = GRPOLoss(
        aggregation=aggregation,
        max_generated_tokens=6,
        kl_coeff=0.1,
        entropy_coeff=0.01,
        clip_mode=clip_mode,
    )
    data = _make_batch(model)
    mask = torch.zeros_like(data["mask"])
    logp, ent = model(data["inputs"], data["targets"])
    norm = loss_fn.normalizer_contribution(mask)
    loss, stats = loss_fn(
        logp,
        data["old"],
        data["adv"],
        mask,
        normalizer=norm,
        ref_logprobs=data["ref"],
        entropy=ent,
    )
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in stats.values())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    summary = summarize_loss_stats([stats])
    assert all(math.isfinite(v) for v in summary.values())
    assert summary["clip_fraction"] == 0.0 and summary["loss"] == 0.0


def test_epsilon_changes_clipped_loss_only_off_policy() -> None:
    logp, old, adv, mask, _ = _tensors()
    narrow = GRPOLoss(epsilon=0.1, aggregation="token_mean")
    wide = GRPOLoss(epsilon=0.3, aggregation="token_mean")
    l_narrow, _ = narrow(logp, old, adv, mask, normalizer=5)
    l_wide, _ = wide(logp, old, adv, mask, normalizer=5)
    assert abs(l_narrow.item() - l_wide.item()) > 1e-3
    # On-policy (old == new) every ratio is 1 and epsilon cannot matter.
    on_n, _ = narrow(logp, logp.detach(), adv, mask, normalizer=5)
    on_w, _ = wide(logp, logp.detach(), adv, mask, normalizer=5)
    assert on_n.item() == on_w.item()
    assert on_n.item() == pytest.approx(-(1.0 * 2 - 0.5 * 3) / 5)


def test_clip_fraction_counts_only_response_tokens() -> None:
    # Padded positions have extreme ratios in both directions; they must not be counted.
    logp = torch.tensor([[0.0, 5.0, -5.0], [0.0, 5.0, -5.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, False, False], [True, True, False]])
    _, stats = GRPOLoss()(logp, old, adv, mask, normalizer=2)
    assert stats["tokens"].item() == 3
    assert stats["clip_high_sum"].item() == 0  # (0,1) r=e^5 is padding
    assert stats["clip_low_sum"].item() == 0  # (1,1) r=e^5 with A<0: not a clip; (1,2) padding
    assert stats["ratio_max"].item() == pytest.approx(exp(5.0))
    logp2 = torch.tensor([[5.0, 5.0, 5.0], [-5.0, -5.0, -5.0]])
    _, stats2 = GRPOLoss()(logp2, old, adv, mask, normalizer=2)
    assert stats2["clip_high_sum"].item() == 1  # only (0,0) of sequence 0
    assert stats2["clip_low_sum"].item() == 2  # (1,0), (1,1)
    summary = summarize_loss_stats([stats2])
    assert summary["clip_fraction/high"] == pytest.approx(1 / 3)
    assert summary["clip_fraction/low"] == pytest.approx(2 / 3)
    assert summary["clip_fraction"] == pytest.approx(1.0)


def test_stats_sum_over_micro_batches_equals_whole_batch() -> None:
    torch.manual_seed(1)
    model = _TinyPolicy()
    data = _make_batch(model)
    loss_fn = GRPOLoss(aggregation="token_mean", kl_coeff=0.05, entropy_coeff=0.01)
    whole = _micro_batch_stats(loss_fn, model, data, [slice(0, 8)])
    split = _micro_batch_stats(loss_fn, model, data, [slice(0, 3), slice(3, 5), slice(5, 8)])
    s_whole = summarize_loss_stats(whole)
    s_split = summarize_loss_stats(split)
    assert s_whole.keys() == s_split.keys()
    for k in s_whole:
        assert s_split[k] == pytest.approx(s_whole[k], rel=1e-5, abs=1e-7), k
    assert s_whole["clip_fraction"] > 0 and s_whole["kl"] > 0 and s_whole["entropy"] > 0
    # Two optimizer steps: loss is averaged over steps through normalizer_share.
    s_two = summarize_loss_stats(whole + split)
    assert s_two["loss"] == pytest.approx(s_whole["loss"], rel=1e-5)
    # A fake all_reduce that doubles "sum" (two identical ranks) keeps means and max.
    s_ranks = summarize_loss_stats(whole, all_reduce=lambda t, op: t * 2 if op == "sum" else t)
    for k in ("clip_fraction", "ratio/mean", "ratio/max", "kl", "entropy", "approx_kl"):
        assert s_ranks[k] == pytest.approx(s_whole[k], rel=1e-6)
    assert set(s_whole) == {
        "loss",
        "policy_loss",
        "kl",
        "entropy",
        "clip_fraction",
        "clip_fraction/low",
        "clip_fraction/high",
        "ratio/mean",
        "ratio/max",
        "approx_kl",
        "is_weight/mean",
        "is_weight/max",
        "is_weight/dropped_fraction",
    }


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon_low": 1.5}, "epsilon_low"),
        ({"epsilon_high": float("nan")}, "epsilon_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"importance_level": "seq"}, "importance_level"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"aggregation": "constant"}, "max_generated_tokens"),
        ({"aggregation": "constant", "max_generated_tokens": 0}, "max_generated_tokens"),
        ({"kl_coeff": -1.0}, "kl_coeff"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"entropy_coeff": float("inf")}, "entropy_coeff"),
        ({"clip_mode": "trpo"}, "clip_mode"),
        ({"clip_mode": "cispo", "importance_level": "sequence"}, "importance_level"),
        ({"clip_mode": "cispo", "dual_clip": 3.0}, "dual_clip"),
    ],
)
def test_constructor_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_forward_validation() -> None:
    logp, old, adv, mask, _ref = _tensors()
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOLoss(kl_coeff=0.1)(logp, old, adv, mask, normalizer=2)
    with pytest.raises(ValueError, match="entropy"):
        GRPOLoss(entropy_coeff=0.1)(logp, old, adv, mask, normalizer=2)
    with pytest.raises(ValueError, match="advantages"):
        GRPOLoss()(logp, old, adv[:1], mask, normalizer=2)
    with pytest.raises(ValueError, match="old_logprobs"):
        GRPOLoss()(logp, old[:, :2], adv, mask, normalizer=2)
    with pytest.raises(ValueError, match="normalizer"):
        GRPOLoss()(logp, old, adv, mask, normalizer=-1.0)
    assert GRPOLoss(kl_coeff=0.1).needs_reference
    assert not GRPOLoss().needs_reference and not GRPOLoss().needs_entropy


# --------------------------------------------------------------------------------------------
# Exactness across micro-batches, gradient accumulation and ranks.
# --------------------------------------------------------------------------------------------
N, T, D, V = 8, 6, 16, 32


class _TinyPolicy(nn.Module):
    """hidden = tanh(W1 x); logits = W2 hidden; log-probs through chunked_token_logprobs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = torch.tanh(self.body(inputs))
        return chunked_token_logprobs(
            hidden, self.head, targets, chunk_size=5, temperature=0.9, return_entropy=True
        )


def _make_batch(model: _TinyPolicy) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(N, T, D, generator=g)
    targets = torch.randint(0, V, (N, T), generator=g)
    lengths = torch.tensor([6, 3, 1, 0, 5, 6, 2, 4])  # one empty sequence
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    with torch.no_grad():
        logp, _ = model(inputs, targets)
    old = logp + 0.3 * torch.randn(N, T, generator=g)  # off-policy: some ratios get clipped
    ref = logp + 0.2 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, generator=g)
    return {"inputs": inputs, "targets": targets, "mask": mask, "old": old, "ref": ref, "adv": adv}


def _loss_fn(aggregation: str, importance_level: str, clip_mode: str = "ppo") -> GRPOLoss:
    return GRPOLoss(
        epsilon_low=0.2,
        epsilon_high=0.28,
        aggregation=aggregation,
        max_generated_tokens=T,
        importance_level=importance_level,
        kl_coeff=0.05,
        entropy_coeff=0.01,
        clip_mode=clip_mode,
        dual_clip=3.0 if clip_mode == "ppo" else None,
    )


def _micro_loss(
    loss_fn: GRPOLoss, model: _TinyPolicy, data: dict, rows: slice, normalizer: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    logp, ent = model(data["inputs"][rows], data["targets"][rows])
    return loss_fn(
        logp,
        data["old"][rows],
        data["adv"][rows],
        data["mask"][rows],
        normalizer=normalizer,
        ref_logprobs=data["ref"][rows],
        entropy=ent,
    )


def _micro_batch_stats(loss_fn: GRPOLoss, model: _TinyPolicy, data: dict, parts: list) -> list:
    norm = sum(loss_fn.normalizer_contribution(data["mask"][p]) for p in parts)
    return [_micro_loss(loss_fn, model, data, p, norm)[1] for p in parts]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _assert_grads_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def _reference(loss_fn: GRPOLoss, model: _TinyPolicy, data: dict) -> tuple[list, float]:
    model.zero_grad()
    norm = loss_fn.normalizer_contribution(data["mask"])
    loss, _ = _micro_loss(loss_fn, model, data, slice(0, N), norm)
    loss.backward()
    return _grads(model), loss.item()


VARIANTS = [
    ("sequence_mean", "token", "ppo"),
    ("token_mean", "token", "ppo"),
    ("constant", "token", "ppo"),
    ("sequence_mean", "sequence", "ppo"),
    ("token_mean", "sequence", "ppo"),
    ("constant", "sequence", "ppo"),
    ("token_mean", "token", "cispo"),
]


@pytest.mark.parametrize("aggregation, importance_level, clip_mode", VARIANTS)
def test_micro_batch_and_grad_accumulation_invariance(
    aggregation: str, importance_level: str, clip_mode: str
) -> None:
    torch.manual_seed(0)
    model = _TinyPolicy()
    data = _make_batch(model)
    loss_fn = _loss_fn(aggregation, importance_level, clip_mode)
    ref_grads, ref_loss = _reference(loss_fn, model, data)
    assert any(g.abs().sum() > 0 for g in ref_grads)

    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]  # uneven; the middle one is empty
    norm = sum(loss_fn.normalizer_contribution(data["mask"][p]) for p in parts)

    # Micro-batches summed into one backward.
    model.zero_grad()
    losses = [_micro_loss(loss_fn, model, data, p, norm)[0] for p in parts]
    total = torch.stack(losses).sum()
    total.backward()
    assert total.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    _assert_grads_close(_grads(model), ref_grads)

    # Gradient accumulation: one backward per micro-batch, grads accumulate in .grad.
    model.zero_grad()
    for p in parts:
        loss, _ = _micro_loss(loss_fn, model, data, p, norm)
        loss.backward()
    _assert_grads_close(_grads(model), ref_grads)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes share the CPU cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results = {}
        for aggregation, importance_level, clip_mode in VARIANTS:
            torch.manual_seed(0)
            model = _TinyPolicy()
            data = _make_batch(model)
            loss_fn = _loss_fn(aggregation, importance_level, clip_mode)
            ref_grads, _ = _reference(loss_fn, model, data)
            ref_stats = _micro_batch_stats(loss_fn, model, data, [slice(0, N)])
            # This rank's half, itself split into two gradient-accumulation micro-batches.
            half = N // world_size
            lo = rank * half
            parts = [slice(lo, lo + 1), slice(lo + 1, lo + half)]
            local = sum(loss_fn.normalizer_contribution(data["mask"][p]) for p in parts)
            norm = WORLD.all_reduce(local.clone(), "sum")
            model.zero_grad()
            stats = []
            for p in parts:
                loss, st = _micro_loss(loss_fn, model, data, p, norm)
                loss.backward()
                stats.append(st)
            for param in model.parameters():
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            results[f"{aggregation}/{importance_level}/{clip_mode}"] = {
                "grads": _grads(model),
                "ref_grads": ref_grads,
                "summary": summarize_loss_stats(stats, all_reduce=WORLD.all_reduce),
                "ref_summary": summarize_loss_stats(ref_stats),
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_match_single_process() -> None:
    world_size = 2
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _distributed_worker,
            args=(world_size, _free_port(), out_dir),
            nprocs=world_size,
            join=True,
        )
        for rank in range(world_size):
            results = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
            assert len(results) == len(VARIANTS)
            for name, r in results.items():
                _assert_grads_close(r["grads"], r["ref_grads"])
                for k, v in r["ref_summary"].items():
                    assert r["summary"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, k)


# --------------------------------------------------------------------------------------------
# Off-policy corrections: OLD is now the proximal policy, BEHAV the rollout engine's log-probs.
# Behaviour log-weights old - behav: seq 0: 0.5, -0.2 | seq 1: 0.0, -0.4, 1.0; the padded
# position holds a wild value that must not matter.
# --------------------------------------------------------------------------------------------
BEHAV = [[-1.6, -0.6, 50.0], [-0.5, -0.5, -1.9]]
LOG_W = [[0.5, -0.2], [0.0, -0.4, 1.0]]
RAW_W = [[exp(v) for v in row] for row in LOG_W]  # max e^1 = 2.718 at (1,2)
CAP = 2.0
# Unweighted d(PPO term)/d logp_it (token level, epsilon 0.2): -r_it * A_i where unclipped,
# 0 where clipped ((0,1) and (1,1)); see PG_TOKEN.
PG_GRAD_TOKEN = [[-exp(0.1), 0.0], [0.5 * exp(0.2), 0.0, 0.5 * exp(0.2)]]
# Weight actually applied per correction (cap 2.0 hits only (1,2), w = e^1 = 2.718, which is
# unclipped so its gradient changes too):
APPLIED_W = {
    ("decoupled", None): RAW_W,
    ("decoupled", CAP): [RAW_W[0], [RAW_W[1][0], RAW_W[1][1], 0.0]],  # (1,2) dropped
    ("tis", CAP): [RAW_W[0], [RAW_W[1][0], RAW_W[1][1], CAP]],  # (1,2) truncated to 2
}


def _pad(rows: list[list[float]]) -> torch.Tensor:
    """[[a, b], [c, d, e]] -> [[a, b, 0], [c, d, e]] (the padded position's expected 0)."""
    return torch.tensor([rows[0] + [0.0], rows[1]])


@pytest.mark.parametrize("correction, cap", list(APPLIED_W))
def test_off_policy_correction_by_hand(correction: str, cap: float | None) -> None:
    # token_mean over 5 tokens, PPO, KL (k3) and entropy on: only the policy term is weighted.
    loss_fn = GRPOLoss(
        aggregation="token_mean",
        kl_coeff=KL_COEFF,
        entropy_coeff=0.01,
        off_policy_correction=correction,
        is_weight_cap=cap,
    )
    assert loss_fn.needs_proximal_logprobs
    logp, old, adv, mask, ref = _tensors()
    ent = torch.tensor([[1.0, 2.0, 100.0], [0.5, 0.5, 2.0]], requires_grad=True)
    behav = torch.tensor(BEHAV)
    loss, stats = loss_fn(
        logp, old, adv, mask, normalizer=5, ref_logprobs=ref, entropy=ent, behavior_logprobs=behav
    )
    w = APPLIED_W[(correction, cap)]
    ents = [[1.0, 2.0], [0.5, 0.5, 2.0]]
    kl = KL["k3"]
    pg = [[wi * p for wi, p in zip(wr, pr)] for wr, pr in zip(w, PG_TOKEN)]
    total = [
        [p + KL_COEFF * k - 0.01 * e for p, k, e in zip(pr, kr, er)]
        for pr, kr, er in zip(pg, kl, ents)
    ]
    assert loss.item() == pytest.approx(_aggregate_by_hand(total, "token_mean"), rel=1e-5)
    assert stats["policy_loss"].item() == pytest.approx(
        _aggregate_by_hand(pg, "token_mean"), rel=1e-5
    )
    # KL and entropy terms are not weighted.
    assert stats["kl_loss"].item() == pytest.approx(
        KL_COEFF * _aggregate_by_hand(kl, "token_mean"), rel=1e-5
    )
    assert stats["entropy_loss"].item() == pytest.approx(
        -0.01 * _aggregate_by_hand(ents, "token_mean"), rel=1e-5
    )
    loss.backward()
    # d/d logp: w * d(PPO term) + kl_coeff * d(k3)/d logp = kl_coeff * (1 - exp(-x)), all / 5.
    grad = [
        [(wi * g + KL_COEFF * (1.0 - exp(-x))) / 5 for wi, g, x in zip(wr, gr, xr)]
        for wr, gr, xr in zip(w, PG_GRAD_TOKEN, X)
    ]
    torch.testing.assert_close(logp.grad, _pad(grad), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        ent.grad, torch.tensor([[-0.01 / 5] * 2 + [0.0], [-0.01 / 5] * 3]), rtol=1e-6, atol=0
    )
    assert stats["is_weight_sum"].item() == pytest.approx(sum(map(sum, w)), rel=1e-5)
    assert stats["is_weight_max"].item() == pytest.approx(exp(1.0), rel=1e-5)  # raw, untruncated
    assert stats["is_dropped_sum"].item() == (1 if (correction, cap) == ("decoupled", CAP) else 0)
    # The other stats do not depend on the correction (the clipped ratio is pi_theta / pi_prox).
    assert stats["clip_high_sum"].item() == 1 and stats["clip_low_sum"].item() == 1
    ratios = [exp(0.1), exp(0.3), exp(0.2), exp(-0.3), exp(0.2)]
    assert stats["ratio_sum"].item() == pytest.approx(sum(ratios), rel=1e-5)


@pytest.mark.parametrize("correction, cap", list(APPLIED_W))
def test_off_policy_correction_cispo_by_hand(correction: str, cap: float | None) -> None:
    # CISPO: l = -w * sg(clip(r)) * A * logp, gradient -w * clip(r) * A per token.
    loss_fn = GRPOLoss(
        clip_mode="cispo",
        aggregation="token_mean",
        off_policy_correction=correction,
        is_weight_cap=cap,
    )
    logp, old, adv, mask, _ = _tensors()
    loss, _ = loss_fn(logp, old, adv, mask, normalizer=5, behavior_logprobs=torch.tensor(BEHAV))
    w = APPLIED_W[(correction, cap)]
    # clip(r, 0.8, 1.2) whatever the advantage's sign: r = e^0.1, e^0.3 | e^0.2, e^-0.3, e^0.2.
    clipped = [[exp(0.1), 1.2], [1.2, 0.8, 1.2]]
    a = [1.0, -0.5]
    lp = [[-1.0, -0.5], [-0.3, -1.2, -0.7]]
    per_token = [
        [-wi * c * a[i] * v for wi, c, v in zip(w[i], clipped[i], lp[i])] for i in range(2)
    ]
    assert loss.item() == pytest.approx(_aggregate_by_hand(per_token, "token_mean"), rel=1e-5)
    loss.backward()
    grad = [[-wi * c * a[i] / 5 for wi, c in zip(w[i], clipped[i])] for i in range(2)]
    torch.testing.assert_close(logp.grad, _pad(grad), rtol=1e-5, atol=1e-7)


def _off_policy_micro_loss(
    loss_fn: GRPOLoss, data: dict, rows: slice, normalizer: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, dict]:
    """_micro_loss with extra keyword arguments (``behavior_logprobs``) for the loss."""
    logp, ent = data["model"](data["inputs"][rows], data["targets"][rows])
    return loss_fn(
        logp,
        data["old"][rows],
        data["adv"][rows],
        data["mask"][rows],
        normalizer=normalizer,
        ref_logprobs=data["ref"][rows],
        entropy=ent,
        **kwargs,
    )


def _run_loss(loss_fn: GRPOLoss, data: dict, **kwargs) -> tuple:
    """Loss, stats and parameter gradients of the whole batch (no kwargs: _micro_loss)."""
    model = data["model"]
    model.zero_grad()
    norm = loss_fn.normalizer_contribution(data["mask"])
    if kwargs:
        loss, stats = _off_policy_micro_loss(loss_fn, data, slice(0, N), norm, **kwargs)
    else:
        loss, stats = _micro_loss(loss_fn, model, data, slice(0, N), norm)
    loss.backward()
    return loss.detach(), stats, _grads(model)


def _policy_batch() -> dict:
    torch.manual_seed(0)
    model = _TinyPolicy()
    data = _make_batch(model)
    g = torch.Generator().manual_seed(99)
    data["behav"] = data["old"] + 0.4 * torch.randn(N, T, generator=g)
    data["model"] = model
    return data


@pytest.mark.parametrize("aggregation, importance_level, clip_mode", VARIANTS)
def test_none_correction_is_bitwise_unchanged(
    aggregation: str, importance_level: str, clip_mode: str
) -> None:
    data = _policy_batch()
    base = _loss_fn(aggregation, importance_level, clip_mode)
    explicit = GRPOLoss(
        epsilon_low=0.2,
        epsilon_high=0.28,
        aggregation=aggregation,
        max_generated_tokens=T,
        importance_level=importance_level,
        kl_coeff=0.05,
        entropy_coeff=0.01,
        clip_mode=clip_mode,
        dual_clip=3.0 if clip_mode == "ppo" else None,
        off_policy_correction="none",
    )
    assert not explicit.needs_proximal_logprobs
    loss0, stats0, grads0 = _run_loss(base, data)
    loss1, stats1, grads1 = _run_loss(explicit, data, behavior_logprobs=data["behav"])
    loss2, stats2, grads2 = _run_loss(explicit, data, behavior_logprobs=None)
    for loss, stats, grads in ((loss1, stats1, grads1), (loss2, stats2, grads2)):
        assert torch.equal(loss, loss0)
        assert stats.keys() == stats0.keys()
        for k in stats0:
            assert torch.equal(stats[k], stats0[k]), k
        for g, g0 in zip(grads, grads0):
            assert torch.equal(g, g0)
    # With "none" the weight is 1 per token.
    assert stats0["is_weight_sum"].item() == stats0["tokens"].item()
    assert stats0["is_weight_max"].item() == 1.0 and stats0["is_dropped_sum"].item() == 0.0


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("aggregation, importance_level, clip_mode", VARIANTS)
def test_decoupled_equals_none_when_behavior_equals_proximal(
    aggregation: str, importance_level: str, clip_mode: str, cap: float | None
) -> None:
    data = _policy_batch()
    none = _loss_fn(aggregation, importance_level, clip_mode)
    decoupled = GRPOLoss(
        epsilon_low=0.2,
        epsilon_high=0.28,
        aggregation=aggregation,
        max_generated_tokens=T,
        importance_level=importance_level,
        kl_coeff=0.05,
        entropy_coeff=0.01,
        clip_mode=clip_mode,
        dual_clip=3.0 if clip_mode == "ppo" else None,
        off_policy_correction="decoupled",
        is_weight_cap=cap,
    )
    loss0, stats0, grads0 = _run_loss(none, data)
    loss1, stats1, grads1 = _run_loss(decoupled, data, behavior_logprobs=data["old"].clone())
    assert torch.equal(loss1, loss0)
    for k in stats0:
        assert torch.equal(stats1[k], stats0[k]), k
    for g, g0 in zip(grads1, grads0):
        assert torch.equal(g, g0)
    # ... and a behaviour policy that differs changes the gradient.
    _, _, grads2 = _run_loss(decoupled, data, behavior_logprobs=data["behav"])
    assert any(not torch.equal(g, g0) for g, g0 in zip(grads2, grads0))


@pytest.mark.parametrize("correction, cap", [("decoupled", None), ("decoupled", 2.0), ("tis", 2.0)])
def test_off_policy_weight_carries_no_gradient(correction: str, cap: float | None) -> None:
    loss_fn = GRPOLoss(
        aggregation="token_mean", off_policy_correction=correction, is_weight_cap=cap
    )
    logp = torch.tensor(LOGP, requires_grad=True)
    old = torch.tensor(OLD, requires_grad=True)
    behav = torch.tensor(BEHAV, requires_grad=True)
    loss, _ = loss_fn(
        logp, old, torch.tensor(ADV), torch.tensor(MASK), normalizer=5, behavior_logprobs=behav
    )
    g_logp, g_old, g_behav = torch.autograd.grad(loss, [logp, old, behav], allow_unused=True)
    assert g_old is None and g_behav is None
    assert g_logp is not None and g_logp.abs().sum() > 0


def test_gspo_decoupled_uses_sequence_weight() -> None:
    # GSPO, sequence_mean, wide clip (nothing clipped): per-sequence loss -w_i * s_i * A_i with
    # w_i = exp(mean_t(old - behav)): w0 = e^((0.5 - 0.2) / 2) = e^0.15 = 1.162,
    # w1 = e^((0 - 0.4 + 1) / 3) = e^0.2 = 1.221 (not the token weights).
    s0, s1 = exp(0.2), exp(0.1 / 3)
    w0, w1 = exp(0.15), exp(0.2)
    for cap, (k0, k1) in ((None, (w0, w1)), (1.2, (w0, 0.0))):  # cap 1.2 drops sequence 1
        loss_fn = GRPOLoss(
            epsilon=0.5,
            importance_level="sequence",
            aggregation="sequence_mean",
            off_policy_correction="decoupled",
            is_weight_cap=cap,
        )
        logp, old, adv, mask, _ = _tensors()
        loss, stats = loss_fn(
            logp, old, adv, mask, normalizer=2, behavior_logprobs=torch.tensor(BEHAV)
        )
        assert loss.item() == pytest.approx((-k0 * s0 * 1.0 + k1 * s1 * 0.5) / 2, rel=1e-5)
        loss.backward()
        g0, g1 = -k0 * 1.0 * s0 / 2 / 2, k1 * 0.5 * s1 / 3 / 2
        torch.testing.assert_close(
            logp.grad, torch.tensor([[g0, g0, 0.0], [g1, g1, g1]]), rtol=1e-5, atol=1e-7
        )
        assert stats["is_weight_sum"].item() == pytest.approx(2 * k0 + 3 * k1, rel=1e-5)
        assert stats["is_weight_max"].item() == pytest.approx(w1, rel=1e-5)
        assert stats["is_dropped_sum"].item() == (0 if cap is None else 3)
    # tis truncates the sequence weight instead: cap 1.2 -> w1 = 1.2 on every token.
    loss_fn = GRPOLoss(
        epsilon=0.5,
        importance_level="sequence",
        aggregation="sequence_mean",
        off_policy_correction="tis",
        is_weight_cap=1.2,
    )
    logp, old, adv, mask, _ = _tensors()
    loss, stats = loss_fn(logp, old, adv, mask, normalizer=2, behavior_logprobs=torch.tensor(BEHAV))
    assert loss.item() == pytest.approx((-w0 * s0 * 1.0 + 1.2 * s1 * 0.5) / 2, rel=1e-5)
    assert stats["is_weight_sum"].item() == pytest.approx(2 * w0 + 3 * 1.2, rel=1e-5)


def test_summarize_is_weight_metrics() -> None:
    loss_fn = GRPOLoss(
        aggregation="token_mean", off_policy_correction="decoupled", is_weight_cap=CAP
    )
    logp, old, adv, mask, _ = _tensors()
    behav = torch.tensor(BEHAV)
    # Two micro-batches (one sequence each) summarise like the whole batch.
    stats = [
        loss_fn(
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            normalizer=5,
            behavior_logprobs=behav[rows],
        )[1]
        for rows in (slice(0, 1), slice(1, 2))
    ]
    summary = summarize_loss_stats(stats)
    applied = APPLIED_W[("decoupled", CAP)]
    assert summary["is_weight/mean"] == pytest.approx(sum(map(sum, applied)) / 5, rel=1e-5)
    assert summary["is_weight/max"] == pytest.approx(exp(1.0), rel=1e-5)
    assert summary["is_weight/dropped_fraction"] == pytest.approx(1 / 5)
    # Across two identical ranks: sums double (the means do not change), the max stays.
    ranks = summarize_loss_stats(stats, all_reduce=lambda t, op: t * 2 if op == "sum" else t)
    for k in ("is_weight/mean", "is_weight/max", "is_weight/dropped_fraction"):
        assert ranks[k] == pytest.approx(summary[k], rel=1e-6)
    # tis truncates instead of dropping; "none" reports weight 1 on every token.
    _, tis = GRPOLoss(off_policy_correction="tis", is_weight_cap=CAP)(
        logp, old, adv, mask, normalizer=5, behavior_logprobs=behav
    )
    s_tis = summarize_loss_stats([tis])
    assert s_tis["is_weight/mean"] == pytest.approx(
        sum(map(sum, APPLIED_W[("tis", CAP)])) / 5, rel=1e-5
    )
    assert s_tis["is_weight/max"] == pytest.approx(exp(1.0), rel=1e-5)
    assert s_tis["is_weight/dropped_fraction"] == 0.0
    _, plain = GRPOLoss()(logp, old, adv, mask, normalizer=5, behavior_logprobs=behav)
    s_none = summarize_loss_stats([plain])
    assert s_none["is_weight/mean"] == 1.0 and s_none["is_weight/max"] == 1.0
    assert s_none["is_weight/dropped_fraction"] == 0.0


def test_decoupled_micro_batch_invariance() -> None:
    data = _policy_batch()
    loss_fn = GRPOLoss(
        aggregation="token_mean",
        kl_coeff=0.05,
        off_policy_correction="decoupled",
        is_weight_cap=1.5,
    )
    _, whole_stats, whole = _run_loss(loss_fn, data, behavior_logprobs=data["behav"])
    assert whole_stats["is_dropped_sum"].item() > 0  # the cap is active on this batch
    model = data["model"]
    model.zero_grad()
    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]
    norm = sum(loss_fn.normalizer_contribution(data["mask"][p]) for p in parts)
    stats = []
    for p in parts:
        loss, st = _off_policy_micro_loss(
            loss_fn, data, p, norm, behavior_logprobs=data["behav"][p]
        )
        loss.backward()
        stats.append(st)
    _assert_grads_close(_grads(model), whole)
    s_split, s_whole = summarize_loss_stats(stats), summarize_loss_stats([whole_stats])
    for k in s_whole:
        assert s_split[k] == pytest.approx(s_whole[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"off_policy_correction": "is"}, "off_policy_correction"),
        ({"off_policy_correction": "decoupled", "is_weight_cap": 1.0}, "is_weight_cap"),
        ({"off_policy_correction": "decoupled", "is_weight_cap": 0.5}, "is_weight_cap"),
        ({"off_policy_correction": "tis", "is_weight_cap": float("inf")}, "is_weight_cap"),
        ({"off_policy_correction": "tis", "is_weight_cap": "big"}, "is_weight_cap"),
        ({"off_policy_correction": "tis"}, "is_weight_cap"),
        ({"is_weight_cap": 2.0}, "is_weight_cap"),
        ({"off_policy_correction": "none", "is_weight_cap": 2.0}, "is_weight_cap"),
    ],
)
def test_off_policy_constructor_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_off_policy_forward_validation() -> None:
    logp, old, adv, mask, _ = _tensors()
    for loss_fn in (
        GRPOLoss(off_policy_correction="decoupled"),
        GRPOLoss(off_policy_correction="tis", is_weight_cap=2.0),
    ):
        assert loss_fn.needs_proximal_logprobs
        with pytest.raises(ValueError, match="behavior_logprobs is required"):
            loss_fn(logp, old, adv, mask, normalizer=5)
        with pytest.raises(ValueError, match="behavior_logprobs must have the shape"):
            loss_fn(logp, old, adv, mask, normalizer=5, behavior_logprobs=old[:, :2])
    assert "off_policy_correction=tis, is_weight_cap=2.0" in repr(
        GRPOLoss(off_policy_correction="tis", is_weight_cap=2.0)
    )
