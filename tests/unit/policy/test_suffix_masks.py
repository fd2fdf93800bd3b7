"""Shared-prompt attention takes every response's mask as a view of one tensor built with the
layout (:func:`~torchtune_grpo.policy.packing.suffix_masks`), and computes exactly what a mask
built per response computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtune_grpo.policy.packing import (
    SharedPrefixSegments,
    install_packed_attention,
    shared_prompt_layout,
    suffix_masks,
)

BLOCKS = ((5, (3, 9, 1)), (11, (7,)), (2, (4, 2)))


def _per_response_attention(q, k, v, blocks):
    """The reference: a contiguous ``[L, p + L]`` mask built for every response."""
    sizes = [n for prefix, suffixes in blocks for n in (prefix, *suffixes)]
    parts = list(zip(*(x.split(sizes, dim=2) for x in (q, k, v))))
    outs, i = [], 0
    for prefix, suffixes in blocks:
        q_p, k_p, v_p = parts[i]
        outs.append(F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True))
        for j, length in enumerate(suffixes, start=i + 1):
            q_s, k_s, v_s = parts[j]
            mask = torch.ones(length, prefix + length, dtype=torch.bool).tril(diagonal=prefix)
            outs.append(F.scaled_dot_product_attention(
                q_s, torch.cat([k_p, k_s], dim=2), torch.cat([v_p, v_s], dim=2), attn_mask=mask))
        i += 1 + len(suffixes)
    return torch.cat(outs, dim=2)


def test_each_view_is_the_response_mask():
    masks = suffix_masks(BLOCKS, "cpu")
    max_prefix = 11
    assert masks.shape == (9, 11 + 9) and masks.dtype == torch.bool
    for prefix, suffixes in BLOCKS:
        for length in suffixes:
            view = masks[:length, max_prefix - prefix: max_prefix + length]
            want = torch.ones(length, prefix + length, dtype=torch.bool).tril(diagonal=prefix)
            assert torch.equal(view, want), (prefix, length)
    assert suffix_masks(((4, ()),), "cpu").shape == (0, 4)  # a block with no response


def test_outputs_and_gradients_equal_per_response_masks_bitwise():
    """CPU float32: SDPA on the (non-contiguous) views gives the same bits as on contiguous
    masks built per response, forward and backward; with or without the layout's tensor."""
    attn = torch.nn.Module()
    attn._attention_call = lambda *a, **k: None  # stands in for torchtune's; never reached
    install_packed_attention(attn)
    total = sum(n for p, sufs in BLOCKS for n in (p, *sufs))
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, total, 8, generator=gen) for _ in range(3)]
    results = []
    for segments in (None, SharedPrefixSegments(BLOCKS),
                     SharedPrefixSegments(BLOCKS, suffix_masks(BLOCKS, "cpu"))):
        q, k, v = (x.clone().requires_grad_() for x in qkv)
        if segments is None:
            out = _per_response_attention(q, k, v, BLOCKS)
        else:
            out = attn._attention_call(q, k, v, mask=segments, dropout_p=0.0, is_causal=False)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert torch.equal(a, b)


def test_the_layout_builds_the_masks_on_the_tokens_device():
    tokens = torch.tensor([[0, 7, 8, 5, 6, 0], [0, 7, 8, 9, 0, 0], [3, 4, 5, 1, 2, 3]])
    p_mask = tokens[:, :3] != 0
    present = tokens[:, 3:] != 0
    _, _, segments = shared_prompt_layout(tokens, p_mask, present)
    assert segments == SharedPrefixSegments(((2, (2, 1)), (3, (3,))))
    assert segments.suffix_masks.device == tokens.device
    assert torch.equal(segments.suffix_masks, suffix_masks(segments.blocks, "cpu"))
