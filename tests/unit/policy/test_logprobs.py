"""Tests for torchtune_grpo.policy.logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchtune.modules import TiedLinear

from torchtune_grpo.policy.logprobs import chunked_token_logprobs, naive_token_logprobs

N, T, D, V = 3, 7, 16, 40


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine spinning
    OpenMP threads stall for seconds; run these tests single-threaded and restore afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _setup(seed: int = 0, forbid: bool = False) -> tuple[nn.Linear, torch.Tensor, ...]:
    torch.manual_seed(seed)
    head = nn.Linear(D, V, bias=False)
    hidden = torch.randn(N, T, D, requires_grad=True)
    bias = None
    if forbid:
        bias = torch.zeros(V)
        bias[30:] = float("-inf")  # ids 30..39 are forbidden
        targets = torch.randint(0, 30, (N, T))
    else:
        targets = torch.randint(0, V, (N, T))
    weights = torch.randn(N, T)  # makes the upstream gradient non-uniform
    return head, hidden, targets, bias, weights


def _grads_of(out: tuple, weights: torch.Tensor, head: nn.Linear, hidden: torch.Tensor) -> tuple:
    logp, ent = out
    objective = (logp * weights).sum()
    if ent is not None:
        objective = objective + (ent * weights.flip(0)).sum()
    gh, gw = torch.autograd.grad(objective, (hidden, head.weight))
    return gh, gw


@pytest.mark.parametrize("chunk_size", [1, 5, 21, 1024])
@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("forbid", [False, True])
def test_chunked_matches_naive_values_and_grads(
    chunk_size: int, checkpoint: bool, forbid: bool
) -> None:
    head, hidden, targets, bias, weights = _setup(forbid=forbid)
    chunked = chunked_token_logprobs(
        hidden,
        head,
        targets,
        temperature=0.7,
        logit_bias=bias,
        chunk_size=chunk_size,
        checkpoint=checkpoint,
        return_entropy=True,
    )
    naive = naive_token_logprobs(head(hidden), targets, 0.7, bias, True)
    for a, b in zip(chunked, naive):
        assert a.shape == (N, T) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        _grads_of(chunked, weights, head, hidden), _grads_of(naive, weights, head, hidden)
    ):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_naive_matches_textbook_formula() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    logp, ent = naive_token_logprobs(logits, targets, temperature=2.0, return_entropy=True)
    for i in range(2):
        for t in range(3):
            z = [v / 2.0 for v in logits[i, t].tolist()]
            lse = math.log(sum(math.exp(v) for v in z))
            assert logp[i, t].item() == pytest.approx(z[targets[i, t]] - lse, rel=1e-5)
            h = -sum(math.exp(v - lse) * (v - lse) for v in z)
            assert ent[i, t].item() == pytest.approx(h, rel=1e-5)


def test_forbidden_ids_no_nan_and_entropy_over_allowed_ids() -> None:
    head, hidden, targets, bias, weights = _setup(forbid=True)
    logp, ent = chunked_token_logprobs(
        hidden, head, targets, logit_bias=bias, chunk_size=4, return_entropy=True
    )
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    # Same as a softmax restricted to the 30 allowed ids.
    allowed_logits = head(hidden)[..., :30]
    ref_logp = torch.log_softmax(allowed_logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = torch.distributions.Categorical(logits=allowed_logits).entropy()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    gh, gw = _grads_of((logp, ent), weights, head, hidden)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert gw[30:].abs().sum() == 0  # forbidden ids have p = 0: no gradient to their rows


def test_entropy_gradient_with_underflowing_probabilities() -> None:
    # Logits so spread that many probabilities underflow to exactly 0 in float32.
    head = nn.Linear(2, 6, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[500.0, 0], [0, 0], [-500, 0], [0, 1], [0, -1], [1, 1]]))
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], requires_grad=True)
    bias = torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0, 0.0])
    logp, ent = chunked_token_logprobs(
        hidden, head, torch.tensor([[0, 3]]), logit_bias=bias, return_entropy=True
    )
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.weight.grad).all()


def test_tied_linear_projection_and_bf16_hidden() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(V, D)
    tied = TiedLinear(embed)
    hidden = torch.randn(N, T, D, requires_grad=True)
    targets = torch.randint(0, V, (N, T))
    logp, ent = chunked_token_logprobs(hidden, tied, targets, chunk_size=4)
    assert ent is None
    logp.sum().backward()
    assert embed.weight.grad is not None and embed.weight.grad.abs().sum() > 0
    ref, _ = naive_token_logprobs(hidden @ embed.weight.T, targets)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-6)
    # Low-precision hidden states: the output is float32 all the same.
    lp16, _ = chunked_token_logprobs(
        hidden.detach().bfloat16(), lambda h: h @ embed.weight.detach().bfloat16().T, targets
    )
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, ref.detach(), rtol=0.05, atol=0.1)


def test_no_grad_and_empty_inputs() -> None:
    head, hidden, targets, _, _ = _setup()
    with torch.no_grad():
        logp, _ = chunked_token_logprobs(hidden, head, targets, chunk_size=3)
    assert not logp.requires_grad and logp.shape == (N, T)
    empty, ent = chunked_token_logprobs(
        torch.zeros(2, 0, D), head, torch.zeros(2, 0, dtype=torch.long), return_entropy=True
    )
    assert empty.shape == (2, 0) and ent is not None and ent.shape == (2, 0)


@pytest.mark.parametrize("fused", [True, False])
def test_checkpoint_saves_no_logits_for_backward(fused: bool) -> None:
    # The tensors autograd keeps for the backward pass (outside checkpointed regions): with
    # checkpointing (fused or not) none is a block of logits; the weight itself is allowed.
    head, hidden, targets, _, _ = _setup()

    def saved_logit_blocks(checkpoint: bool) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() != head.weight.data_ptr() and V in t.shape:
                shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunked_token_logprobs(hidden, head, targets, chunk_size=4, checkpoint=checkpoint,
                                   fused=fused)
        return shapes

    assert saved_logit_blocks(False)  # the plain path keeps [chunk, V] blocks
    assert saved_logit_blocks(True) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"logit_bias": torch.zeros(2, V)}, "logit_bias"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    head, hidden, targets, _, _ = _setup()
    with pytest.raises(ValueError, match=match):
        chunked_token_logprobs(hidden, head, targets, **kwargs)


def test_validation_targets() -> None:
    head, hidden, targets, _, _ = _setup()
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(hidden, head, targets[:, :3])
    bad = targets.clone()
    bad[0, 0] = -100
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(hidden, head, bad)
    with pytest.raises(ValueError, match="targets"):
        naive_token_logprobs(head(hidden), targets.float())
    with pytest.raises(ValueError, match="temperature"):
        naive_token_logprobs(head(hidden), targets, temperature=-1.0)


def test_metric_only_entropy_matches_and_carries_no_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    proj = torch.nn.Linear(8, 30, bias=False)
    targets = torch.randint(0, 30, (2, 5))
    bias = torch.zeros(30)
    bias[25:] = float("-inf")
    lp1, ent1 = chunked_token_logprobs(hidden, proj, targets, logit_bias=bias, chunk_size=3,
                                       return_entropy=True, entropy_grad=True)
    lp2, ent2 = chunked_token_logprobs(hidden, proj, targets, logit_bias=bias, chunk_size=3,
                                       return_entropy=True, entropy_grad=False)
    torch.testing.assert_close(ent2, ent1.detach())
    assert not ent2.requires_grad
    g1 = torch.autograd.grad(lp1.sum(), hidden)[0]
    g2 = torch.autograd.grad(lp2.sum(), hidden)[0]
    torch.testing.assert_close(g1, g2)


def test_auto_chunk_size_bounds_the_logits_block():
    from torchtune_grpo.policy.logprobs import CHUNK_LOGITS_BUDGET, auto_chunk_size

    assert auto_chunk_size(128256) == 256
    assert auto_chunk_size(151936) == 208
    assert auto_chunk_size(2048) == 16384
    assert auto_chunk_size(10**9) == 16  # never below 16 positions
    for vocab in (320, 32000, 128256, 151936, 262144):
        chunk = auto_chunk_size(vocab)
        assert chunk % 16 == 0 and chunk * vocab <= max(CHUNK_LOGITS_BUDGET, 16 * vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        auto_chunk_size(0)


@pytest.mark.parametrize("chunk_size", [1, 5, 21, 1024])
@pytest.mark.parametrize("forbid", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("keep_positions", [0, 10, N * T])
def test_fused_path_matches_naive_values_and_grads(chunk_size, forbid, entropy, keep_positions,
                                                   monkeypatch):
    """The fused autograd function (plain linear head, metric-only entropy) against full logits:
    log-probs, entropies, and the gradients of hidden states and weight; with none, some (the
    whole chunks within 10 positions) or all of the softmax blocks kept for the backward."""
    from torchtune_grpo.policy import logprobs as lp

    calls = []
    original = lp._FusedLinearLogProbs.apply
    monkeypatch.setattr(lp._FusedLinearLogProbs, "apply",
                        lambda *a: calls.append(1) or original(*a))
    head, hidden, targets, bias, weights = _setup(forbid=forbid)
    fused = chunked_token_logprobs(hidden, head, targets, temperature=0.7, logit_bias=bias,
                                   chunk_size=chunk_size, return_entropy=entropy,
                                   entropy_grad=False, keep_probs=keep_positions * V)
    assert calls, "the fused path was not taken"
    naive = naive_token_logprobs(head(hidden), targets, 0.7, bias, entropy)
    torch.testing.assert_close(fused[0], naive[0], rtol=1e-5, atol=1e-6)
    if entropy:
        assert not fused[1].requires_grad
        torch.testing.assert_close(fused[1], naive[1].detach(), rtol=1e-5, atol=1e-5)
    else:
        assert fused[1] is None
    got = torch.autograd.grad((fused[0] * weights).sum(), (hidden, head.weight))
    want = torch.autograd.grad((naive[0] * weights).sum(), (hidden, head.weight))
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_fused_path_forbidden_target_and_tied_bf16_weights():
    """A forbidden target gets -inf (as without fusion); a tied bf16 head keeps float32
    outputs and bf16 gradients close to the float32 reference."""
    torch.manual_seed(1)
    embed = nn.Embedding(V, D)
    hidden = torch.randn(N, T, D)
    targets = torch.randint(0, V, (N, T))
    bias = torch.zeros(V)
    bias[targets[0, 0]] = float("-inf")
    logp, _ = chunked_token_logprobs(hidden, TiedLinear(embed), targets, logit_bias=bias)
    assert logp[0, 0] == float("-inf") and torch.isfinite(logp.flatten()[1:]).all()

    embed16 = nn.Embedding(V, D).bfloat16()
    embed16.weight.data.copy_(embed.weight.data)
    h16 = hidden.bfloat16().requires_grad_(True)
    lp16, ent16 = chunked_token_logprobs(h16, TiedLinear(embed16), targets, chunk_size=4,
                                         return_entropy=True, entropy_grad=False)
    assert lp16.dtype == torch.float32 and ent16.dtype == torch.float32
    lp16.sum().backward()
    assert embed16.weight.grad.dtype == torch.bfloat16 and h16.grad.dtype == torch.bfloat16
    h32 = hidden.bfloat16().float().requires_grad_(True)
    ref, _ = naive_token_logprobs(h32 @ embed16.weight.detach().float().T, targets)
    ref.sum().backward()
    torch.testing.assert_close(lp16, ref.detach(), rtol=0.02, atol=0.05)
    torch.testing.assert_close(h16.grad.float(), h32.grad, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("keep_positions, chunk_size, recomputed", [
    (0, 5, 5),  # 21 positions in 5 chunks: every chunk recomputed in the backward
    (10, 5, 3),  # the first two whole chunks (10 positions) kept
    (12, 5, 3),  # a partial chunk is never kept
    (N * T, 5, 0),  # everything kept
    (N * T, 1024, 0),  # one chunk of all 21 positions
])
def test_kept_softmax_blocks_skip_the_recompute(keep_positions, chunk_size, recomputed,
                                                monkeypatch):
    """``keep_probs`` saves the backward's recomputation of exactly the kept chunks, and the
    gradients stay those of the full recompute."""
    from torchtune_grpo.policy import logprobs as lp

    head, hidden, targets, bias, weights = _setup(forbid=True)
    want = torch.autograd.grad((chunked_token_logprobs(
        hidden, head, targets, logit_bias=bias, chunk_size=chunk_size)[0] * weights).sum(),
        (hidden, head.weight))
    calls = []
    original = lp._chunk_scores
    monkeypatch.setattr(lp, "_chunk_scores", lambda *a: calls.append(1) or original(*a))
    logp, _ = chunked_token_logprobs(hidden, head, targets, logit_bias=bias,
                                     chunk_size=chunk_size, keep_probs=keep_positions * V)
    forward_calls = len(calls)
    assert forward_calls == -(-N * T // chunk_size)
    got = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight), retain_graph=True)
    assert len(calls) - forward_calls == recomputed
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a second backward (retain_graph) no longer has the kept blocks: it recomputes them all
    again = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight))
    for a, b in zip(again, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kept_softmax_blocks_only_with_gradients_and_validated(monkeypatch):
    """Without gradients nothing is kept (no memory held for a backward that never comes);
    bf16 hidden states keep float32 blocks with the same gradients; bad budgets are rejected."""
    from torchtune_grpo.policy import logprobs as lp

    head, hidden, targets, _, weights = _setup()
    seen = []
    original = lp._FusedLinearLogProbs.forward
    monkeypatch.setattr(lp._FusedLinearLogProbs, "forward", staticmethod(
        lambda ctx, *a: seen.append(a[-1]) or original(ctx, *a)))
    with torch.no_grad():
        chunked_token_logprobs(hidden, head, targets, keep_probs=10**9)
    chunked_token_logprobs(hidden.detach(), head.requires_grad_(False), targets, keep_probs=10**9)
    head.requires_grad_(True)
    assert seen == [0, 0]
    h16 = hidden.detach().bfloat16().requires_grad_(True)
    head16 = nn.Linear(D, V, bias=False).bfloat16()
    grads = []
    for keep in (0, 10**9):
        logp, _ = chunked_token_logprobs(h16, head16, targets, chunk_size=4, keep_probs=keep)
        grads.append(torch.autograd.grad((logp * weights).sum(), (h16, head16.weight)))
    assert seen[-2:] == [0, 10**9]
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.01, atol=0.01)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep_probs"):
            chunked_token_logprobs(hidden, head, targets, keep_probs=bad)
