"""Qwen3 (dense, ``Qwen3ForCausalLM``) as a torchtune decoder.

A Qwen2 layer without QKV biases, with an explicit ``head_dim`` and a per-head RMSNorm on
queries and keys before RoPE, held inside the projections
(:class:`~.layers.NormedProjection`) so every attention path applies it in that order.
Weights map one to one (:data:`QWEN3_NAMES`); ``docs/models.md`` has the details.
"""

from __future__ import annotations

from typing import Any

from torchtune.modules import TransformerDecoder

from torchtune_grpo.models.decoder import (
    DecoderSpec,
    build_decoder,
    build_lora_decoder,
)
from torchtune_grpo.models.hf_weights import HFFamilyCheckpointer, WeightNames

__all__ = ["QWEN3_NAMES", "Qwen3HFCheckpointer", "check_qwen3_config", "lora_qwen3", "qwen3"]

#: The HF class this module builds.
QWEN3_ARCHITECTURE = "Qwen3ForCausalLM"

_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # suffix after model.layers.{i}. -> suffix after layers.{i}.
    "self_attn.q_proj.weight": "attn.q_proj.proj.weight",
    "self_attn.q_norm.weight": "attn.q_proj.norm.scale",
    "self_attn.k_proj.weight": "attn.k_proj.proj.weight",
    "self_attn.k_norm.weight": "attn.k_proj.norm.scale",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
QWEN3_NAMES = WeightNames(
    family="Qwen3", model_type="QWEN3", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=False, not_part="part of a dense Qwen3ForCausalLM (no biases, no experts)")


def Qwen3HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Qwen3 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: QWEN3``): :class:`HFFamilyCheckpointer` with :data:`QWEN3_NAMES`."""
    return HFFamilyCheckpointer(QWEN3_NAMES, **kwargs)


def check_qwen3_config(cfg: dict[str, Any], *, where: str, heads: int,
                       rope_scaling: dict[str, Any] | None) -> int:
    """Refuse the Qwen3 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``head_dim``: the config's, else ``hidden_size // num_attention_heads``.

    Raises:
        ValueError: one line naming the field: RoPE scaling,
            ``use_sliding_window: true`` or a sliding ``layer_types`` entry,
            ``attention_bias: true``, ``hidden_act`` other than ``silu``.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported for "
                         f"{QWEN3_ARCHITECTURE}; supported: 'silu'")
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


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int | None = None,
          attn_dropout: float = 0.0, norm_eps: float = 1e-6, rope_base: float = 1_000_000.0,
          tie_word_embeddings: bool = False) -> DecoderSpec:
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_bases=(float(rope_base),) * num_layers, norm_eps=norm_eps, qk_norm="head",
        tie_word_embeddings=tie_word_embeddings, attn_dropout=attn_dropout)


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
    """A dense Qwen3 decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len: the dimensions.
        head_dim: channels per head; ``None``: ``embed_dim // num_heads``.
        attn_dropout: attention dropout (training only).
        norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
        rope_base: RoPE ``theta``.
        tie_word_embeddings: the output projection is the embedding table.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    return build_decoder(_spec(**locals()))


def lora_qwen3(
    lora_attn_modules: list[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    **model: Any,
) -> TransformerDecoder:
    """:func:`qwen3` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`qwen3`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = QWEN3_ARCHITECTURE
NAMES = QWEN3_NAMES
build, build_lora = qwen3, lora_qwen3


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The Qwen3 builder arguments beyond the common ones (``head_dim``), or a one-line
    ``ValueError`` (:func:`check_qwen3_config`)."""
    return {"head_dim": check_qwen3_config(cfg, where=where, heads=heads,
                                           rope_scaling=rope_scaling)}
