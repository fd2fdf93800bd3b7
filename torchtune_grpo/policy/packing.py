"""Sequence packing for training-time forwards: several sequences in one row, with attention
"masks" that say where each sequence (or shared prompt) starts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PackedSegments",
    "SharedPrefixSegments",
    "install_packed_attention",
    "shared_prompt_layout",
    "suffix_masks",
]


@dataclass(frozen=True)
class PackedSegments:
    """The attention "mask" of a packed row: consecutive segments, each causal within itself and
    blind to the others (no ``[S, S]`` mask is built).

    Attributes:
        lengths: tokens per segment, in order; they sum to the packed row's length.
    """

    lengths: tuple[int, ...]


@dataclass(frozen=True)
class SharedPrefixSegments:
    """The attention "mask" of a packed row whose sequences share their prompts.

    Each block is one prompt then the responses of every sequence with that prompt; a response
    attends to the prompt and causally to itself only.

    Attributes:
        blocks: ``(prefix_length, (suffix_length, ...))`` per block, in order.
        suffix_masks: ``[max suffix, max prefix + max suffix]`` bool on the device, ``j <= i +
            max prefix`` (:func:`suffix_masks`): every response's mask is a view of it, so
            every layer, and the recompute under activation checkpointing, reuses the one
            tensor built with the layout (None: each attention call builds it on its device).
    """

    blocks: tuple[tuple[int, tuple[int, ...]], ...]
    suffix_masks: torch.Tensor | None = field(default=None, compare=False, repr=False)


def suffix_masks(blocks: tuple[tuple[int, tuple[int, ...]], ...],
                 device: torch.device | str) -> torch.Tensor:
    """The masks of every response of ``blocks`` in one tensor, built on ``device`` (no host
    copy): ``[Lmax, Pmax + Lmax]`` bool, True where column ``j <= i + Pmax`` (``Pmax``,
    ``Lmax``: the longest prefix and suffix). A suffix of length ``L`` after a prefix of length
    ``p`` attends with ``masks[:L, Pmax - p : Pmax + L]``: all of the prefix, then causally.
    """
    max_prefix = max((prefix for prefix, _ in blocks), default=0)
    max_suffix = max((n for _, suffixes in blocks for n in suffixes), default=0)
    rows = torch.arange(max_suffix, device=device)
    columns = torch.arange(max_prefix + max_suffix, device=device)
    return columns[None, :] <= rows[:, None] + max_prefix


def _shared_prefix_attention(q, k, v, segments: SharedPrefixSegments, dropout_p=0.0,
                             sdpa=F.scaled_dot_product_attention):
    """``sdpa`` for a :class:`SharedPrefixSegments` row; ``q, k, v``: ``[1, heads, S,
    head_dim]``. Each response's mask is a view of ``segments.suffix_masks``."""
    blocks = segments.blocks
    masks = segments.suffix_masks
    if masks is None or masks.device != q.device:
        masks = suffix_masks(blocks, q.device)
    max_prefix = masks.shape[1] - masks.shape[0]
    sizes = [n for prefix, suffixes in blocks for n in (prefix, *suffixes)]
    parts = list(zip(*(x.split(sizes, dim=2) for x in (q, k, v))))
    outs, i = [], 0
    for prefix, suffixes in blocks:
        q_p, k_p, v_p = parts[i]
        outs.append(sdpa(q_p, k_p, v_p, dropout_p=dropout_p, is_causal=True))
        for j, length in enumerate(suffixes, start=i + 1):
            q_s, k_s, v_s = parts[j]
            mask = masks[:length, max_prefix - prefix: max_prefix + length]
            outs.append(sdpa(
                q_s, torch.cat([k_p, k_s], dim=2), torch.cat([v_p, v_s], dim=2),
                attn_mask=mask, dropout_p=dropout_p))
        i += 1 + len(suffixes)
    return torch.cat(outs, dim=2)


