"""Phi-3 and Phi-4 (``Phi3ForCausalLM``, ``model_type: phi3``) as a torchtune decoder.

A Llama layer whose HF weights fuse ``qkv_proj`` and ``gate_up_proj`` (split on load, stacked
on save: :class:`~.hf_weights.Fused` entries of :data:`PHI3_NAMES`), with partial rotary,
LongRoPE up to ``original_max_position_embeddings`` (a longer ``max_seq_len`` is refused) and
an optional sliding window. ``docs/models.md`` has the details.
"""

from __future__ import annotations

import math
from typing import Any

from torchtune.modules import TransformerDecoder

from torchtune_grpo.models.decoder import (
    DecoderSpec,
    build_decoder,
    build_lora_decoder,
)
from torchtune_grpo.models.hf_weights import Fused, HFFamilyCheckpointer, WeightNames

__all__ = ["PHI3_ARCHITECTURE", "PHI3_NAMES", "Phi3HFCheckpointer", "check_phi3_config",
           "lora_phi3", "phi3"]

#: The HF class this module builds.
PHI3_ARCHITECTURE = "Phi3ForCausalLM"
_LONGROPE = ("longrope", "su")

_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # suffix after model.layers.{i}. -> suffix after layers.{i}.
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}


def _qkv_rows(cfg: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg["hidden_size"]) // heads
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    return heads * head_dim, kv, kv


def _gate_up_rows(cfg: dict[str, Any]) -> tuple[int, int]:
    return int(cfg["intermediate_size"]), int(cfg["intermediate_size"])


