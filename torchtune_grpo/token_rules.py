"""Token rules: which ids a completion may hold, where it stops, and decoding that never raises.

Read by both the policy and the rollout, so sampling and the training log-probs see one
distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from torchtune_grpo.errors import UserError


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
