"""The rollout's KV cache and attention over torchtune's attention modules: storage allocated
once per rollout, a cache that returns only the filled span, and grouped-query attention that
reads the cache in place. :func:`attached` installs them for a rollout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.modules import MultiHeadAttention, RotaryPositionalEmbeddings


def attention_kernel(attn: nn.Module) -> Callable[..., torch.Tensor]:
    """The function with ``F.scaled_dot_product_attention``'s signature that computes ``attn``'s
    attention: the module's own ``sdpa`` where it has one (a soft-capped attention's eager
    kernel, :class:`~torchtune_grpo.models.layers.SoftCappedAttention`), else SDPA itself."""
    return getattr(attn, "sdpa", torch.nn.functional.scaled_dot_product_attention)


def attention_modules(model: nn.Module) -> list[MultiHeadAttention]:
    """The self-attention modules of ``model``, in layer order (FSDP-wrapped or not)."""
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no torchtune MultiHeadAttention module; the generation "
            "engine needs a torchtune decoder-only model"
        )
    return found


class KVCacheStorage:
    """Key/value storage for every attention layer: one pair of ``[rows, kv_heads, max_len,
    head_dim]`` tensors per layer, allocated once (not zeroed) and reused by every micro-batch.

    Args:
        model: the torchtune decoder the storage is for.
        rows: the most sequences decoded at once.
        max_len: the most positions per sequence (``P + max_generated_tokens``).
        dtype: cache dtype.
        device: cache device.
    """

    def __init__(self, model: nn.Module, *, rows: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.rows, self.max_len, self.dtype = rows, max_len, dtype
        self.device = torch.device(device)
        self.layers: list[tuple[MultiHeadAttention, torch.Tensor, torch.Tensor]] = []
        for attn in attention_modules(model):
            shape = (rows, attn.num_kv_heads, max_len, attn.head_dim)
            k = torch.empty(shape, dtype=dtype, device=self.device)
            v = torch.empty(shape, dtype=dtype, device=self.device)
            self.layers.append((attn, k, v))

    def fits(self, rows: int, length: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``rows`` sequences of ``length`` positions fit (same dtype and device)."""
        return (rows <= self.rows and length <= self.max_len and dtype == self.dtype
                and torch.device(device) == self.device)

    @property
    def nbytes(self) -> int:
        """Bytes held by the storage."""
        return sum(k.nbytes + v.nbytes for _, k, v in self.layers)


class SpanKVCache(nn.Module):
    """Stands in for torchtune's ``KVCache`` on one attention module during a rollout.

    ``update`` returns the filled span only. Prefill (:meth:`start_prefill`) runs each distinct
    prompt once and writes it into the rows that share it; span decode attends over ``[:length]``;
    static decode (``write_pos``, for ``torch.compile``) keeps the shapes fixed.

    Args:
        k (Tensor): ``[rows', kv_heads, max_len, head_dim]`` key storage (``rows' >= rows``).
        v (Tensor): the value storage, shaped as ``k``.
        rows (int): the rows of the micro-batch.
        write_pos (Tensor | None): ``[1]`` long, static decode's write position; None: span
            decode.
        step_memo (dict | None): shared by the caches of one model's layers; None: its own.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: int,
                 write_pos: torch.Tensor | None = None, step_memo: dict | None = None) -> None:
        super().__init__()
        self.k_cache = k  # plain attributes: not buffers, never in a state dict
        self.v_cache = v
        self.rows = rows
        self.length = 0
        self.write_pos = write_pos  # [1] long; set: static decode
        self.expand_index: torch.Tensor | None = None
        self.prefilling = False
        self.step_memo = {} if step_memo is None else step_memo

    def additive_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``mask [b, s, S]`` bool as the ``0 / -inf`` bias (``dtype``), made once per mask
        tensor and version; every query row must attend to something."""
        def bias() -> torch.Tensor:
            zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            return zeros.masked_fill_(~mask, float("-inf"))

        return _derived(self.step_memo, f"mask:{dtype}", mask, bias)

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def size(self) -> int:
        return self.length

    def start_prefill(self, expand_index: torch.Tensor | None) -> None:
        self.prefilling, self.expand_index, self.length = True, expand_index, 0

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[b, kv_heads, s, head_dim]`` keys/values; return those to attend over."""
        s = k_val.shape[2]
        if self.prefilling:
            self.prefilling = False
            rows = self.rows
            if self.expand_index is not None:
                self.k_cache[:rows, :, :s] = k_val.index_select(0, self.expand_index)
                self.v_cache[:rows, :, :s] = v_val.index_select(0, self.expand_index)
            else:
                self.k_cache[:rows, :, :s] = k_val
                self.v_cache[:rows, :, :s] = v_val
            self.length = s
            return k_val, v_val
        b = k_val.shape[0]
        if self.write_pos is not None:
            self.k_cache[:b].index_copy_(2, self.write_pos, k_val)
            self.v_cache[:b].index_copy_(2, self.write_pos, v_val)
            return self.k_cache[:b], self.v_cache[:b]
        end = self.length + s
        self.k_cache[:b, :, self.length : end] = k_val
        self.v_cache[:b, :, self.length : end] = v_val
        self.length = end
        return self.k_cache[:b, :, :end], self.v_cache[:b, :, :end]


def _derived(store: dict, key: str, source: torch.Tensor,
             make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, computed once per ``source`` tensor (and version) and kept in ``store[key]``;
    inside a compiled graph always ``make()`` (the compiler shares the work between layers)."""
    if torch.compiler.is_compiling():
        return make()
    memo = store.get(key)
    if memo is None or memo[0] is not source or memo[1] != source._version:
        memo = (source, source._version, make())
        store[key] = memo
    return memo[2]


