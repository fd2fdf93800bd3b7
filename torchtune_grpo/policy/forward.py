"""The policy's forwards in GRPO, each asking the output head for only what it needs: the last
position's logits or the response tokens' log-probs (padded, trimmed or packed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.policy.decoder import PolicyDecoder
from torchtune_grpo.policy.head import (
    LAST_POSITION,
    OutputRequest,
    PackedLogProbs,
    ResponseLogProbs,
)
from torchtune_grpo.policy.packing import (
    PackedSegments,
    install_packed_attention,
    shared_prompt_layout,
)
from torchtune_grpo.policy.positions import attention_mask, position_ids, trim_to_extent


def _run(model: nn.Module, tokens: torch.Tensor, *, mask, input_pos: torch.Tensor,
         output: OutputRequest, forward: Callable[..., object] | None = None):
    """``(forward or model)(tokens, mask=mask, input_pos=input_pos, output=output)``.

    Raises:
        TypeError: ``model`` is a plain torchtune decoder, whose head takes no request (build
            the policy with :func:`~torchtune_grpo.policy.decoder.policy_decoder`).
    """
    if isinstance(model, TransformerDecoder) and not isinstance(model, PolicyDecoder):
        raise TypeError(f"{type(model).__name__} is a torchtune decoder, not a PolicyDecoder: "
                        "build the policy with torchtune_grpo.policy.decoder.policy_decoder")
    return (model if forward is None else forward)(tokens, mask=mask, input_pos=input_pos,
                                                   output=output)


def last_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    input_pos: torch.Tensor,
    forward: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits of the last position of ``tokens`` under ``model``: ``[b, 1, V]`` float32.

    Args:
        model: the policy, a :class:`PolicyDecoder` (possibly FSDP-sharded, LoRA, with KV
            caches attached).
        tokens: ``[b, s]`` token ids.
        mask: the attention mask the decoder takes (``[b, s, L]`` boolean, or None).
        input_pos: ``[b, s]`` position ids.
        forward: the callable that runs ``model`` (default ``model``; a compiled decode step).
    """
    # one request object, LAST_POSITION: a compiled step keeps its guards
    return _run(model, tokens, mask=mask, input_pos=input_pos, output=LAST_POSITION,
                forward=forward)


