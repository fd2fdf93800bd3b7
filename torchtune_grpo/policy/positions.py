"""Position ids, the padding-aware causal mask and the trim of a micro-batch to its own extent,
for rows of left-padded prompts and right-padded responses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def position_ids(padding_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[N, L]`` that start at 0 on the first real token of each row.

    Args:
        padding_mask: ``[N, L]`` True on real tokens (left padding is False).
    """
    return (padding_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """Causal attention mask ``[N, L, L]`` that hides padding (every position also sees itself).

    Args:
        padding_mask: ``[N, L]`` True on real tokens.
    """
    length = padding_mask.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=padding_mask.device))
    mask = causal.unsqueeze(0) & padding_mask.unsqueeze(1)
    return mask | torch.eye(length, dtype=torch.bool, device=padding_mask.device).unsqueeze(0)


class Trimmed(NamedTuple):
    """A micro-batch cut down to its own extent (see :func:`trim_to_extent`).

    Attributes:
        tokens: ``[n, P_mb + T_mb]`` the kept columns of the micro-batch's tokens.
        padding_mask: ``[n, P_mb + T_mb]`` True on real tokens of the kept columns.
        prompt_len: ``P_mb``: kept prompt columns (the last ``P_mb`` of the ``P``).
        response_len: ``T_mb``: kept response columns (the first ``T_mb`` of the ``T``).
    """

    tokens: torch.Tensor
    padding_mask: torch.Tensor
    prompt_len: int
    response_len: int


def trim_to_extent(tokens: torch.Tensor, prompt_mask: torch.Tensor,
                   response_mask: torch.Tensor,
                   tool_mask: torch.Tensor | None = None) -> Trimmed:
    """Drop the columns of a micro-batch that hold padding in every one of its rows.

    Positions and attention of the kept columns are unchanged, so the log-probs match up to float
    rounding. At least one prompt and one response column are kept.

    Args:
        tokens: ``[n, P + T]`` prompts (left-padded to ``P``) followed by responses
            (right-padded to ``T``).
        prompt_mask: ``[n, P]`` True on real prompt tokens.
        response_mask: ``[n, T]`` True on generated tokens.
        tool_mask: ``[n, T]`` True on tool-result tokens (None: none), counted as real.

    Returns:
        :class:`Trimmed` with ``1 <= P_mb <= P`` and ``1 <= T_mb <= T``.
    """
    prompt_len, response_len = prompt_mask.shape[1], response_mask.shape[1]
    if tokens.shape[1] != prompt_len + response_len:
        raise ValueError(
            f"tokens have {tokens.shape[1]} columns, masks {prompt_len} + {response_len}"
        )
    if tool_mask is not None:
        response_mask = response_mask | tool_mask  # every response token that exists
    used_prompt = prompt_mask.any(dim=0).nonzero()  # [k, 1] columns with a real prompt token
    used_response = response_mask.any(dim=0).nonzero()
    start = min(int(used_prompt[0]), prompt_len - 1) if used_prompt.numel() else prompt_len - 1
    kept_response = int(used_response[-1]) + 1 if used_response.numel() else 1
    stop = prompt_len + kept_response
    padding = torch.cat([prompt_mask, response_mask], dim=1)
    return Trimmed(
        tokens=tokens[:, start:stop],
        padding_mask=padding[:, start:stop],
        prompt_len=prompt_len - start,
        response_len=kept_response,
    )
