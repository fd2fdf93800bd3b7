"""OLMo 2 (``Olmo2ForCausalLM``, ``model_type: olmo2``) as a torchtune decoder.

A Llama layer with its norms on the attention and MLP outputs instead of their inputs
(``placement="post"``) and a q/k RMSNorm over the whole projection before RoPE
(``qk_norm="projection"``). Weights map one to one (:data:`OLMO2_NAMES`); ``docs/models.md``
has the details.
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

__all__ = ["OLMO2_ARCHITECTURE", "OLMO2_NAMES", "Olmo2HFCheckpointer", "check_olmo2_config",
           "lora_olmo2", "olmo2"]

#: The HF class this module builds.
OLMO2_ARCHITECTURE = "Olmo2ForCausalLM"

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
    "post_attention_layernorm.weight": "sa_scale.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
}
#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
OLMO2_NAMES = WeightNames(
    family="OLMo 2", model_type="OLMO2", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=False, not_part="part of an Olmo2ForCausalLM (no biases, no experts)")


def Olmo2HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of OLMo 2 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: OLMO2``): :class:`HFFamilyCheckpointer` with :data:`OLMO2_NAMES`."""
    return HFFamilyCheckpointer(OLMO2_NAMES, **kwargs)


def check_olmo2_config(cfg: dict[str, Any], *, where: str, heads: int,
                       rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Refuse the OLMo 2 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``head_dim`` and ``pad_id``.

    Raises:
        ValueError: one line naming the field: RoPE scaling,
            ``attention_bias: true``, ``hidden_act`` other than ``silu``, an odd ``head_dim``.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported for "
                         f"{OLMO2_ARCHITECTURE}; supported: 'silu'")
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for "
                         f"{OLMO2_ARCHITECTURE}; supported: none (plain RoPE)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for "
                         f"{OLMO2_ARCHITECTURE}; supported: false")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be a positive even number (RoPE "
                         "rotates channel pairs)")
    pad = cfg.get("pad_token_id")
    return dict(head_dim=head_dim,
                pad_id=int(pad) if pad is not None and 0 <= int(pad) < int(cfg["vocab_size"])
                else None)


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int | None = None,
          attn_dropout: float = 0.0, norm_eps: float = 1e-6, rope_base: float = 500_000.0,
          tie_word_embeddings: bool = False, pad_id: int | None = None) -> DecoderSpec:
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_bases=(float(rope_base),) * num_layers, norm_eps=norm_eps, placement="post",
        qk_norm="projection", tie_word_embeddings=tie_word_embeddings, pad_id=pad_id,
        attn_dropout=attn_dropout)


def olmo2(
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
    rope_base: float = 500_000.0,
    tie_word_embeddings: bool = False,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """An OLMo 2 decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len: the dimensions.
        head_dim: channels per head; ``None``: ``embed_dim // num_heads``.
        attn_dropout: attention dropout (training only).
        norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
        rope_base: RoPE ``theta``.
        tie_word_embeddings: the output projection is the embedding table.
        pad_id: the embedding's padding index (no gradient), or ``None``.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    return build_decoder(_spec(**locals()))


def lora_olmo2(
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
    """:func:`olmo2` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`olmo2`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = OLMO2_ARCHITECTURE
NAMES = OLMO2_NAMES
build, build_lora = olmo2, lora_olmo2


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The OLMo 2 builder arguments beyond the common ones (``head_dim``, ``pad_id``), or a
    one-line ``ValueError`` (:func:`check_olmo2_config`)."""
    return check_olmo2_config(cfg, where=where, heads=heads, rope_scaling=rope_scaling)