def response_logprobs(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    prompt_len: int,
    mask: torch.Tensor,
    input_pos: torch.Tensor,
    temperature: float = 1.0,
    logit_bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    keep_probs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the response part of ``tokens`` under ``model``.

    Args:
        model: the policy, a :class:`PolicyDecoder`.
        tokens: ``[N, P + T]`` prompt (left-padded to ``P``) followed by the response.
        prompt_len: ``P``.
        mask: ``[N, P + T, P + T]`` boolean attention mask.
        input_pos: ``[N, P + T]`` position ids.
        temperature: logits are divided by it, as at sampling time.
        logit_bias: ``[V]`` additive bias (``-inf`` forbids a token id).
        chunk_size: tokens per chunk of the output projection.
        return_entropy: also return the per-token entropy ``[N, T]``.
        entropy_grad: the entropy takes part in the loss (False: a metric only).
        keep_probs: float32 softmax elements the forward may keep for the backward (0:
            recompute).

    Returns:
        ``(logprobs [N, T] float32, entropy [N, T] or None)``.
    """
    num_response = tokens.shape[1] - prompt_len
    request = ResponseLogProbs(
        targets=tokens[:, prompt_len:],
        start=prompt_len - 1,
        temperature=temperature,
        logit_bias=logit_bias,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        entropy_grad=entropy_grad,
        keep_probs=keep_probs,
    )
    assert num_response > 0, "response_logprobs needs at least one response token"
    # The last position predicts nothing we score: drop it from the input.
    return _run(model, tokens[:, :-1], mask=mask[:, :-1, :-1], input_pos=input_pos[:, :-1],
                output=request)


def micro_batch_logprobs(
    model: nn.Module,
    tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tool_mask: torch.Tensor | None = None,
    trim: bool = True,
    pack: bool = False,
    share_prompts: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_logprobs` of one micro-batch, run on its own extent only.

    ``pack`` (which takes precedence) runs :func:`packed_micro_batch_logprobs`; ``trim`` runs on
    the columns :func:`trim_to_extent` keeps and pads the results back with zeros. Both match the
    full rectangle up to float rounding. Tool-result tokens are attended to but get log-prob (and
    entropy) 0, with no gradient.

    Args:
        model: the policy, a :class:`PolicyDecoder`.
        tokens: ``[n, P + T]`` left-padded prompts followed by right-padded responses.
        prompt_mask: ``[n, P]`` True on real prompt tokens.
        response_mask: ``[n, T]`` True on generated tokens.
        tool_mask: ``[n, T]`` True on tool-result tokens (None: none).
        trim: run on the trimmed slice (False: on the whole ``[n, P + T]`` rectangle).
        pack: run on the rows' real tokens laid end to end.
        share_prompts: with ``pack``, rows with the same prompt run it once.
        **kwargs: ``temperature``, ``logit_bias``, ``chunk_size``, ``return_entropy``,
            ``entropy_grad``, ``keep_probs`` of :func:`response_logprobs`.

    Returns:
        ``(logprobs [n, T] float32, entropy [n, T] or None)``.
    """
    if pack:
        return packed_micro_batch_logprobs(model, tokens, prompt_mask, response_mask,
                                           tool_mask=tool_mask, share_prompts=share_prompts,
                                           **kwargs)
    full_response_len = response_mask.shape[1]
    if trim:
        tokens, padding, prompt_len, response_len = trim_to_extent(
            tokens, prompt_mask, response_mask, tool_mask)
    else:
        present = response_mask if tool_mask is None else response_mask | tool_mask
        padding = torch.cat([prompt_mask, present], dim=1)
        prompt_len, response_len = prompt_mask.shape[1], full_response_len
    logprobs, entropy = response_logprobs(
        model, tokens, prompt_len=prompt_len, mask=attention_mask(padding),
        input_pos=position_ids(padding), **kwargs,
    )
    missing = full_response_len - response_len
    if missing:
        logprobs = F.pad(logprobs, (0, missing))
        entropy = None if entropy is None else F.pad(entropy, (0, missing))
    if tool_mask is not None:  # no host sync: a where on every micro-batch that has the mask
        tool = tool_mask.to(logprobs.device)
        logprobs = torch.where(tool, torch.zeros_like(logprobs), logprobs)
        entropy = None if entropy is None else torch.where(
            tool, torch.zeros_like(entropy), entropy)
    return logprobs, entropy


def packed_micro_batch_logprobs(
    model: nn.Module,
    tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tool_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    keep_probs: int = 0,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of a micro-batch's response tokens, the model run on its real tokens only.

    The rows' real tokens are laid end to end in one ``[1, S]`` row, positions restarting at 0 per
    row and attention kept within a row (:class:`PackedSegments`), so the results equal the padded
    rectangle's up to float rounding. Rows without real tokens are skipped.

    Args:
        model: the policy, a :class:`PolicyDecoder` (not compiled).
        tokens: ``[n, P + T]`` left-padded prompts followed by right-padded responses.
        prompt_mask: ``[n, P]`` True on real prompt tokens.
        response_mask: ``[n, T]`` True on generated tokens.
        tool_mask: ``[n, T]`` True on tool-result tokens (None: none); packed, log-prob 0.
        temperature, logit_bias, chunk_size, return_entropy, entropy_grad, keep_probs: as for
            :func:`response_logprobs`.
        share_prompts: rows with the same real prompt run it once (:class:`SharedPrefixSegments`:
            a group of ``G`` rows costs ``P + sum(T_i)`` tokens); gradients to the prompt
            positions are summed over the group.

    Returns:
        ``(logprobs [n, T] float32, entropy [n, T] or None)``, 0 wherever ``response_mask`` is
        False; gradients flow to the response positions only.
    """
    prompt_len = prompt_mask.shape[1]
    if tokens.shape[1] != prompt_len + response_mask.shape[1]:
        raise ValueError(f"tokens have {tokens.shape[1]} columns, masks {prompt_len} + "
                         f"{response_mask.shape[1]}")
    device = tokens.device
    prompt_mask, response_mask = prompt_mask.to(device), response_mask.to(device)
    scored = response_mask
    present = response_mask
    if tool_mask is not None:
        tool_mask = tool_mask.to(device)
        scored = response_mask & ~tool_mask
        present = response_mask | tool_mask
    response_present = present
    present = torch.cat([prompt_mask, present], dim=1)  # [n, P + T]
    n, num_response = response_mask.shape
    targets = tokens[:, prompt_len:][scored].unsqueeze(0)  # [1, M]
    positions = present.long().cumsum(1) - 1  # [n, P + T] each real token's position in its row
    if share_prompts:
        keep, packed_index, segments = shared_prompt_layout(tokens, prompt_mask,
                                                             response_present)
        # the hidden state predicting response token t is that of the real token before it:
        # the previous response token, or the prompt's last token (present tokens of a row are
        # contiguous: the prompt is left-padded, the response right-padded)
        index = packed_index[:, prompt_len - 1 : -1][scored]  # [M]
        if index.numel() == 0:
            zeros = torch.zeros(n, num_response, device=device)
            return zeros, (zeros.clone() if return_entropy else None)
        packed_tokens = tokens[keep].unsqueeze(0)  # [1, S], row-major within the layout
        input_pos = positions[keep].unsqueeze(0)
        order = packed_index[keep].argsort()
        packed_tokens, input_pos = packed_tokens[:, order], input_pos[:, order]
    else:
        # index of every real token in the packed row (row-major order)
        packed_index = present.flatten().long().cumsum(0).view_as(present) - 1
        # the hidden state predicting response token t of row i is that of the real token
        # before it, in the same row (every row has a prompt token before its first response)
        index = packed_index[:, prompt_len:][scored] - 1  # [M]
        lengths = tuple(int(x) for x in present.sum(1).tolist() if x > 0)
        if not lengths or index.numel() == 0:
            zeros = torch.zeros(n, num_response, device=device)
            return zeros, (zeros.clone() if return_entropy else None)
        segments = PackedSegments(lengths)
        packed_tokens = tokens[present].unsqueeze(0)  # [1, S]
        input_pos = positions[present].unsqueeze(0)  # [1, S]
    install_packed_attention(model)
    request = PackedLogProbs(index=index, targets=targets, temperature=temperature,
                             logit_bias=logit_bias, chunk_size=chunk_size,
                             return_entropy=return_entropy, entropy_grad=entropy_grad,
                             keep_probs=keep_probs)
    # the packed row may be longer than max_seq_len (the decoder knows a packed request)
    logprobs, entropy = _run(model, packed_tokens, mask=segments, input_pos=input_pos,
                             output=request)
    out = logprobs.new_zeros(n, num_response).masked_scatter(scored, logprobs[0])
    if entropy is not None:
        entropy = entropy.new_zeros(n, num_response).masked_scatter(scored, entropy[0])
    return out, entropy
