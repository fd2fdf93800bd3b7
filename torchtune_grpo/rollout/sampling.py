"""Token rules and sampling primitives of the rollout.

* **Which ids a completion may hold.** :func:`stop_token_ids` end a completion;
  :func:`allowed_token_mask` lets sampling emit only the tokenizer's ordinary vocabulary and
  its stop tokens, so a model whose embedding table is larger than the tokenizer (Llama 3
  reserves ids it never defines) cannot emit the rest; :func:`logit_bias_from_mask` turns the
  mask into the ``-inf`` bias applied both to sampling and to the training log-probs, so both
  see one distribution.
* **One token per row.** :func:`sample_next_token` samples by inverse CDF
  (:func:`inverse_cdf_sample`) with counter-based random numbers
  (:func:`~torchtune_grpo.rollout.seeding.counter_uniform`) and returns the tempered log-prob
  of each sampled token.
* **Text.** :func:`safe_decode` and :func:`decode_completions` decode without ever raising on
  ids the tokenizer does not define.

The KV-cache engine that calls these is :mod:`torchtune_grpo.rollout.native`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.errors import UserError
from torchtune_grpo.rollout.seeding import counter_uniform


# ---------------------------------------------------------------------------- vocabulary
def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end a completion: ``tokenizer.stop_tokens`` or, failing that, ``eos_id``."""
    stops = getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id]
    return sorted({int(t) for t in stops})


def _ordinary_ids(tokenizer) -> Iterable[int] | None:
    """Ids of the tokenizer's ordinary (non-special) vocabulary, when it exposes them."""
    ordinary = getattr(tokenizer, "ordinary_token_ids", None)
    if callable(ordinary):  # e.g. torchtune_grpo.models.HFTokenizer
        return list(ordinary())
    tt = getattr(getattr(tokenizer, "tt_model", None), "tt_model", None)
    if tt is not None and hasattr(tt, "_mergeable_ranks"):  # tiktoken (Llama 3 and co.)
        return tt._mergeable_ranks.values()
    encoder = getattr(tokenizer, "encoder", None)
    if isinstance(encoder, dict):  # byte-level BPE (Qwen2 and co.)
        return encoder.values()
    return None


def allowed_token_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """Ids sampling may emit: ordinary tokens plus stop tokens, within the model's vocabulary.

    Special tokens other than the stop tokens (chat headers, Llama 3's reserved ids, padding)
    are excluded, and so is every id the tokenizer does not define at all.

    Args:
        tokenizer: a torchtune tokenizer.
        vocab_size: ``V``, the size of the model's output layer.

    Returns:
        ``[V]`` bool, True where the id may be sampled.
    """
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    ids = _ordinary_ids(tokenizer)
    if ids is None:  # generic fallback: probe the decoder one id at a time
        specials = set(getattr(tokenizer, "special_tokens", {}).values())
        ids = [i for i in range(vocab_size) if i not in specials and _decodes(tokenizer, i)]
    ids = torch.tensor([i for i in ids if 0 <= i < vocab_size], dtype=torch.long)
    allowed[ids] = True
    stops = [t for t in stop_token_ids(tokenizer) if t < vocab_size]
    if not stops:
        raise UserError(
            f"none of the tokenizer's stop tokens {stop_token_ids(tokenizer)} fits in the "
            f"model's vocabulary of {vocab_size}: check `tokenizer` against `model`"
        )
    allowed[stops] = True
    return allowed


def logit_bias_from_mask(allowed: torch.Tensor) -> torch.Tensor:
    """``[V]`` float32 bias: 0 where ``allowed``, ``-inf`` elsewhere."""
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return bias.masked_fill_(~allowed, float("-inf"))


def _decodes(tokenizer, token_id: int) -> bool:
    try:
        tokenizer.decode([token_id])
        return True
    except Exception:  # noqa: BLE001 - any failure means "not decodable"
        return False


def safe_decode(tokenizer, token_ids: Sequence[int], allowed: torch.Tensor | None = None) -> str:
    """Decode ``token_ids`` without ever raising on ids the tokenizer does not define.

    Ids outside ``allowed`` (when given) are dropped; if decoding still fails, ids are decoded
    one by one and the undecodable ones are skipped.
    """
    ids = [int(i) for i in token_ids]
    if allowed is not None:
        ids = [i for i in ids if 0 <= i < allowed.numel() and bool(allowed[i])]
    try:
        return tokenizer.decode(ids)
    except Exception:  # noqa: BLE001
        return "".join(tokenizer.decode([i]) for i in ids if _decodes(tokenizer, i))


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
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse-CDF sampling with counter-based random numbers.

    Args:
        logits: ``[n, V]`` raw logits.
        temperature: ``> 0`` samples from ``softmax(logits / temperature)``; ``0`` is greedy.
        top_k: keep only the ``top_k`` most likely ids when sampling (None: all).
        logit_bias: ``[V]`` additive bias (``-inf`` forbids an id; such ids are never drawn).
        seeds: ``[n]`` int64 per-row seeds (required when sampling).
        counter: decode step, so that each step draws fresh numbers.
        inplace: ``logits`` (float32) may be overwritten with the tempered, biased scores (the
            engine passes its own model output: saves a fresh ``[n, V]`` block per step).

    Returns:
        ``(tokens [n] long, logprobs [n] float32)``: the log-prob is that of the tempered
        distribution over the whole (allowed) vocabulary, the same quantity the training
        forward computes, whether or not ``top_k`` truncated the sampling.
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
    if seeds is None:
        raise ValueError("sampling with temperature > 0 needs per-row `seeds`")
    # One softmax serves both the sampling and the log-prob: log(p[token]) of a sampled token
    # (p > 0, in practice far above float32's smallest normal) agrees with log_softmax to an
    # ulp, and saves a pass over [n, V]. softmax rather than exp(): exp() of the very negative
    # tail is slow on CPU.
    probs = torch.softmax(scores, dim=-1)
    sample_probs = probs
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        sample_probs = probs.masked_fill(probs < kth, 0.0)
    tokens = inverse_cdf_sample(sample_probs, counter_uniform(seeds, counter).to(probs.device))
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()


#: Ids per block of :func:`inverse_cdf_sample`'s two-level search.
CDF_BLOCK = 256


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The id where ``u`` falls in each row's cumulative distribution, in two levels.

    Row ``i`` gets the smallest id ``j`` with ``sum(probs[i, :j + 1]) >= u[i] * sum(probs[i])``,
    so an id of probability 0 is never returned for ``u`` in ``(0, 1)``. Instead of a float64
    cumulative sum over the whole vocabulary, the rows are cut into blocks of
    :data:`CDF_BLOCK` ids: one float32 pass sums the blocks (no float64 copy of the row), a
    float64 search over the ``V / CDF_BLOCK`` block totals picks the block, and only that block
    is accumulated (in float64) and searched. The result differs from one float64 cumulative
    sum only where ``u`` falls within float32 rounding (~1e-7 of a block's mass) of a boundary.

    Args:
        probs: ``[n, V]`` non-negative weights (float32), each row with a positive sum.
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
