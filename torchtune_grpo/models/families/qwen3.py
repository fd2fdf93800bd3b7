"""Qwen3 (dense, ``Qwen3ForCausalLM``) as a torchtune decoder.

A Qwen3 layer is a Qwen2 layer without QKV biases, with an explicit ``head_dim`` (Qwen3-0.6B:
``hidden_size`` 1024, 16 heads of 128) and one difference that matters: every query head and
every key head is RMS-normalised over its ``head_dim`` channels (one learned scale per
channel, shared by the heads) **right after the projection and before RoPE**.

torchtune 0.6.1's :class:`~torchtune.modules.MultiHeadAttention` has ``q_norm``/``k_norm`` but
applies them after the rotary embedding (torchtune issue #2809); RMSNorm does not commute with
a rotation once its scale is not uniform, so that order gives other logits. Here the attention
module is torchtune's own, with ``q_norm = k_norm = None``, and the norm is part of the query
and key projections instead (:class:`HeadNormProjection`: linear, then the per-head RMSNorm).
Every consumer of the attention module (torchtune's forward, the native engine's grouped-query
attention in :mod:`torchtune_grpo.rollout.kv_cache`, packed training forwards) calls
``q_proj(x)`` / ``k_proj(x)`` and rotates what they return, so all of them compute Qwen3's
order without knowing about it.

The CPU decode backend fuses only layers whose projections are plain ``nn.Linear``
(:func:`torchtune_grpo.backends.cpu_decode.fused_decode_layer`); Qwen3 layers are not fused and
decode through the layer's own forward, each inner ``nn.Linear`` on oneDNN-packed weights.

:func:`check_qwen3_config` is what :func:`torchtune_grpo.models.hf_architecture` asks of a
Qwen3 ``config.json``; :func:`qwen3` and :func:`lora_qwen3` build the model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
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

__all__ = ["HeadNormProjection", "check_qwen3_config", "lora_qwen3", "qwen3"]

#: The HF class this module builds.
QWEN3_ARCHITECTURE = "Qwen3ForCausalLM"
#: Attention modules LoRA may adapt (torchtune's names).
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")


def check_qwen3_config(cfg: dict[str, Any], *, where: str, heads: int,
                       rope_scaling: dict[str, Any] | None) -> int:
    """Refuse the Qwen3 ``config.json`` fields this implementation does not compute.

    Args:
        cfg: the parsed ``config.json``.
        where: how to name the file in messages.
        heads: ``num_attention_heads``.
        rope_scaling: the folder's RoPE scaling (``rope_scaling`` or a non-default
            ``rope_parameters``), None for plain RoPE.

    Returns:
        ``head_dim``: the config's, else ``hidden_size // num_attention_heads``.

    Raises:
        ValueError: one line naming the field and what is supported: RoPE scaling,
            ``use_sliding_window: true`` or a sliding ``layer_types`` entry,
            ``attention_bias: true``, ``hidden_act`` other than ``silu``.
    """
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for "
                         f"{QWEN3_ARCHITECTURE}; supported: none (plain RoPE)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported for "
                         f"{QWEN3_ARCHITECTURE}; supported: false (full attention)")
    sliding = [t for t in (cfg.get("layer_types") or []) if t != "full_attention"]
    if sliding:
        raise ValueError(f"{where}: layer_types holds {sliding[0]!r}, which is not supported for "
                         f"{QWEN3_ARCHITECTURE}; supported: 'full_attention' only")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for "
                         f"{QWEN3_ARCHITECTURE}; supported: false")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        return int(cfg["hidden_size"]) // heads
    if int(head_dim) <= 0 or int(head_dim) % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be a positive even number (RoPE "
                         "rotates channel pairs)")
    return int(head_dim)


class HeadNormProjection(nn.Module):
    """A query or key projection followed by Qwen3's per-head RMSNorm.

    ``y = proj(x)`` is viewed as ``[..., heads, head_dim]`` and each head is RMS-normalised over
    its ``head_dim`` channels with one learned ``[head_dim]`` scale shared by the heads, then
    flattened back. The attention module rotates the result, so the norm precedes RoPE.

    Args:
        proj: the projection, ``[..., in_dim] -> [..., heads * head_dim]`` (``nn.Linear``,
            or a LoRA/DoRA linear).
        head_dim: channels per head.
        eps: the RMSNorm epsilon (``rms_norm_eps``).

    Attributes:
        proj: as given (state-dict prefix ``proj.``).
        norm: the :class:`~torchtune.modules.RMSNorm` (``norm.scale``: ``[head_dim]``).
    """

    def __init__(self, proj: nn.Module, head_dim: int, eps: float) -> None:
        super().__init__()
        self.proj = proj
        self.head_dim = head_dim
        self.norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, in_dim] -> [b, s, heads * head_dim]``, each head normalised."""
        y = self.proj(x)
        return self.norm(y.unflatten(-1, (-1, self.head_dim))).flatten(-2)


