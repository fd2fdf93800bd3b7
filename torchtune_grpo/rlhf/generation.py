"""Rollout generation: sample ``group_size`` completions per prompt with a KV cache.

Guarantees the recipe relies on:

* **Uniform shapes.** Every micro-batch of ``forward_batch_size`` sequences is generated
  separately (it may stop early), then all are padded to one ``P`` and one ``T``
  (:func:`~torchtune_grpo.rlhf.trajectory.concat_trajectories`).
* **No undefined ids.** Sampling only ever picks ids of the tokenizer's ordinary vocabulary
  or its stop tokens (:func:`allowed_token_mask`); a model whose embedding table is larger than
  the tokenizer (Llama 3 reserves ids it never defines) cannot emit the rest. The same
  ``-inf`` bias is applied to the training log-probs, so both see one distribution.
* **Lockstep.** With FSDP every forward is a collective, so all ranks run the same number of
  decode steps: a rank keeps decoding (padding) until every rank's sequences have stopped.
* **Log-probs for free.** The tempered log-prob of each sampled token is returned, so
  ``ppo_epochs: 1`` needs no extra forward for the "old" policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_grpo.rlhf.forward import last_position_logits
from torchtune_grpo.rlhf.trajectory import Trajectory, concat_trajectories, position_ids


# ---------------------------------------------------------------------------- vocabulary
def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end a completion: ``tokenizer.stop_tokens`` or, failing that, ``eos_id``."""
    stops = getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id]
    return sorted({int(t) for t in stops})


def _ordinary_ids(tokenizer) -> Iterable[int] | None:
    """Ids of the tokenizer's ordinary (non-special) vocabulary, when it exposes them."""
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
        raise ValueError(
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
_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor | int) -> torch.Tensor:
    """A 32-bit integer mixing function applied elementwise (int64 tensors, no overflow)."""
    x = torch.as_tensor(x, dtype=torch.long) & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def mix_seeds(*parts: torch.Tensor | int) -> torch.Tensor:
    """Combine integers (or int tensors, broadcast) into one 32-bit seed per element."""
    out = hash32(0x9E3779B9)
    for part in parts:
        out = hash32(out ^ hash32(part))
    return out


