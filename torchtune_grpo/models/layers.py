"""Decoder parts the families need and torchtune 0.6.1 does not have: Gemma's norm and scaled
embedding, rotate-half RoPE, normed q/k projections, sliding-window layers and soft-capped
attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

__all__ = [
    "GemmaRMSNorm",
    "HalfRoPE",
    "NormedProjection",
    "ScaledEmbedding",
    "SlidingWindowLayer",
    "SoftCappedAttention",
    "query_factor",
    "soft_capped_sdpa",
    "window_mask",
]


class GemmaRMSNorm(nn.Module):
    """``y = x / rms(x) * (1 + scale)`` over the last axis, in float32, cast back to ``x``'s dtype.

    Args:
        dim: channels normalised.
        eps: added to the mean square.

    Attributes:
        scale: ``[dim]``, the HF ``weight`` as stored (an offset from 1; zeros = identity scale).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim] -> [..., dim]``."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.scale.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output is multiplied by ``scale`` rounded to the weight's dtype (the
    weight stays the plain table, so a tied output reads it unscaled).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float,
                 padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.scale = float(scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` ids -> ``[b, s, D]``."""
        factor = torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype)
        return super().forward(tokens) * factor.to(self.weight.device)


class HalfRoPE(nn.Module):
    """Rotate-half rotary embedding (channel ``i`` pairs with ``i + rotary_dim / 2``).

    Args:
        dim: ``head_dim``.
        max_seq_len: positions cached.
        base: ``theta``.
        position_scale: linear RoPE scaling factor (positions divided by it); 1: none.
        rotary_dim: channels rotated, from the first; ``None``: all.
        freq_factors: ``rotary_dim / 2`` divisors, one per frequency (``longrope``'s
            ``short_factor``); ``None``: none.
        attention_factor: multiplies the cached cos and sin (``longrope``); 1: none.
    """

    #: Every head of ``x`` rotates by the same angles (q and k heads may be stacked).
    rotates_heads_alike = True

    def __init__(self, dim: int, max_seq_len: int, base: float, position_scale: float = 1.0,
                 rotary_dim: int | None = None, freq_factors: tuple[float, ...] | None = None,
                 attention_factor: float = 1.0) -> None:
        super().__init__()
        self.dim, self.base, self.position_scale = dim, base, position_scale
        self.rotary_dim = dim if rotary_dim is None else int(rotary_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 1..{dim}")
        if freq_factors is not None and len(freq_factors) != self.rotary_dim // 2:
            raise ValueError(f"freq_factors has {len(freq_factors)} entries for "
                             f"{self.rotary_dim // 2} frequencies")
        self.freq_factors = None if freq_factors is None else tuple(map(float, freq_factors))
        self.attention_factor = float(attention_factor)
        self.max_seq_len = max_seq_len
        self.rope_init()

    def rope_init(self) -> None:
        """(Re)build the cos/sin cache (torchtune calls this after meta-device init)."""
        r = self.rotary_dim
        powers = self.base ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r)
        if self.freq_factors is not None:
            powers = torch.tensor(self.freq_factors, dtype=torch.float32) * powers
        inv_freq = 1.0 / powers / self.position_scale
        angles = torch.arange(self.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)  # [L, rotary_dim]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.register_buffer("cache", torch.cat([cos, sin], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s, heads, dim]`` rotated by ``input_pos [b, s]`` (None: ``0..s-1``)."""
        s, r = x.shape[1], self.rotary_dim
        cache = self.cache[:s] if input_pos is None else self.cache[input_pos]
        cache = cache.view(-1, s, 1, 2 * r)
        cos, sin = cache[..., :r].to(x.dtype), cache[..., r:].to(x.dtype)
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = (rot * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)
        return out if rest is None else torch.cat((out, rest), dim=-1)


class NormedProjection(nn.Module):
    """A query or key projection, then a norm (per head or over the whole projection), then a
    constant factor.

    Args:
        proj: ``[..., in_dim] -> [..., heads * head_dim]`` (``nn.Linear`` or LoRA/DoRA).
        norm: the norm, or ``None``.
        head_dim: channels per head, or ``None`` for a norm over the whole projection.
        factor: multiplies the output (Gemma's queries: ``sqrt(head_dim /
            query_pre_attn_scalar)``; 1 otherwise).

    Attributes:
        proj: as given (state-dict prefix ``proj.``); ``norm``: as given (``norm.scale``).
    """

    def __init__(self, proj: nn.Module, norm: nn.Module | None, head_dim: int | None,
                 factor: float = 1.0) -> None:
        super().__init__()
        self.proj = proj
        self.head_dim = head_dim
        self.factor = float(factor)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, in_dim] -> [b, s, heads * head_dim]``."""
        return self.finish(self.proj(x))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The norm and factor applied to a projection ``y [b, s, heads * head_dim]`` already
        computed (a fused decode layer projects q, k and v in one product)."""
        if self.norm is not None:
            y = (self.norm(y) if self.head_dim is None
                 else self.norm(y.unflatten(-1, (-1, self.head_dim))).flatten(-2))
        return y if self.factor == 1.0 else y * self.factor


def _dense_segments(mask: object, device: torch.device) -> torch.Tensor | None:
    """The ``[1, S, S]`` bool mask of a packed-row mask object (``lengths`` or ``blocks``)."""
    if hasattr(mask, "lengths"):
        parts = [torch.ones(n, n, dtype=torch.bool).tril() for n in mask.lengths]
        return torch.block_diag(*parts).to(device)[None]
    if hasattr(mask, "blocks"):
        sizes = [n for p, sufs in mask.blocks for n in (p, *sufs)]
        total = sum(sizes)
        out = torch.zeros(total, total, dtype=torch.bool)
        start = 0
        for prefix, suffixes in mask.blocks:
            out[start : start + prefix, start : start + prefix] = torch.ones(
                prefix, prefix, dtype=torch.bool).tril()
            at = start + prefix
            for n in suffixes:
                out[at : at + n, start : start + prefix] = True
                out[at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
                at += n
            start = at
        return out.to(device)[None]
    return None


def _longest_sequence(mask: object) -> int:
    if hasattr(mask, "lengths"):
        return max(mask.lengths, default=0)
    return max((p + max(sufs, default=0) for p, sufs in mask.blocks), default=0)


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Keep, in each query row of ``mask``, only its ``window`` rightmost allowed keys.

    For every mask this package builds, these are the keys with ``q - k < window``.

    Args:
        mask: ``[b, s, S]`` bool, True where query ``i`` may attend to key ``j``.
        window: ``sliding_window``.

    Returns:
        ``[b, s, S]`` bool.
    """
    if mask.shape[-1] <= window:
        return mask
    from_right = mask.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)
    return mask & (from_right <= window)


class SlidingWindowLayer(TransformerSelfAttentionLayer):
    """torchtune's self-attention layer whose attention sees the last ``window`` keys only.

    The mask it receives is narrowed by :func:`window_mask` (once per mask, shared through
    ``memo``); the attention module stays torchtune's.

    Args:
        window: ``sliding_window``.
        memo: a dict shared by the model's sliding layers.
        **layer: ``TransformerSelfAttentionLayer``'s arguments.
    """

    def __init__(self, *, window: int, memo: dict, **layer: nn.Module) -> None:
        super().__init__(**layer)
        self.window = int(window)
        self._memo = memo

    def _narrow(self, x: torch.Tensor, mask: object) -> object:
        if mask is None:
            s = x.shape[1]
            if s <= self.window:
                return None
            i = torch.arange(s, device=x.device)
            causal = (i[:, None] >= i[None]) & (i[:, None] - i[None] < self.window)
            return causal.expand(x.shape[0], s, s)
        if not isinstance(mask, torch.Tensor):
            if _longest_sequence(mask) <= self.window:
                return mask
            dense = _dense_segments(mask, x.device)
            if dense is None:
                raise ValueError(f"sliding-window layer: mask type {type(mask).__name__} is "
                                 "not supported (bool tensors, packed segments)")
            return window_mask(dense, self.window)
        if torch.compiler.is_compiling():  # a traced graph computes it; no Python state
            return window_mask(mask, self.window)
        memo = self._memo.get("mask")
        if memo is None or memo[0] is not mask or memo[1] != mask._version:
            memo = (mask, mask._version, window_mask(mask, self.window))
            self._memo["mask"] = memo
        return memo[2]

    def forward(self, x: torch.Tensor, *, mask: object = None,
                input_pos: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        """``[b, s, D] -> [b, s, D]``; ``mask [b, s, S]`` bool (or a packed-row mask, or None)."""
        return super().forward(x, mask=self._narrow(x, mask), input_pos=input_pos, **kwargs)


def query_factor(head_dim: int, query_pre_attn_scalar: float) -> float:
    """The factor that makes SDPA's ``head_dim ** -0.5`` Gemma's ``query_pre_attn_scalar **
    -0.5``."""
    return math.sqrt(head_dim / query_pre_attn_scalar)


def soft_capped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, *, softcap: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the scores soft-capped before the mask.

    Softmax in float32, cast back to ``q``'s dtype; a query row with no allowed key gives zeros.

    Args:
        q: ``[..., L, head_dim]``; k, v: ``[..., S, head_dim]`` (the same heads as ``q``).
        attn_mask: broadcastable to ``[..., L, S]``, bool (True: attend) or additive.
        dropout_p: attention dropout.
        is_causal: SDPA's causal mask, with no ``attn_mask``.
        softcap: the cap.

    Returns:
        ``[..., L, head_dim]``.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    allowed = attn_mask if attn_mask is not None and attn_mask.dtype == torch.bool else None
    if is_causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    elif attn_mask is not None and allowed is None:
        scores = scores + attn_mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)
    if allowed is not None:
        probs = probs.masked_fill(~allowed, 0.0)  # a row without keys: zeros, not NaN
    probs = probs.to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


class SoftCappedAttention(MultiHeadAttention):
    """torchtune's ``MultiHeadAttention`` with Gemma 2's soft-cap ``cap * tanh(scores / cap)``.

    ``_attention_call`` and :meth:`sdpa` (found by
    :func:`~torchtune_grpo.policy.kv_cache.attention_kernel`) are the eager capped attention; a
    flex-attention ``BlockMask`` is refused.

    Args:
        softcap: the cap (> 0).
        **attention: ``MultiHeadAttention``'s arguments.

    Attributes:
        softcap: the cap, read on every call.
    """

    def __init__(self, *, softcap: float, **attention: object) -> None:
        super().__init__(**attention)
        if not softcap > 0:
            raise ValueError(f"attention softcap {softcap}: must be > 0")
        self.softcap = float(softcap)
        self._attention_call = self._capped_call

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False) -> torch.Tensor:
        """:func:`soft_capped_sdpa` with this module's cap (SDPA's signature)."""
        return soft_capped_sdpa(q, k, v, attn_mask, dropout_p, is_causal, softcap=self.softcap)

    def _capped_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: object = None, dropout_p: float = 0.0,
                     is_causal: bool = False) -> torch.Tensor:
        """torchtune's ``_attention_call`` signature: ``mask [b, s, S]`` bool or None."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise NotImplementedError(
                f"soft-capped attention (attn_logit_softcapping={self.softcap}) with a "
                f"{type(mask).__name__} mask: only bool tensor masks (and this package's packed "
                "rows) are supported")
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]
        return self.sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