def _segment_attention(original, q, k, v, mask=None, dropout_p=0.0, is_causal=True, *,
                       sdpa=F.scaled_dot_product_attention):
    """torchtune's ``_attention_call`` for packed masks (``q, k, v``: ``[1, heads, S, head_dim]``),
    by the module's kernel ``sdpa``; any other mask goes to ``original``.
    """
    if isinstance(mask, SharedPrefixSegments):
        return _shared_prefix_attention(q, k, v, mask, dropout_p=dropout_p, sdpa=sdpa)
    if not isinstance(mask, PackedSegments):
        return original(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    if len(mask.lengths) == 1:
        return sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)
    # split, not slices: its backward is one concatenation, where each slice's backward would
    # write a zero-filled gradient of the whole packed row
    outs = [sdpa(q_s, k_s, v_s, dropout_p=dropout_p, is_causal=True)
            for q_s, k_s, v_s in zip(*(x.split(mask.lengths, dim=2) for x in (q, k, v)))]
    return torch.cat(outs, dim=2)


def install_packed_attention(model: nn.Module) -> None:
    """Let every torchtune attention module of ``model`` take a :class:`PackedSegments` or
    :class:`SharedPrefixSegments` mask (wraps ``_attention_call``; idempotent).
    """
    from torchtune_grpo.policy.kv_cache import attention_kernel

    for module in model.modules():
        call = module.__dict__.get("_attention_call")
        if call is None or getattr(call, "_grpo_packed", False):
            continue
        wrapped = functools.partial(_segment_attention, call, sdpa=attention_kernel(module))
        wrapped._grpo_packed = True
        module._attention_call = wrapped


def shared_prompt_layout(
    tokens: torch.Tensor, prompt_mask: torch.Tensor, response_present: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, SharedPrefixSegments]:
    """Where each real token of a micro-batch goes in a prompt-sharing packed row.

    Args:
        tokens: ``[n, P + T]``.
        prompt_mask: ``[n, P]`` real prompt tokens.
        response_present: ``[n, T]`` real response (and tool) tokens.

    Returns:
        ``(keep [n, P + T] bool, packed_index [n, P + T] long, segments)``: the tokens laid out,
        every real token's position in the packed row (-1 elsewhere), and the block lengths
        with their masks (:func:`suffix_masks`, on ``tokens``' device).
    """
    n, prompt_len = prompt_mask.shape
    keep = torch.zeros(n, tokens.shape[1], dtype=torch.bool, device=tokens.device)
    packed_index = torch.full_like(tokens, -1, dtype=torch.long)
    prompt_lengths = prompt_mask.sum(1).tolist()
    response_lengths = response_present.sum(1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    prompts = tokens[:, :prompt_len].tolist()
    for row in range(n):
        real = prompts[row][prompt_len - prompt_lengths[row]:]
        if response_lengths[row] == 0 and prompt_lengths[row] == 0:
            continue
        groups.setdefault(tuple(real), []).append(row)
    blocks, offset = [], 0
    for rows in groups.values():
        first, plen = rows[0], prompt_lengths[rows[0]]
        keep[first, prompt_len - plen: prompt_len] = True
        prompt_slots = torch.arange(offset, offset + plen, device=tokens.device)
        offset += plen
        suffixes = []
        for row in rows:
            packed_index[row, prompt_len - plen: prompt_len] = prompt_slots
            length = response_lengths[row]
            if length:
                keep[row, prompt_len: prompt_len + length] = True
                packed_index[row, prompt_len: prompt_len + length] = torch.arange(
                    offset, offset + length, device=tokens.device)
                offset += length
                suffixes.append(length)
        blocks.append((plen, tuple(suffixes)))
    layout = tuple(blocks)
    # the responses' masks, built once on the device for every layer and recompute
    return keep, packed_index, SharedPrefixSegments(layout, suffix_masks(layout, tokens.device))