def counter_uniform(seeds: torch.Tensor, counter: int) -> torch.Tensor:
    """One uniform number in ``(0, 1)`` per seed, a pure function of ``(seed, counter)``.

    Sampling driven by these numbers depends only on each row's own seed and decode step,
    never on which other rows share its batch, on the number of ranks, or on generator state.

    Args:
        seeds: ``[n]`` int64 seeds.
        counter: the decode step.

    Returns:
        ``[n]`` float64.
    """
    bits = mix_seeds(seeds, counter)
    return (bits.double() + 0.5) / 2.0**32


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    logit_bias: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    counter: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse-CDF sampling with counter-based random numbers.

    Args:
        logits: ``[n, V]`` raw logits.
        temperature: ``> 0`` samples from ``softmax(logits / temperature)``; ``0`` is greedy.
        top_k: keep only the ``top_k`` most likely ids when sampling (None: all).
        logit_bias: ``[V]`` additive bias (``-inf`` forbids an id; such ids are never drawn).
        seeds: ``[n]`` int64 per-row seeds (required when sampling).
        counter: decode step, so that each step draws fresh numbers.

    Returns:
        ``(tokens [n] long, logprobs [n] float32)``: the log-prob is that of the tempered
        distribution over the whole (allowed) vocabulary, the same quantity the training
        forward computes, whether or not ``top_k`` truncated the sampling.
    """
    scores = logits.float() / (temperature if temperature > 0 else 1.0)
    if logit_bias is not None:
        scores = scores + logit_bias
    logprobs = torch.log_softmax(scores, dim=-1)
    if temperature <= 0:
        tokens = logprobs.argmax(dim=-1)
    else:
        if seeds is None:
            raise ValueError("sampling with temperature > 0 needs per-row `seeds`")
        sample_scores = logprobs
        if top_k is not None and top_k < scores.shape[-1]:
            kth = torch.topk(logprobs, top_k, dim=-1).values[:, -1:]
            sample_scores = logprobs.masked_fill(logprobs < kth, float("-inf"))
        cdf = sample_scores.exp().double().cumsum(dim=-1)
        u = counter_uniform(seeds, counter).to(cdf.device) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, u.unsqueeze(1)).squeeze(1)
        tokens = tokens.clamp_(max=scores.shape[-1] - 1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


# ---------------------------------------------------------------------------- rollout
def _always_local(local_done: bool) -> bool:
    return local_done


@torch.no_grad()
def generate_micro_batch(
    model: nn.Module,
    prompt_tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_generated_tokens: int,
    temperature: float,
    top_k: int | None,
    stop_tokens: torch.Tensor,
    pad_id: int,
    logit_bias: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    all_done: Callable[[bool], bool] = _always_local,
    cache_dtype: torch.dtype | None = None,
) -> Trajectory:
    """Generate one completion for each row of a micro-batch, with a KV cache.

    Args:
        model: a torchtune decoder (FSDP-sharded or not).
        prompt_tokens: ``[n, P]`` left-padded prompts.
        prompt_mask: ``[n, P]`` True on real prompt tokens.
        max_generated_tokens: the most tokens generated per row.
        temperature: sampling temperature (0: greedy).
        top_k: top-k sampling (None: off).
        stop_tokens: ``[s]`` ids that end a completion.
        pad_id: id written after a completion ended.
        logit_bias: ``[V]`` bias forbidding undefined ids (see :func:`allowed_token_mask`).
        seeds: ``[n]`` int64 per-row sampling seeds (see :func:`counter_uniform`).
        all_done: given whether this rank's rows have all stopped, says whether every rank's
            have (a collective in distributed runs; identity otherwise).
        cache_dtype: dtype of the KV cache (default: the model's parameter dtype).

    Returns:
        A :class:`Trajectory` with ``T`` = the number of decode steps taken.
    """
    n, prompt_len = prompt_tokens.shape
    device = prompt_tokens.device
    total_len = prompt_len + max_generated_tokens
    dtype = cache_dtype or next(model.parameters()).dtype
    delete_kv_caches(model) if model.caches_are_setup() else None
    with device:
        model.setup_caches(batch_size=n, dtype=dtype, decoder_max_seq_len=total_len)
    try:
        valid = torch.ones(n, total_len, dtype=torch.bool, device=device)
        valid[:, :prompt_len] = prompt_mask
        positions = position_ids(valid)
        columns = torch.arange(total_len, device=device)
        rows = torch.arange(prompt_len, device=device)
        prefill_mask = (columns[None, :] <= rows[:, None]).unsqueeze(0) & valid[:, None, :]
        prefill_mask |= (columns[None, :] == rows[:, None]).unsqueeze(0)
        with last_position_logits(model):
            logits = model(prompt_tokens, mask=prefill_mask, input_pos=positions[:, :prompt_len])

        out_tokens = torch.full((n, max_generated_tokens), pad_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(n, max_generated_tokens, dtype=torch.float32, device=device)
        out_mask = torch.zeros(n, max_generated_tokens, dtype=torch.bool, device=device)
        stopped = torch.zeros(n, dtype=torch.bool, device=device)
        steps = 0
        for t in range(max_generated_tokens):
            token, logprob = sample_next_token(
                logits[:, -1],
                temperature=temperature,
                top_k=top_k,
                logit_bias=logit_bias,
                seeds=seeds,
                counter=t,
            )
            active = ~stopped
            token = torch.where(active, token, torch.full_like(token, pad_id))
            out_tokens[:, t] = token
            out_logprobs[:, t] = torch.where(active, logprob, torch.zeros_like(logprob))
            out_mask[:, t] = active
            stopped |= active & torch.isin(token, stop_tokens)
            steps = t + 1
            if steps == max_generated_tokens or all_done(bool(stopped.all())):
                break
            cur = prompt_len + t
            step_mask = (valid & (columns <= cur)).unsqueeze(1)
            logits = model(token.unsqueeze(1), mask=step_mask, input_pos=positions[:, cur : cur + 1])
    finally:
        delete_kv_caches(model)

    return Trajectory(
        tokens=torch.cat([prompt_tokens, out_tokens[:, :steps]], dim=1),
        prompt_mask=prompt_mask.clone(),
        response_mask=out_mask[:, :steps],
        logprobs=out_logprobs[:, :steps],
        stopped=stopped,
        pad_id=pad_id,
    )


def generate_trajectory(
    model: nn.Module,
    prompt_tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    group_size: int,
    forward_batch_size: int,
    prompt_seeds: torch.Tensor | None = None,
    **kwargs,
) -> Trajectory:
    """Sample ``group_size`` completions for each prompt, ``forward_batch_size`` rows at a time.

    Args:
        model: a torchtune decoder.
        prompt_tokens: ``[B, P]`` left-padded prompts.
        prompt_mask: ``[B, P]`` True on real prompt tokens.
        group_size: ``G``, completions per prompt.
        forward_batch_size: rows per generation micro-batch (a divisor of ``B * G``).
        prompt_seeds: ``[B]`` int64, one seed per prompt; sample ``g`` of prompt ``b`` uses
            ``mix_seeds(prompt_seeds[b], g)``, so a completion depends only on its prompt's seed
            and its index in the group (needed when ``temperature > 0``).
        **kwargs: passed to :func:`generate_micro_batch`.

    Returns:
        A :class:`Trajectory` of ``N = B * G`` rows, row ``b * G + g`` being sample ``g`` of
        prompt ``b``, padded to the longest micro-batch.
    """
    tokens = prompt_tokens.repeat_interleave(group_size, dim=0)
    mask = prompt_mask.repeat_interleave(group_size, dim=0)
    seeds = None
    if prompt_seeds is not None:
        sample_index = torch.arange(group_size).repeat(prompt_tokens.shape[0])
        seeds = mix_seeds(prompt_seeds.cpu().repeat_interleave(group_size), sample_index)
    parts = [
        generate_micro_batch(
            model, tokens[i : i + forward_batch_size], mask[i : i + forward_batch_size],
            seeds=None if seeds is None else seeds[i : i + forward_batch_size], **kwargs,
        )
        for i in range(0, tokens.shape[0], forward_batch_size)
    ]
    return concat_trajectories(parts)
