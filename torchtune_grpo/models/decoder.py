"""One decoder builder for this package's families: a :class:`DecoderSpec` says what a family's
layers are, :func:`build_decoder` fills torchtune's decoder slots (norm kind and placement, q/k
norm, RoPE per layer, sliding windows, soft-cap, activation, embedding scale, tying) with the
matching modules. Weights keep Hugging Face's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from torch import nn
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import DoRALinear, LoRALinear

from torchtune_grpo.models.layers import (
    GemmaRMSNorm,
    HalfRoPE,
    NormedProjection,
    ScaledEmbedding,
    SlidingWindowLayer,
    SoftCappedAttention,
)

__all__ = ["LORA_ATTN_MODULES", "DecoderSpec", "build_decoder", "build_lora_decoder"]

#: Attention projections LoRA may adapt (torchtune's names).
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
_ACTIVATIONS = {"silu": nn.SiLU, "gelu_tanh": partial(nn.GELU, approximate="tanh")}
_PLACEMENTS = ("pre", "post", "sandwich")


@dataclass(frozen=True)
class DecoderSpec:
    """What one family's decoder is made of (all fixed when it is built).

    Attributes:
        vocab_size: ``V``.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (a divisor of ``num_heads``).
        embed_dim: ``D``, the residual width.
        intermediate_dim: the gated MLP's width.
        max_seq_len: context length (RoPE caches, KV caches).
        head_dim: channels per head.
        norm_eps: every norm's epsilon.
        norm: ``"rms"`` (torchtune's RMSNorm) or ``"gemma"`` (``1 + w``).
        placement: ``"pre"`` (``sa_norm``, ``mlp_norm``), ``"post"`` (``sa_scale``,
            ``mlp_scale``) or ``"sandwich"`` (all four).
        qk_norm: ``None``, ``"head"`` (``[head_dim]`` scale) or ``"projection"``
            (``[heads * head_dim]`` scale).
        query_factor: multiplies the queries before RoPE (1: SDPA's ``head_dim ** -0.5``).
        scaled_query: the query projection is a :class:`~.layers.NormedProjection` even with
            factor 1 and no norm (weight names ``q_proj.proj.weight``).
        attn_softcap: every layer's attention-logit soft-cap, ``None``: plain attention.
        rope_bases: per layer, the RoPE theta, or ``None`` for a layer without positions.
        rope_scales: per layer, the linear position scaling; ``None``: 1 everywhere.
        rotary_dim: channels rotated per head, ``None``: all.
        rope_factors: per rotated frequency, a divisor (``longrope``); ``None``: none.
        rope_attention_factor: multiplies RoPE's cos and sin; 1: none.
        sliding_windows: per layer, the window, or ``None`` for full attention.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        embed_scale: multiplies the embeddings, ``None``: none.
        tie_word_embeddings: the output projection is the embedding table.
        pad_id: the embedding's padding index (no gradient), or ``None``.
        attn_dropout: attention dropout (training only).
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    head_dim: int
    rope_bases: tuple[float | None, ...]
    norm_eps: float = 1e-6
    norm: str = "rms"
    placement: str = "pre"
    qk_norm: str | None = None
    query_factor: float = 1.0
    scaled_query: bool = False
    attn_softcap: float | None = None
    rope_scales: tuple[float, ...] | None = None
    rotary_dim: int | None = None
    rope_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    sliding_windows: tuple[int | None, ...] | None = None
    activation: str = "silu"
    embed_scale: float | None = None
    tie_word_embeddings: bool = False
    pad_id: int | None = None
    attn_dropout: float = 0.0

    def __post_init__(self) -> None:
        if len(self.rope_bases) != self.num_layers:
            raise ValueError(f"rope_bases has {len(self.rope_bases)} entries for "
                             f"{self.num_layers} layers")
        for name in ("sliding_windows", "rope_scales"):
            value = getattr(self, name)
            if value is not None and len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers")
        if self.norm not in ("rms", "gemma") or self.placement not in _PLACEMENTS:
            raise ValueError(f"norm {self.norm!r} / placement {self.placement!r}: one of "
                             f"'rms', 'gemma' / {_PLACEMENTS}")
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm {self.qk_norm!r}: None, 'head' or 'projection'")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {sorted(_ACTIVATIONS)}")

    def make_norm(self, dim: int) -> nn.Module:
        """A norm of this family over ``dim`` channels."""
        return GemmaRMSNorm(dim, self.norm_eps) if self.norm == "gemma" else RMSNorm(
            dim, eps=self.norm_eps)


Linear = Callable[[str, int, int], nn.Module]


def _plain_linear(_name: str, d_in: int, d_out: int) -> nn.Module:
    return nn.Linear(d_in, d_out, bias=False)


def _projection(spec: DecoderSpec, proj: nn.Module, heads: int, factor: float,
                wrap: bool = False) -> nn.Module:
    if spec.qk_norm is None and factor == 1.0 and not wrap:
        return proj
    if spec.qk_norm == "head":
        return NormedProjection(proj, spec.make_norm(spec.head_dim), spec.head_dim, factor)
    if spec.qk_norm == "projection":
        return NormedProjection(proj, spec.make_norm(heads * spec.head_dim), None, factor)
    return NormedProjection(proj, None, spec.head_dim, factor)


def _ropes(spec: DecoderSpec) -> list[nn.Module | None]:
    """One shared :class:`HalfRoPE` per distinct (base, scale) (torchtune's builders share
    theirs)."""
    made: dict[tuple[float, float], HalfRoPE] = {}
    out: list[nn.Module | None] = []
    scales = spec.rope_scales or (1.0,) * spec.num_layers
    for base, scale in zip(spec.rope_bases, scales):
        if base is None:
            out.append(None)
            continue
        if (base, scale) not in made:
            made[base, scale] = HalfRoPE(spec.head_dim, spec.max_seq_len, base, scale,
                                         spec.rotary_dim, spec.rope_factors,
                                         spec.rope_attention_factor)
        out.append(made[base, scale])
    return out


def build_decoder(spec: DecoderSpec, linear: Linear = _plain_linear,
                  output: Callable[[int, int], nn.Module] | None = None) -> TransformerDecoder:
    """The decoder ``spec`` describes.

    Args:
        spec: the family's :class:`DecoderSpec`.
        linear: makes every projection, ``linear(torchtune_name, in, out)`` with names
            ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``, ``w1``, ``w2``, ``w3``
            (default: ``nn.Linear`` without bias).
        output: makes an untied output projection ``(D, V)`` (default ``nn.Linear``).

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    d, hd, h, kv = spec.embed_dim, spec.head_dim, spec.num_heads, spec.num_kv_heads
    ropes = _ropes(spec)
    memo: dict = {}
    layers = nn.ModuleList()
    for i in range(spec.num_layers):
        attention = dict(
            embed_dim=d, num_heads=h, num_kv_heads=kv, head_dim=hd,
            q_proj=_projection(spec, linear("q_proj", d, h * hd), h, spec.query_factor,
                               spec.scaled_query),
            k_proj=_projection(spec, linear("k_proj", d, kv * hd), kv, 1.0),
            v_proj=linear("v_proj", d, kv * hd),
            output_proj=linear("output_proj", h * hd, d),
            pos_embeddings=ropes[i], q_norm=None, k_norm=None, kv_cache=None,
            max_seq_len=spec.max_seq_len, attn_dropout=spec.attn_dropout,
        )
        attn = (MultiHeadAttention(**attention) if spec.attn_softcap is None
                else SoftCappedAttention(softcap=spec.attn_softcap, **attention))
        mlp = FeedForward(gate_proj=linear("w1", d, spec.intermediate_dim),
                          down_proj=linear("w2", spec.intermediate_dim, d),
                          up_proj=linear("w3", d, spec.intermediate_dim),
                          activation=_ACTIVATIONS[spec.activation]())
        pre = spec.placement in ("pre", "sandwich")
        post = spec.placement in ("post", "sandwich")
        parts = dict(attn=attn, mlp=mlp,
                     sa_norm=spec.make_norm(d) if pre else nn.Identity(),
                     mlp_norm=spec.make_norm(d) if pre else nn.Identity(),
                     sa_scale=spec.make_norm(d) if post else None,
                     mlp_scale=spec.make_norm(d) if post else None)
        window = spec.sliding_windows[i] if spec.sliding_windows else None
        if window is not None:
            layers.append(SlidingWindowLayer(window=window, memo=memo, **parts))
        else:
            layers.append(TransformerSelfAttentionLayer(**parts))
    if spec.embed_scale is None:
        tok_embeddings: nn.Embedding = nn.Embedding(spec.vocab_size, d, padding_idx=spec.pad_id)
    else:
        tok_embeddings = ScaledEmbedding(spec.vocab_size, d, spec.embed_scale,
                                         padding_idx=spec.pad_id)
    if spec.tie_word_embeddings:
        head: nn.Module = TiedLinear(tok_embeddings)
    elif output is not None:
        head = output(d, spec.vocab_size)
    else:
        head = nn.Linear(d, spec.vocab_size, bias=False)
    return TransformerDecoder(tok_embeddings=tok_embeddings, layers=layers,
                              max_seq_len=spec.max_seq_len, num_heads=h, head_dim=hd,
                              norm=spec.make_norm(d), output=head)


def build_lora_decoder(spec: DecoderSpec, lora_attn_modules: Sequence[str],
                       apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False, *,
                       lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0,
                       use_dora: bool = False, quantize_base: bool = False
                       ) -> TransformerDecoder:
    """:func:`build_decoder` with LoRA (or DoRA) adapters where torchtune's ``lora_*`` builders put
    them; a q/k norm applies after the adapter's sum.

    Args:
        spec: the family's :class:`DecoderSpec`.
        lora_attn_modules: one or more of ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied models only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    unknown = sorted(set(lora_attn_modules) - set(LORA_ATTN_MODULES))
    if not lora_attn_modules or unknown:
        raise ValueError(f"lora_attn_modules {list(lora_attn_modules)}: name one or more of "
                         f"{list(LORA_ATTN_MODULES)}")
    if apply_lora_to_output and spec.tie_word_embeddings:
        raise ValueError("apply_lora_to_output is incompatible with tied embeddings "
                         "(tie_word_embeddings: true): the output projection is the embedding")
    adapter_cls = DoRALinear if use_dora else LoRALinear
    adapted = set(lora_attn_modules) | ({"w1", "w2", "w3"} if apply_lora_to_mlp else set())
    make_adapter = partial(adapter_cls, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)

    def linear(name: str, d_in: int, d_out: int) -> nn.Module:
        if name in adapted:
            return make_adapter(d_in, d_out, quantize_base=quantize_base)
        return nn.Linear(d_in, d_out, bias=False)

    model = build_decoder(spec, linear, (lambda d_in, d_out: make_adapter(d_in, d_out))
                          if apply_lora_to_output else None)
    if quantize_base:
        model._register_state_dict_hook(partial(
            reparametrize_as_dtype_state_dict_post_hook,
            dtype=model.tok_embeddings.weight.dtype, offload_to_cpu=True))
    return model