def _mlp(dim: int, hidden: int, linear: Callable[[str, int, int], nn.Module]) -> FeedForward:
    return FeedForward(gate_proj=linear("w1", dim, hidden), down_proj=linear("w2", hidden, dim),
                       up_proj=linear("w3", dim, hidden))


def _decoder(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
             embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int,
             rope_base: float, norm_eps: float, tie_word_embeddings: bool, attn_dropout: float,
             linear: Callable[[str, int, int], nn.Module],
             output: Callable[[int, int], nn.Module] | None) -> TransformerDecoder:
    """The decoder, every projection made by ``linear(torchtune_name, in, out)``."""
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = MultiHeadAttention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=HeadNormProjection(linear("q_proj", embed_dim, num_heads * head_dim),
                                      head_dim, norm_eps),
            k_proj=HeadNormProjection(linear("k_proj", embed_dim, num_kv_heads * head_dim),
                                      head_dim, norm_eps),
            v_proj=linear("v_proj", embed_dim, num_kv_heads * head_dim),
            output_proj=linear("output_proj", num_heads * head_dim, embed_dim),
            pos_embeddings=rope,
            q_norm=None,  # in q_proj / k_proj: before RoPE
            k_norm=None,
            kv_cache=None,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
        )
        layers.append(TransformerSelfAttentionLayer(
            attn=attn,
            mlp=_mlp(embed_dim, intermediate_dim, linear),
            sa_norm=RMSNorm(embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
        ))
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        head: nn.Module = TiedLinear(tok_embeddings)
    elif output is not None:
        head = output(embed_dim, vocab_size)
    else:
        head = nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=head,
    )


def qwen3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A dense Qwen3 decoder (see the module docstring for the attention).

    Args:
        vocab_size: ``V``.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (a divisor of ``num_heads``).
        embed_dim: ``D``, the residual width (``hidden_size``).
        intermediate_dim: the gated MLP's width.
        max_seq_len: context length (RoPE cache, KV caches).
        head_dim: channels per head; ``None``: ``embed_dim // num_heads``.
        attn_dropout: attention dropout (training only).
        norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
        rope_base: RoPE ``theta``.
        tie_word_embeddings: the output projection is the embedding table.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    return _decoder(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_base=rope_base, norm_eps=norm_eps, tie_word_embeddings=tie_word_embeddings,
        attn_dropout=attn_dropout,
        linear=lambda _name, d_in, d_out: nn.Linear(d_in, d_out, bias=False), output=None,
    )


def lora_qwen3(
    lora_attn_modules: list[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3` with LoRA (or DoRA) adapters, as torchtune's ``lora_qwen2`` places them.

    The adapted query/key projections keep their per-head norm after the adapter's sum
    (``HeadNormProjection(LoRALinear)``), so a merged checkpoint is the plain model's.

    Args:
        lora_attn_modules: attention projections that get adapters (``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``).
        apply_lora_to_mlp: adapters on the three MLP projections too.
        apply_lora_to_output: an adapter on the output projection (untied models only).
        vocab_size: as for :func:`qwen3`, like ``num_layers``, ``num_heads``,
            ``num_kv_heads``, ``embed_dim``, ``intermediate_dim``, ``max_seq_len``,
            ``head_dim``, ``attn_dropout``, ``norm_eps``, ``rope_base`` and
            ``tie_word_embeddings``.
        lora_rank: adapter rank ``r``.
        lora_alpha: adapter scale numerator (``alpha / r``).
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA instead of LoRA.
        quantize_base: NF4-quantize the adapted layers' frozen base weights.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; ``apply_lora_to_output`` with tied
            embeddings.
    """
    unknown = sorted(set(lora_attn_modules) - set(LORA_ATTN_MODULES))
    if not lora_attn_modules or unknown:
        raise ValueError(f"lora_attn_modules {list(lora_attn_modules)}: name one or more of "
                         f"{list(LORA_ATTN_MODULES)}")
    if apply_lora_to_output and tie_word_embeddings:
        raise ValueError("apply_lora_to_output is incompatible with tied embeddings "
                         "(tie_word_embeddings: true): the output projection is the embedding")
    adapter_cls = DoRALinear if use_dora else LoRALinear
    adapted = set(lora_attn_modules) | ({"w1", "w2", "w3"} if apply_lora_to_mlp else set())
    make_adapter = partial(adapter_cls, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)

    def linear(name: str, d_in: int, d_out: int) -> nn.Module:
        if name in adapted:
            return make_adapter(d_in, d_out, quantize_base=quantize_base)
        return nn.Linear(d_in, d_out, bias=False)

    model = _decoder(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_base=rope_base, norm_eps=norm_eps, tie_word_embeddings=tie_word_embeddings,
        attn_dropout=attn_dropout, linear=linear,
        output=(lambda d_in, d_out: make_adapter(d_in, d_out)) if apply_lora_to_output else None,
    )
    if quantize_base:  # as torchtune's LoRA builders: full-precision weights in the state dict
        model._register_state_dict_hook(partial(
            reparametrize_as_dtype_state_dict_post_hook,
            dtype=model.tok_embeddings.weight.dtype, offload_to_cpu=True))
    return model
