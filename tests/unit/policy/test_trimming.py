"""Tests for trimming micro-batches to their own extent (``trim_to_extent``,
``micro_batch_logprobs``) and for packing their real tokens into one row
(``packed_micro_batch_logprobs``): the model runs on fewer positions and computes the same
thing."""

from __future__ import annotations

import pytest
import torch

from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.trajectory import prompt_mask
from torchtune_grpo.policy.forward import (
    micro_batch_logprobs,
    packed_micro_batch_logprobs,
)
from torchtune_grpo.policy.packing import PackedSegments
from torchtune_grpo.policy.positions import attention_mask, position_ids, trim_to_extent
from torchtune_grpo.quickstart.tiny import tiny_llama

PAD = 0
N, P, T, MB = 12, 20, 24, 4  # rows, padded prompt and response lengths, micro-batch size


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors gain nothing from intra-op threads on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _batch(prompt_lengths: list[int], response_lengths: list[int], prompt_len: int = P,
           response_len: int = T, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(tokens [n, P + T], prompt_mask [n, P], response_mask [n, T])`` with left-padded
    prompts and right-padded responses of the given lengths (real ids in 1..299)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(prompt_lengths)
    p_mask = prompt_mask(torch.zeros(n, prompt_len, dtype=torch.long),
                         torch.tensor(prompt_lengths))
    r_mask = torch.arange(response_len)[None, :] < torch.tensor(response_lengths)[:, None]
    mask = torch.cat([p_mask, r_mask], dim=1)
    tokens = torch.randint(1, 300, mask.shape, generator=gen)
    return torch.where(mask, tokens, PAD), p_mask, r_mask


def test_trim_drops_all_padding_columns_and_keeps_positions_and_mask() -> None:
    tokens, p_mask, r_mask = _batch([3, 7, 5], [2, 9, 4])
    trimmed = trim_to_extent(tokens, p_mask, r_mask)
    assert (trimmed.prompt_len, trimmed.response_len) == (7, 9)
    start, stop = P - 7, P + 9
    assert trimmed.tokens.shape == trimmed.padding_mask.shape == (3, 16)
    torch.testing.assert_close(trimmed.tokens, tokens[:, start:stop], rtol=0, atol=0)
    full = torch.cat([p_mask, r_mask], dim=1)
    # Every dropped column is padding in every row; no real token is lost.
    assert not full[:, :start].any() and not full[:, stop:].any()
    assert trimmed.padding_mask.sum() == full.sum()
    # Positions and the attention mask of the kept columns are those of the untrimmed rows.
    torch.testing.assert_close(position_ids(trimmed.padding_mask),
                               position_ids(full)[:, start:stop], rtol=0, atol=0)
    assert torch.equal(attention_mask(trimmed.padding_mask),
                       attention_mask(full)[:, start:stop, start:stop])


def test_trim_edge_cases() -> None:
    # Full rows: nothing to drop.
    tokens, p_mask, r_mask = _batch([P, 4], [3, T])
    trimmed = trim_to_extent(tokens, p_mask, r_mask)
    assert (trimmed.prompt_len, trimmed.response_len) == (P, T)
    assert torch.equal(trimmed.tokens, tokens)
    # No response token at all: one response (and one prompt) column is still kept.
    tokens, p_mask, r_mask = _batch([0, 0], [0, 0])
    trimmed = trim_to_extent(tokens, p_mask, r_mask)
    assert (trimmed.prompt_len, trimmed.response_len) == (1, 1)
    assert trimmed.tokens.shape == (2, 2)
    with pytest.raises(ValueError, match="columns"):
        trim_to_extent(tokens[:, 1:], p_mask, r_mask)


def _workload() -> tuple[torch.Tensor, ...]:
    """Rows of varied prompt and response lengths; micro-batches of ``MB`` rows."""
    prompt_lengths = [3, 9, 6, 4,  12, 20, 15, 8,  5, 11, 2, 7]
    response_lengths = [5, 2, 8, 1,  24, 10, 3, 17,  12, 6, 9, 4]
    return _batch(prompt_lengths, response_lengths, seed=1)


def _update(model: torch.nn.Module, trim: bool, order: torch.Tensor, pack: bool = False,
            tool_mask: torch.Tensor | None = None):
    """The update's inner loop: per micro-batch, log-probs, GRPOLoss over a global
    normaliser, backward. Returns ``(logprobs [N, T], summed loss, {name: grad})``."""
    tokens, p_mask, r_mask = _workload()
    if tool_mask is not None:  # tool tokens are real tokens, not actions
        r_mask = r_mask & ~tool_mask
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(N, T, generator=gen) * 0.1 - 5.0
    ref = torch.randn(N, T, generator=gen) * 0.1 - 5.0
    advantages = torch.randn(N, generator=gen)
    loss_fn = GRPOLoss(kl_coeff=0.05, entropy_coeff=0.01, aggregation="token_mean")
    normalizer = loss_fn.normalizer_contribution(r_mask).float()
    model.zero_grad(set_to_none=True)
    all_logprobs = torch.zeros(N, T)
    total = 0.0
    for i in range(0, N, MB):
        idx = order[i : i + MB]
        logprobs, entropy = micro_batch_logprobs(
            model, tokens[idx], p_mask[idx], r_mask[idx], trim=trim, pack=pack,
            tool_mask=None if tool_mask is None else tool_mask[idx], temperature=0.7,
            chunk_size=7, return_entropy=True, entropy_grad=True,
        )
        assert logprobs.shape == entropy.shape == (MB, T)
        loss, _ = loss_fn(logprobs, old[idx], advantages[idx], r_mask[idx],
                          normalizer=normalizer, ref_logprobs=ref[idx], entropy=entropy)
        loss.backward()
        total += float(loss.detach())
        all_logprobs[idx] = logprobs.detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return all_logprobs, total, grads


def test_trimmed_update_equals_untrimmed() -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    tokens, p_mask, r_mask = _workload()
    # Non-degenerate: lengths differ within micro-batches and they do get narrower.
    widths = []
    for i in range(0, N, MB):
        idx = order[i : i + MB]
        assert len(set(p_mask[idx].sum(1).tolist())) > 1
        assert len(set(r_mask[idx].sum(1).tolist())) > 1
        trimmed = trim_to_extent(tokens[idx], p_mask[idx], r_mask[idx])
        widths.append((trimmed.prompt_len, trimmed.response_len))
    assert any(p < P for p, _ in widths) and any(t < T for _, t in widths)
    assert sum(p + t for p, t in widths) < 0.8 * (N // MB) * (P + T)

    lp_trim, loss_trim, grads_trim = _update(model, True, order)
    lp_full, loss_full, grads_full = _update(model, False, order)
    # Past a micro-batch's extent the trimmed log-probs are 0; on response tokens they match.
    assert (lp_trim[~r_mask] == 0).sum() > 0
    torch.testing.assert_close(lp_trim[r_mask], lp_full[r_mask], rtol=1e-5, atol=1e-5)
    assert loss_full != 0.0
    assert abs(loss_trim - loss_full) <= 1e-5 * abs(loss_full)
    assert grads_trim.keys() == grads_full.keys()
    for name, full in grads_full.items():
        assert full.abs().max() > 0, name
        torch.testing.assert_close(grads_trim[name], full, rtol=1e-5,
                                   atol=1e-5 * full.abs().max().item(), msg=name)


def test_trimmed_logprobs_match_on_kept_columns() -> None:
    """Within a micro-batch's extent every column (padding included) is computed as before."""
    torch.manual_seed(0)
    model = tiny_llama()
    tokens, p_mask, r_mask = _workload()
    with torch.no_grad():
        for i in range(0, N, MB):
            rows = slice(i, i + MB)
            kept = trim_to_extent(tokens[rows], p_mask[rows], r_mask[rows]).response_len
            trim, _ = micro_batch_logprobs(model, tokens[rows], p_mask[rows], r_mask[rows])
            full, _ = micro_batch_logprobs(model, tokens[rows], p_mask[rows], r_mask[rows],
                                           trim=False)
            torch.testing.assert_close(trim[:, :kept], full[:, :kept], rtol=1e-5, atol=1e-5)
            assert (trim[:, kept:] == 0).all()


class _Spy(torch.nn.Module):
    """Wraps a decoder and records the ``input_pos`` and ``mask`` it is called with."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens, *, mask, input_pos, output=None):
        self.calls.append((input_pos.clone(), mask.clone()))
        return self.decoder(tokens, mask=mask, input_pos=input_pos, output=output)


def test_model_sees_untrimmed_positions_and_mask() -> None:
    """The trimmed call passes the model exactly the kept block of the untrimmed position ids
    and attention mask (RoPE only sees position differences, so a per-row shift of the
    positions would not change the log-probs: check the inputs themselves)."""
    torch.manual_seed(0)
    spy = _Spy(tiny_llama())
    tokens, p_mask, r_mask = _batch([3, 9, 6, 4], [5, 2, 8, 1])
    with torch.no_grad():
        micro_batch_logprobs(spy, tokens, p_mask, r_mask)
        micro_batch_logprobs(spy, tokens, p_mask, r_mask, trim=False)
    (pos_trim, mask_trim), (pos_full, mask_full) = spy.calls
    start, stop = P - 9, P + 8 - 1  # the model never sees the last kept column
    assert pos_trim.shape == (4, stop - start) and pos_full.shape == (4, P + T - 1)
    assert torch.equal(pos_trim, pos_full[:, start:stop])
    assert torch.equal(mask_trim, mask_full[:, start:stop, start:stop])


def _assert_same_update(a, b, r_mask) -> None:
    (lp_a, loss_a, grads_a), (lp_b, loss_b, grads_b) = a, b
    torch.testing.assert_close(lp_a[r_mask], lp_b[r_mask], rtol=1e-5, atol=1e-5)
    assert loss_b != 0.0
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name, ref in grads_b.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads_a[name], ref, rtol=1e-5,
                                   atol=1e-5 * ref.abs().max().item(), msg=name)


def test_packed_update_equals_untrimmed() -> None:
    """Packed micro-batches: same log-probs, loss and every gradient as the padded rectangle,
    with the model run on the real tokens only."""
    torch.manual_seed(0)
    model = tiny_llama()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    _, p_mask, r_mask = _workload()
    packed = _update(model, True, order, pack=True)
    full = _update(model, False, order)
    # packed log-probs are exactly 0 off the response tokens; the test is not degenerate
    assert (packed[0][~r_mask] == 0).all() and (packed[0][r_mask] < 0).float().mean() > 0.9
    _assert_same_update(packed, full, r_mask)


def test_packed_update_with_tool_tokens_equals_untrimmed() -> None:
    """Tool-result tokens inside responses: attended by later tokens, no log-prob, no loss,
    in the packed row as in the rectangle."""
    torch.manual_seed(0)
    model = tiny_llama()
    order = torch.arange(N)
    _, _, r_mask = _workload()
    tool = torch.zeros_like(r_mask)
    tool[4, 10:14] = tool[7, 3:6] = tool[8, 2:5] = True  # inside those rows' responses
    assert (r_mask & tool).sum() == tool.sum()
    packed = _update(model, True, order, pack=True, tool_mask=tool)
    full = _update(model, False, order, tool_mask=tool)
    scored = r_mask & ~tool
    assert (packed[0][tool] == 0).all()
    _assert_same_update(packed, full, scored)
    # the tool tokens are context: changing them changes the later log-probs of their row
    tokens, p_mask, _ = _workload()
    changed = tokens.clone()
    changed[4, P + 10 : P + 14] = (changed[4, P + 10 : P + 14] + 1) % 300 + 1
    with torch.no_grad():
        a, _ = packed_micro_batch_logprobs(model, tokens[4:5], p_mask[4:5], scored[4:5],
                                           tool_mask=tool[4:5])
        b, _ = packed_micro_batch_logprobs(model, changed[4:5], p_mask[4:5], scored[4:5],
                                           tool_mask=tool[4:5])
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 14:24], b[:, 14:24])


class _PackSpy(torch.nn.Module):
    """Wraps a decoder and records the tokens, ``input_pos`` and ``mask`` it is called with."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.calls: list = []

    def forward(self, tokens, *, mask, input_pos, output=None):
        self.calls.append((tokens.clone(), input_pos.clone(), mask))
        return self.decoder(tokens, mask=mask, input_pos=input_pos, output=output)


def test_packed_model_sees_real_tokens_only() -> None:
    """One row of exactly the real tokens, positions restarting per row, one segment each."""
    torch.manual_seed(0)
    spy = _PackSpy(tiny_llama())
    # the packed row (33 tokens) is longer than the decoder's max_seq_len; each row is not
    spy.decoder.max_seq_len = 16
    tokens, p_mask, r_mask = _batch([3, 9, 6, 0], [5, 2, 8, 0])  # the last row is empty
    with torch.no_grad():
        packed_micro_batch_logprobs(spy, tokens, p_mask, r_mask)
    assert spy.decoder.max_seq_len == 16
    ((seen, pos, mask),) = spy.calls
    assert mask == PackedSegments((8, 11, 14))
    present = torch.cat([p_mask, r_mask], dim=1)
    assert torch.equal(seen[0], tokens[present])
    assert torch.equal(pos[0], torch.cat([torch.arange(n) for n in (8, 11, 14)]))


def test_packed_attention_keeps_rows_apart() -> None:
    """A row's log-probs do not depend on the rows packed before or after it."""
    torch.manual_seed(0)
    model = tiny_llama()
    tokens, p_mask, r_mask = _batch([3, 9, 6], [5, 2, 8])
    with torch.no_grad():
        together, _ = packed_micro_batch_logprobs(model, tokens, p_mask, r_mask)
        alone = torch.cat([packed_micro_batch_logprobs(model, tokens[i:i + 1], p_mask[i:i + 1],
                                                       r_mask[i:i + 1])[0] for i in range(3)])
        other = tokens.clone()
        other[0, P:P + 5] = (other[0, P:P + 5] + 7) % 300 + 1  # row 0's response changes
        changed, _ = packed_micro_batch_logprobs(model, other, p_mask, r_mask)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed[0], together[0])
    torch.testing.assert_close(changed[1:], together[1:], rtol=1e-5, atol=1e-5)


def test_padding_benchmark_runs_and_checks_equality(tmp_path) -> None:
    """``benchmarks.padding --quick``: the three variants agree and are timed."""
    import json

    from benchmarks import padding

    out = tmp_path / "padding.json"
    assert padding.main(["--quick", "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median_seconds"]) == {"untrimmed", "trimmed", "packed"}
    # the benchmark's own rounding bound: another reduction order in attention and the matmuls
    # (AVX-512 kernels differ from AVX2 ones by ~2e-5 here); a real mismatch is orders larger
    assert 0 < result["loss_rel_diff"] <= 1e-5
    assert 0 < result["grad_max_rel_diff"] <= padding.GRAD_TOLERANCE
    assert result["real_token_fraction"] < 0.7


def test_policy_forwards_leave_no_mode_on_the_model() -> None:
    """``last_logits`` and ``micro_batch_logprobs`` say what they return; before, between and
    after them (and after one that raised) ``model(...)`` returns torchtune's full logits."""
    from torchtune_grpo.policy.forward import last_logits

    torch.manual_seed(0)
    model = tiny_llama(vocab_size=300, max_seq_len=64).eval()
    tokens, p_mask, r_mask = _batch([3, 7, 5], [2, 9, 4])
    padding = torch.cat([p_mask, r_mask], dim=1)
    kwargs = dict(mask=attention_mask(padding), input_pos=position_ids(padding))
    with torch.no_grad():
        full = model(tokens, **kwargs)  # [n, P + T, V]
        last = last_logits(model, tokens, **kwargs)
        logprobs, _ = micro_batch_logprobs(model, tokens, p_mask, r_mask)
        with pytest.raises(RuntimeError):
            last_logits(model, tokens[:, :5], **kwargs)  # the mask does not fit the tokens
        again = model(tokens, **kwargs)
    assert full.shape == (3, P + T, 300) and last.shape == (3, 1, 300)
    assert logprobs.shape == (3, T)
    torch.testing.assert_close(last[:, 0], full[:, -1].float())
    torch.testing.assert_close(again, full, rtol=0, atol=0)
