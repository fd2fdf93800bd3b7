"""Tests for torchtune_grpo.rlhf.loss.GRPOLoss and summarize_loss_stats.

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

from torchtune_grpo.distributed import all_reduce
from torchtune_grpo.rlhf.logprobs import chunked_token_logprobs
from torchtune_grpo.rlhf.loss import (
    GRPOLoss,
    summarize_loss_stats,
)

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
            norm = all_reduce(local.clone(), "sum")
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
                "summary": summarize_loss_stats(stats, all_reduce=all_reduce),
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