#: This family's names: one to one, and the two fused HF tensors split into torchtune's parts.
PHI3_NAMES = WeightNames(
    family="Phi-3", model_type="PHI3", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=False, not_part="part of a Phi3ForCausalLM (no biases, no experts)",
    fused={
        "self_attn.qkv_proj.weight": Fused(
            ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"), _qkv_rows),
        "mlp.gate_up_proj.weight": Fused(("mlp.w1.weight", "mlp.w3.weight"), _gate_up_rows),
    })


def Phi3HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Phi-3/Phi-4 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: PHI3``): :class:`HFFamilyCheckpointer` with :data:`PHI3_NAMES`."""
    return HFFamilyCheckpointer(PHI3_NAMES, **kwargs)


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any], where: str, rotary_dim: int
              ) -> dict[str, Any]:
    """``rope_factors``, ``rope_attention_factor``, ``rope_original_max`` of a LongRoPE config."""
    short = scaling.get("short_factor")
    if not isinstance(short, list) or len(short) != rotary_dim // 2:
        raise ValueError(f"{where}: rope_scaling.short_factor must list {rotary_dim // 2} "
                         f"numbers (one per rotated frequency); got {short!r}")
    # transformers prefers the top-level field (Phi3Config's default 4096) over rope_scaling's
    original = int(cfg.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or 4096)
    factor = scaling.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings") or original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    return dict(rope_factors=tuple(float(f) for f in short),
                rope_attention_factor=float(attention), rope_original_max=original)


def check_phi3_config(cfg: dict[str, Any], *, where: str, heads: int,
                      rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Refuse the Phi-3 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``rotary_dim``, ``sliding_window``, ``pad_id``, and for LongRoPE ``rope_factors``,
        ``rope_attention_factor``, ``rope_original_max``.

    Raises:
        ValueError: one line naming the field: a RoPE scaling
            other than ``longrope``, ``hidden_act`` other than ``silu``, residual or embedding
            dropout, a ``head_dim`` other than ``hidden_size / num_attention_heads``, a
            ``partial_rotary_factor`` that rotates an odd or zero number of channels.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported for "
                         f"{PHI3_ARCHITECTURE}; supported: 'silu'")
    for key in ("resid_pdrop", "embd_pdrop"):
        if float(cfg.get(key) or 0.0):
            raise ValueError(f"{where}: {key}={cfg[key]} is not supported for "
                             f"{PHI3_ARCHITECTURE}; supported: 0.0 (no dropout)")
    head_dim = int(cfg["hidden_size"]) // heads
    if cfg.get("head_dim") is not None and int(cfg["head_dim"]) != head_dim:
        raise ValueError(f"{where}: head_dim {cfg['head_dim']} is not supported for "
                         f"{PHI3_ARCHITECTURE}; supported: hidden_size / num_attention_heads "
                         f"= {head_dim}")
    params = cfg.get("rope_parameters") or {}
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
                   or 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{where}: partial_rotary_factor {factor} rotates {rotary_dim} of "
                         f"{head_dim} channels; supported: a positive even number")
    extra: dict[str, Any] = {}
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in _LONGROPE:
            raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for "
                             f"{PHI3_ARCHITECTURE}; supported: none (plain RoPE) or 'longrope'")
        extra = _longrope(cfg, rope_scaling, where, rotary_dim)
    window = cfg.get("sliding_window")
    pad = cfg.get("pad_token_id")
    return dict(rotary_dim=None if rotary_dim == head_dim else rotary_dim,
                sliding_window=int(window) if window else None,
                pad_id=int(pad) if pad is not None and 0 <= int(pad) < int(cfg["vocab_size"])
                else None, **extra)


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int,
          rotary_dim: int | None = None, sliding_window: int | None = None,
          rope_factors: tuple[float, ...] | None = None, rope_attention_factor: float = 1.0,
          rope_original_max: int | None = None, attn_dropout: float = 0.0,
          norm_eps: float = 1e-5, rope_base: float = 10_000.0,
          tie_word_embeddings: bool = False, pad_id: int | None = None) -> DecoderSpec:
    if rope_original_max is not None and max_seq_len > rope_original_max:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds original_max_position_embeddings "
                         f"{rope_original_max}: LongRoPE is computed with its short factors "
                         f"only; set model.max_seq_len to at most {rope_original_max}")
    window = sliding_window if sliding_window and sliding_window < max_seq_len else None
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=embed_dim // num_heads,
        rope_bases=(float(rope_base),) * num_layers, norm_eps=norm_eps, rotary_dim=rotary_dim,
        rope_factors=None if rope_factors is None else tuple(rope_factors),
        rope_attention_factor=rope_attention_factor,
        sliding_windows=None if window is None else (window,) * num_layers,
        tie_word_embeddings=tie_word_embeddings, pad_id=pad_id, attn_dropout=attn_dropout)


def phi3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    rotary_dim: int | None = None,
    sliding_window: int | None = None,
    rope_factors: tuple[float, ...] | None = None,
    rope_attention_factor: float = 1.0,
    rope_original_max: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 10_000.0,
    tie_word_embeddings: bool = False,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """A Phi-3 / Phi-4 decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len: the dimensions (``head_dim = D // num_heads``).
        rotary_dim: channels RoPE turns per head; ``None``: all.
        sliding_window: keys each query sees (itself included), ``None``: all.
        rope_factors: LongRoPE's ``short_factor`` (divides each frequency), ``None``: none.
        rope_attention_factor: LongRoPE's cos/sin factor.
        rope_original_max: LongRoPE's ``original_max_position_embeddings``.
        attn_dropout: attention dropout (training only).
        norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
        rope_base: RoPE ``theta``.
        tie_word_embeddings: the output projection is the embedding table.
        pad_id: the embedding's padding index (no gradient), or ``None``.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.

    Raises:
        ValueError: ``max_seq_len`` beyond ``rope_original_max``.
    """
    return build_decoder(_spec(**locals()))


def lora_phi3(
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
    """:func:`phi3` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`phi3`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings;
            ``max_seq_len`` beyond ``rope_original_max``.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = PHI3_ARCHITECTURE
NAMES = PHI3_NAMES
build, build_lora = phi3, lora_phi3


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The Phi-3 builder arguments beyond the common ones, or a one-line ``ValueError``
    (:func:`check_phi3_config`)."""
    return check_phi3_config(cfg, where=where, heads=heads, rope_scaling=rope_scaling)
