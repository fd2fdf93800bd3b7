"""Mistral (``MistralForCausalLM``, ``model_type: mistral``) as a torchtune decoder.

A Llama layer with an explicit ``head_dim`` and an optional ``sliding_window`` on every layer
(the last ``sliding_window`` keys, the query included). Weights keep the HF layout, one to one
(:data:`MISTRAL_NAMES`, checkpointer ``model_type`` ``MISTRAL_HF``); ``docs/models.md`` has the
details.
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

__all__ = ["MISTRAL_NAMES", "MistralHFCheckpointer", "check_mistral_config", "lora_mistral",
           "mistral"]

#: The HF class this module builds.
MISTRAL_ARCHITECTURE = "MistralForCausalLM"

#: HF names outside the layers -> torchtune names (shared with
#: :mod:`~torchtune_grpo.models.families.smollm3`, whose layers are named the same).
LLAMA_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
#: Suffix after ``model.layers.{i}.`` -> suffix after ``layers.{i}.`` of a Llama-shaped layer
#: (plain projections, two pre-norms).
LLAMA_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
MISTRAL_NAMES = WeightNames(
    family="Mistral", model_type="MISTRAL_HF", global_names=LLAMA_GLOBAL_NAMES,
    layer_names=LLAMA_LAYER_NAMES, tied_by_default=False,
    not_part="part of a MistralForCausalLM (no biases, no experts)")


def MistralHFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Mistral HF folders (what ``hf_checkpointer`` returns for
    ``model_type: MISTRAL_HF``): :class:`HFFamilyCheckpointer` with :data:`MISTRAL_NAMES`."""
    return HFFamilyCheckpointer(MISTRAL_NAMES, **kwargs)


def refuse_llama_extras(cfg: dict[str, Any], *, where: str, arch: str,
                        rope_scaling: dict[str, Any] | None) -> None:
    """The refusals Mistral and SmolLM3 share: RoPE scaling, biases, another activation.

    Raises:
        ValueError: one line naming the field and what is supported.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported for "
                         f"{arch}; supported: 'silu'")
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for {arch}; "
                         "supported: none (plain RoPE)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key}=true is not supported for {arch}; supported: "
                             "false")


def config_head_dim(cfg: dict[str, Any], *, where: str, heads: int) -> int:
    """``head_dim`` of ``cfg``, else ``hidden_size // heads``.

    Raises:
        ValueError: not a positive even number (RoPE rotates channel pairs).
    """
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be a positive even number (RoPE "
                         "rotates channel pairs)")
    return head_dim


def config_pad_id(cfg: dict[str, Any]) -> int | None:
    """``pad_token_id`` when it is a row of the embedding table (``transformers`` makes it the
    embedding's ``padding_idx``: no gradient), else ``None``."""
    pad = cfg.get("pad_token_id")
    return int(pad) if pad is not None and 0 <= int(pad) < int(cfg["vocab_size"]) else None


def check_mistral_config(cfg: dict[str, Any], *, where: str, heads: int,
                         rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Refuse the Mistral ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``head_dim``, ``sliding_window`` (an int or None) and ``pad_id``.

    Raises:
        ValueError: one line naming the field: RoPE scaling,
            ``attention_bias``/``mlp_bias`` true, ``hidden_act`` other than ``silu``,
            ``layer_types``, a ``sliding_window`` that is not a positive integer, an odd
            ``head_dim``.
    """
    refuse_llama_extras(cfg, where=where, arch=MISTRAL_ARCHITECTURE, rope_scaling=rope_scaling)
    if cfg.get("layer_types") is not None:
        raise ValueError(f"{where}: layer_types is not supported for {MISTRAL_ARCHITECTURE} "
                         "(alternating layers are MinistralForCausalLM's); supported: absent "
                         "(sliding_window applies to every layer)")
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"{where}: sliding_window {window!r} is not supported for "
                         f"{MISTRAL_ARCHITECTURE}; supported: null or a positive integer")
    return dict(head_dim=config_head_dim(cfg, where=where, heads=heads),
                sliding_window=window, pad_id=config_pad_id(cfg))


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int | None = None,
          sliding_window: int | None = None, attn_dropout: float = 0.0,
          norm_eps: float = 1e-6, rope_base: float = 10_000.0,
          tie_word_embeddings: bool = False, pad_id: int | None = None) -> DecoderSpec:
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_bases=(float(rope_base),) * num_layers, norm_eps=norm_eps,
        sliding_windows=None if sliding_window is None else (int(sliding_window),) * num_layers,
        tie_word_embeddings=tie_word_embeddings, pad_id=pad_id, attn_dropout=attn_dropout)


def mistral(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 10_000.0,
    tie_word_embeddings: bool = False,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """A Mistral decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len: the dimensions.
        head_dim: channels per head; ``None``: ``embed_dim // num_heads``.
        sliding_window: keys every layer sees (the query included); ``None``: full attention.
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


def lora_mistral(
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
    """:func:`mistral` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`mistral`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = MISTRAL_ARCHITECTURE
NAMES = MISTRAL_NAMES
build, build_lora = mistral, lora_mistral


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The Mistral builder arguments beyond the common ones (``head_dim``, ``sliding_window``,
    ``pad_id``), or a one-line ``ValueError`` (:func:`check_mistral_config`)."""
    return check_mistral_config(cfg, where=where, heads=heads, rope_scaling=rope_scaling)