#: Rotary embeddings :func:`rotate` computes itself (pairwise-interleaved, ``cache [L, d/2, 2]``).
INTERLEAVED_ROPES = (RotaryPositionalEmbeddings, Llama3ScaledRoPE)


def rotates_heads_alike(rope: nn.Module) -> bool:
    """Whether ``rope`` rotates ``x [b, s, h, head_dim]`` head by head with the same angles, so
    that query and key heads stacked along ``h`` rotate in one call: torchtune's interleaved
    RoPE modules, and modules whose class sets ``rotates_heads_alike = True``."""
    return type(rope) in INTERLEAVED_ROPES or getattr(type(rope), "rotates_heads_alike", False)


def rotate(rope: nn.Module, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
    """``rope(x, input_pos=input_pos)`` for ``x [b, s, h, head_dim]``, as one complex product for
    torchtune's interleaved RoPE modules (equal results; angles gathered once per step); other
    position embeddings run their own forward.
    """
    if type(rope) not in INTERLEAVED_ROPES or input_pos is None:
        return rope(x, input_pos=input_pos)
    angles = _derived(rope.__dict__, "_grpo_angles", input_pos, lambda: torch.view_as_complex(
        rope.cache[input_pos].float().contiguous()).unsqueeze(2))  # [b, s, 1, head_dim / 2]
    b, s, h, d = x.shape
    pairs = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(pairs * angles).flatten(3).type_as(x)


def grouped_query_attention(
    attn: MultiHeadAttention,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    input_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """torchtune's ``MultiHeadAttention.forward`` for cached self-attention, without GQA copies.

    The ``heads / kv_heads`` query heads sharing a key/value head are stacked along the query axis,
    so the cache is read in place; outputs match torchtune's to float rounding.

    Args:
        attn (MultiHeadAttention): the module (its ``kv_cache`` must be enabled).
        x (Tensor): ``[b, s, D]`` input.
        y (Tensor | None): ``[b, s, D]`` key/value input (``x`` for self-attention).
        mask (Tensor | None): ``[b, s, S]`` bool, True where query ``i`` may attend to ``j``.
        input_pos (Tensor | None): ``[b, s]`` position ids.

    Returns:
        Tensor: ``[b, s, D]``.
    """
    q, k, v = attn.q_proj(x), attn.k_proj(y), attn.v_proj(y)
    return attn.output_proj(attend_projected(attn, q, k, v, mask=mask, input_pos=input_pos))


def attend_projected(
    attn: MultiHeadAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    input_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of :func:`grouped_query_attention` from its three projections, by the module's
    attention kernel (:func:`attention_kernel`).

    Args:
        attn (MultiHeadAttention): the module (its ``kv_cache`` enabled).
        q (Tensor): ``[b, s, heads * head_dim]`` query projection.
        k (Tensor): ``[b, s, kv_heads * head_dim]`` key projection.
        v (Tensor): ``[b, s, kv_heads * head_dim]`` value projection.
        mask (Tensor | None): ``[b, s, S]`` bool, True where query ``i`` may attend to ``j``.
        input_pos (Tensor | None): ``[b, s]`` position ids.

    Returns:
        Tensor: ``[b, s, heads * head_dim]``, the input of the output projection.
    """
    b, s, _ = q.shape
    kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    g = attn.num_heads // kv_heads
    q = q.view(b, s, attn.num_heads, head_dim)
    if attn.pos_embeddings is not None:
        q = rotate(attn.pos_embeddings, q, input_pos)
    q = q.transpose(1, 2)  # [b, heads, s, hd]; head h reads key/value head h // g
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    k = k.view(b, s, kv_heads, head_dim)
    v = v.view(b, s, kv_heads, head_dim)
    if attn.pos_embeddings is not None:
        k = rotate(attn.pos_embeddings, k, input_pos)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    cache = attn.kv_cache
    k, v = cache.update(k, v)  # [b', kv_heads, S, hd]
    q = q.reshape(b, kv_heads, g * s, head_dim)
    if mask is not None:  # [b, s, S] -> [b, 1, g * s, S], the same row for each of the g heads
        if s == 1 and isinstance(cache, SpanKVCache) and cache.write_pos is None:
            mask = cache.additive_mask(mask, q.dtype)
        span = mask.shape[-1]
        mask = mask[:, None, None].expand(b, 1, g, s, span).reshape(b, 1, g * s, span)
    out = attention_kernel(attn)(  # SDPA, or a soft-capped module's own eager kernel
        q, k, v, attn_mask=mask, is_causal=mask is None and s > 1
    )  # [b, kv_heads, g * s, hd]
    return out.view(b, kv_heads, g, s, head_dim).permute(0, 3, 1, 2, 4).reshape(b, s, -1)


def _grouped_forward(attn: MultiHeadAttention) -> Callable[..., torch.Tensor]:
    def forward(x, y=None, *, mask=None, input_pos=None):
        if y is None or (mask is not None and not isinstance(mask, torch.Tensor)):
            return type(attn).forward(attn, x, y, mask=mask, input_pos=input_pos)
        return grouped_query_attention(attn, x, y, mask=mask, input_pos=input_pos)

    return forward


_NO_FORWARD = object()


@contextlib.contextmanager
def attached(storage: KVCacheStorage, rows: int,
             write_pos: torch.Tensor | None) -> Iterator[list[SpanKVCache]]:
    """Install span caches over ``storage`` and :func:`grouped_query_attention` on every attention
    module; restore on exit.

    Args:
        storage (KVCacheStorage): the keys and values of every layer.
        rows (int): the rows of the micro-batch.
        write_pos (Tensor | None): static decode's ``[1]`` write position (None: span decode).

    Yields:
        list[SpanKVCache]: the installed caches, in layer order.
    """
    saved = [(attn, attn.kv_cache, attn.cache_enabled, attn.__dict__.get("forward", _NO_FORWARD))
             for attn, _, _ in storage.layers]
    caches = []
    step_memo: dict = {}  # one additive mask per decode step, shared by every layer
    try:
        for attn, k, v in storage.layers:
            if write_pos is not None:  # static decode reads every position: no garbage (NaN)
                k.zero_()
                v.zero_()
                # written in place by a compiled step: a fixed address lets CUDA graphs
                # replay over it (no guard: new storage re-records a graph, never recompiles)
                torch._dynamo.mark_static_address(k, guard=False)
                torch._dynamo.mark_static_address(v, guard=False)
            cache = SpanKVCache(k, v, rows, write_pos, step_memo)
            attn.kv_cache = cache
            attn.cache_enabled = True
            attn.forward = _grouped_forward(attn)
            caches.append(cache)
        yield caches
    finally:
        for attn, kv_cache, enabled, forward in saved:
            if attn.pos_embeddings is not None:
                attn.pos_embeddings.__dict__.pop("_grpo_angles", None)
            attn.kv_cache = kv_cache
            attn.cache_enabled = enabled
            if forward is _NO_FORWARD:
                attn.__dict__.pop("forward", None)
            else:
                attn.forward = forward
