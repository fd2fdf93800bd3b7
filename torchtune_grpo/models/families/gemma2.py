"""Gemma 2 (``Gemma2ForCausalLM``, ``model_type: gemma2``) as a torchtune decoder.

Gemma 3's layer without q/k norms, with one RoPE base, alternating sliding and global layers,
an attention-logit soft-cap in every attention path (:class:`~.layers.SoftCappedAttention`)
and a final-logit soft-cap applied by the policy's
:class:`~torchtune_grpo.policy.head.OutputHead`. torchtune's own Gemma 2 is not used. Weights
map one to one (:data:`GEMMA2_NAMES`); ``docs/models.md`` has the details.
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
from torchtune_grpo.models.layers import query_factor

__all__ = ["GEMMA2_NAMES", "Gemma2HFCheckpointer", "check_gemma2_config", "gemma2",
           "lora_gemma2"]

GEMMA2_ARCHITECTURE = "Gemma2ForCausalLM"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
#: ``Gemma2Config``'s defaults where ``config.json`` lacks the key (null in it: no cap).
_DEFAULTS = {"query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0,
             "attn_logit_softcapping": 50.0, "sliding_window": 4096}

_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # suffix after model.layers.{i}. -> suffix after layers.{i}.
    "self_attn.q_proj.weight": "attn.q_proj.proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "sa_scale.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
}

#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
GEMMA2_NAMES = WeightNames(
    family="Gemma 2", model_type="GEMMA2", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=True, not_part="part of a Gemma2ForCausalLM (no biases, no q/k norms)")


def Gemma2HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Gemma 2 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: GEMMA2``): :class:`HFFamilyCheckpointer` with :data:`GEMMA2_NAMES`."""
    return HFFamilyCheckpointer(GEMMA2_NAMES, **kwargs)


def _cap(cfg: dict[str, Any], key: str, where: str) -> float | None:
    value = cfg.get(key, _DEFAULTS[key])
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{where}: {key}={value} is not supported; supported: > 0 or null")
    return float(value)


def check_gemma2_config(cfg: dict[str, Any], *, where: str, heads: int,
                        rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refuse the Gemma 2 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``head_dim``, ``query_pre_attn_scalar``, ``attn_softcap``, ``sliding_window``,
        ``layer_types``, ``pad_id`` and the output head's ``final_logit_softcap``.

    Raises:
        ValueError: one line naming the field: a RoPE scaling,
            bidirectional attention, attention biases, another activation, an unknown layer
            type, a cap <= 0.
    """
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for "
                         f"{GEMMA2_ARCHITECTURE}; supported: none (plain RoPE)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=true is not supported; "
                         "supported: false (causal)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for "
                         f"{GEMMA2_ARCHITECTURE}; supported: false")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_activation {act!r} is not supported; supported: "
                         "'gelu_pytorch_tanh'")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # Gemma2Config: layers 0, 2, 4, ... slide
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    types = list(types)
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad or len(types) != layers:
        raise ValueError(f"{where}: layer_types must list 'sliding_attention' or "
                         f"'full_attention' for each of {layers} layers; got {types}")
    window = cfg.get("sliding_window", _DEFAULTS["sliding_window"])
    if "sliding_attention" in types and not window:
        raise ValueError(f"{where}: sliding_window is missing; sliding layers need it")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be even (RoPE rotates pairs)")
    scalar = cfg.get("query_pre_attn_scalar", _DEFAULTS["query_pre_attn_scalar"])
    if not scalar or float(scalar) <= 0:
        raise ValueError(f"{where}: query_pre_attn_scalar={scalar} is not supported; "
                         "supported: > 0")
    pad = cfg.get("pad_token_id")
    return dict(head_dim=head_dim, query_pre_attn_scalar=float(scalar),
                attn_softcap=_cap(cfg, "attn_logit_softcapping", where),
                final_logit_softcap=_cap(cfg, "final_logit_softcapping", where),
                sliding_window=int(window) if window else None, layer_types=types,
                pad_id=int(pad) if pad is not None and int(pad) < int(cfg["vocab_size"])
                else None)


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int,
          query_pre_attn_scalar: float, attn_softcap: float | None,
          sliding_window: int | None, layer_types: list[str], rope_base: float = 10_000.0,
          norm_eps: float = 1e-6, tie_word_embeddings: bool = True, attn_dropout: float = 0.0,
          pad_id: int | None = None) -> DecoderSpec:
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    sliding = [kind == "sliding_attention" for kind in layer_types]
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim, norm_eps=norm_eps, norm="gemma",
        placement="sandwich", qk_norm=None,
        query_factor=query_factor(head_dim, query_pre_attn_scalar), scaled_query=True,
        attn_softcap=attn_softcap, rope_bases=(rope_base,) * num_layers,
        sliding_windows=tuple(sliding_window if s else None for s in sliding),
        activation="gelu_tanh", embed_scale=embed_dim**0.5,
        tie_word_embeddings=tie_word_embeddings, pad_id=pad_id, attn_dropout=attn_dropout)


def gemma2(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    query_pre_attn_scalar: float,
    attn_softcap: float | None,
    sliding_window: int | None,
    layer_types: list[str],
    rope_base: float = 10_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    attn_dropout: float = 0.0,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """A Gemma 2 decoder; the final-logit soft-cap is the policy's output head's.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len, head_dim: the dimensions.
        query_pre_attn_scalar: attention scores are scaled by its inverse square root.
        attn_softcap: the attention-logit soft-cap (``None``: none).
        sliding_window: keys a sliding layer sees (query included).
        layer_types: ``"sliding_attention"`` / ``"full_attention"`` per layer.
        rope_base: RoPE theta (all layers).
        norm_eps: every norm's epsilon. tie_word_embeddings: output = embedding table.
        attn_dropout: attention dropout. pad_id: the embedding's padding index (no gradient).

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]`` (not soft-capped).
    """
    return build_decoder(_spec(**locals()))


def lora_gemma2(
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
    """:func:`gemma2` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`gemma2`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = GEMMA2_ARCHITECTURE
NAMES = GEMMA2_NAMES
build, build_lora = gemma2, lora_gemma2


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The Gemma 2 builder arguments beyond the common ones, and the output head's
    ``final_logit_softcap`` (:func:`check_gemma2_config`; ``tie_word_embeddings`` defaults to
    true)."""
    extra = check_gemma2_config(cfg, where=where, heads=heads, rope_scaling=rope_scaling)
    if cfg.get("tie_word_embeddings") is None:
        extra["tie_word_embeddings"] = True
    return extra
