"""Sampling primitives of the rollout: :func:`sample_next_token` (inverse-CDF sampling with
counter-based random numbers, returning tempered log-probs) and :func:`decode_completions`
(text that never raises on undefined ids).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.rollout.seeding import counter_uniform
from torchtune_grpo.token_rules import safe_decode, stop_token_ids


# ---------------------------------------------------------------------------- text
def decode_completions(tokenizer, trajectory: Trajectory, allowed: torch.Tensor) -> list[str]:
    """Text of each completion, without its stop token and padding."""
    stops = set(stop_token_ids(tokenizer))
    texts = []
    for row, mask in zip(trajectory.response_tokens.tolist(), trajectory.response_mask.tolist()):
        ids = [t for t, m in zip(row, mask) if m and t not in stops]
        texts.append(safe_decode(tokenizer, ids, allowed))
    return texts


# ---------------------------------------------------------------------------- sampling
def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    logit_bias: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    counter: int = 0,
    uniform: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse-CDF sampling with counter-based random numbers.

    Args:
        logits: ``[n, V]`` raw logits.
        temperature: ``> 0`` samples from ``softmax(logits / temperature)``; ``0`` is greedy.
        top_k: keep only the ``top_k`` most likely ids when sampling (None: all).
        logit_bias: ``[V]`` additive bias (``-inf`` forbids an id).
        seeds: ``[n]`` int64 per-row seeds (required when sampling without ``uniform``).
        counter: decode step, so that each step draws fresh numbers.
        uniform: ``[n]`` float64 numbers already drawn on the logits' device (column
            ``counter`` of :func:`~torchtune_grpo.rollout.seeding.decode_uniforms`); replaces
            ``seeds`` and ``counter``, and no number is copied from the host.
        inplace: ``logits`` (float32) may be overwritten with the tempered, biased scores.

    Returns:
        ``(tokens [n] long, logprobs [n] float32)``: log-probs of the tempered distribution over
        the whole allowed vocabulary, whether or not ``top_k`` truncated the sampling.

    Raises:
        ValueError: ``temperature > 0`` without ``seeds`` or ``uniform``.
    """
    own = inplace and logits.dtype == torch.float32
    scores = logits.float()
    if temperature > 0 and temperature != 1.0:
        scores = scores.div_(temperature) if own else scores / temperature
        own = True
    if logit_bias is not None:
        scores = scores.add_(logit_bias) if own else scores + logit_bias
    if temperature <= 0:
        logprobs = torch.log_softmax(scores, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if seeds is None and uniform is None:
        raise ValueError("sampling with temperature > 0 needs per-row `seeds` or `uniform`")
    # One softmax serves both the sampling and the log-prob: log(p[token]) of a sampled token
    # (p > 0, in practice far above float32's smallest normal) agrees with log_softmax to an
    # ulp, and saves a pass over [n, V]. softmax rather than exp(): exp() of the very negative
    # tail is slow on CPU.
    probs = torch.softmax(scores, dim=-1)
    sample_probs = probs
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        sample_probs = probs.masked_fill(probs < kth, 0.0)
    if uniform is None:
        uniform = counter_uniform(seeds, counter).to(probs.device)
    tokens = inverse_cdf_sample(sample_probs, uniform)
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()


#: Ids per block of :func:`inverse_cdf_sample`'s two-level search.
CDF_BLOCK = 256


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The id where ``u`` falls in each row's cumulative distribution, searched in two levels.

    Row ``i`` gets the smallest ``j`` with ``sum(probs[i, :j + 1]) >= u[i] * sum(probs[i])``
    (never an id of probability 0). Block totals of :data:`CDF_BLOCK` ids are summed in float32
    and searched in float64, then only the chosen block is accumulated in float64; this differs
    from a full float64 cumulative sum only within float32 rounding of a boundary.

    Args:
        probs: ``[n, V]`` non-negative float32 weights, each row with a positive sum.
        u: ``[n]`` uniform numbers in ``(0, 1)``.

    Returns:
        ``[n]`` int64 ids in ``[0, V)``.
    """
    n, v = probs.shape
    num_blocks = -(-v // CDF_BLOCK)
    if num_blocks * CDF_BLOCK != v:
        probs = F.pad(probs, (0, num_blocks * CDF_BLOCK - v))
    blocks = probs.view(n, num_blocks, CDF_BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # [n, num_blocks]
    target = u.double() * block_cdf[:, -1]
    k = torch.searchsorted(block_cdf, target.unsqueeze(1)).squeeze(1).clamp_(max=num_blocks - 1)
    before = torch.where(k > 0, block_cdf.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros((), dtype=torch.float64, device=probs.device))
    inner = blocks[torch.arange(n, device=probs.device), k].double().cumsum(-1)  # [n, block]
    # rounding may leave the residual a hair above the block's own total: cap it there, so the
    # search lands on the block's last id of positive probability
    residual = torch.minimum(target - before, inner[:, -1])
    j = torch.searchsorted(inner, residual.unsqueeze(1)).squeeze(1).clamp_(max=CDF_BLOCK - 1)
    return (k * CDF_BLOCK + j).clamp_(max=v - 1)
