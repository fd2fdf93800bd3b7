"""Gemma 3 (text, ``Gemma3ForCausalLM``, ``model_type: gemma3_text``) as a torchtune decoder.

Four Gemma RMSNorms per layer (``x * (1 + w)``, ``placement="sandwich"``), per-head q/k norms
before RoPE, the query scaled to ``query_pre_attn_scalar ** -0.5``, sliding and global layers
with their own RoPE bases, scaled embeddings and a GELU-tanh MLP. Weights map one to one
(:data:`GEMMA3_NAMES`); ``docs/models.md`` has the details.
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

__all__ = ["GEMMA3_NAMES", "Gemma3HFCheckpointer", "check_gemma3_config", "gemma3",
           "lora_gemma3"]

GEMMA3_ARCHITECTURE = "Gemma3ForCausalLM"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")

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
    "post_attention_layernorm.weight": "sa_scale.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
}

#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
GEMMA3_NAMES = WeightNames(
    family="Gemma 3", model_type="GEMMA3", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=True, not_part="part of a text-only Gemma3ForCausalLM")


def Gemma3HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Gemma 3 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: GEMMA3``): :class:`HFFamilyCheckpointer` with :data:`GEMMA3_NAMES`."""
    return HFFamilyCheckpointer(GEMMA3_NAMES, **kwargs)


def _rope(params: Any, where: str, key: str) -> tuple[float, float]:
    """``(theta, linear factor)`` of one ``rope_parameters`` entry."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"{where}: {key} rope_type {kind!r} is not supported for "
                         f"{GEMMA3_ARCHITECTURE}; supported: 'default', 'linear'")
    return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" \
        else 1.0


def check_gemma3_config(cfg: dict[str, Any], *, where: str, heads: int) -> dict[str, Any]:
    """Refuse the Gemma 3 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads: the parsed ``config.json``, the file's name in messages,
            ``num_attention_heads``.

    Returns:
        ``head_dim``, ``query_pre_attn_scalar``, ``sliding_window``, ``layer_types``,
        ``rope_base``, ``rope_scale``, ``local_rope_base``, ``pad_id``.

    Raises:
        ValueError: one line naming the field: soft-capping,
            bidirectional attention, attention biases, another activation, another RoPE type,
            an unknown layer type.
    """
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{where}: {key}={cfg[key]} is not supported for "
                             f"{GEMMA3_ARCHITECTURE}; supported: null")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=true is not supported; "
                         "supported: false (causal)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for "
                         f"{GEMMA3_ARCHITECTURE}; supported: false")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_activation {act!r} is not supported; supported: "
                         "'gelu_pytorch_tanh'")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    types = list(types)
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad or len(types) != layers:
        raise ValueError(f"{where}: layer_types must list 'sliding_attention' or "
                         f"'full_attention' for each of {layers} layers; got {types}")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise ValueError(f"{where}: sliding_window is missing; sliding layers need it")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        base, scale = _rope(params.get("full_attention") or {"rope_theta": 1e6}, where,
                            "rope_parameters.full_attention")
        local, local_scale = _rope(params.get("sliding_attention") or {"rope_theta": 1e4},
                                   where, "rope_parameters.sliding_attention")
        if local_scale != 1.0:
            raise ValueError(f"{where}: rope_parameters.sliding_attention scaling is not "
                             "supported; supported: default")
    else:  # transformers 4 style
        base = float(cfg.get("rope_theta", 1e6))
        local = float(cfg.get("rope_local_base_freq", 1e4))
        scaling = cfg.get("rope_scaling") or {"rope_type": "default", "rope_theta": base}
        _, scale = _rope({**scaling, "rope_theta": base}, where, "rope_scaling")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be even (RoPE rotates pairs)")
    pad = cfg.get("pad_token_id")
    return dict(head_dim=head_dim,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
                sliding_window=int(window) if window else None, layer_types=types,
                rope_base=base, rope_scale=scale, local_rope_base=local,
                pad_id=int(pad) if pad is not None and int(pad) < int(cfg["vocab_size"])
                else None)


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int,
          query_pre_attn_scalar: float, sliding_window: int | None, layer_types: list[str],
          rope_base: float = 1_000_000.0, rope_scale: float = 1.0,
          local_rope_base: float = 10_000.0, norm_eps: float = 1e-6,
          tie_word_embeddings: bool = True, attn_dropout: float = 0.0,
          pad_id: int | None = None) -> DecoderSpec:
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    sliding = [kind == "sliding_attention" for kind in layer_types]
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim, norm_eps=norm_eps, norm="gemma",
        placement="sandwich", qk_norm="head",
        query_factor=query_factor(head_dim, query_pre_attn_scalar),
        rope_bases=tuple(local_rope_base if s else rope_base for s in sliding),
        rope_scales=tuple(1.0 if s else rope_scale for s in sliding),
        sliding_windows=tuple(sliding_window if s else None for s in sliding),
        activation="gelu_tanh", embed_scale=embed_dim**0.5,
        tie_word_embeddings=tie_word_embeddings, pad_id=pad_id, attn_dropout=attn_dropout)


def gemma3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    query_pre_attn_scalar: float,
    sliding_window: int | None,
    layer_types: list[str],
    rope_base: float = 1_000_000.0,
    rope_scale: float = 1.0,
    local_rope_base: float = 10_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    attn_dropout: float = 0.0,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """A Gemma 3 text decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len, head_dim: the dimensions.
        query_pre_attn_scalar: attention scores are scaled by its inverse square root.
        sliding_window: keys a sliding layer sees (query included).
        layer_types: ``"sliding_attention"`` / ``"full_attention"`` per layer.
        rope_base: global layers' RoPE theta; rope_scale: their linear scaling factor.
        local_rope_base: sliding layers' RoPE theta.
        norm_eps: every norm's epsilon. tie_word_embeddings: output = embedding table.
        attn_dropout: attention dropout. pad_id: the embedding's padding index (no gradient).

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    return build_decoder(_spec(**locals()))


def lora_gemma3(
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
    """:func:`gemma3` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`gemma3`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = GEMMA3_ARCHITECTURE
NAMES = GEMMA3_NAMES
build, build_lora = gemma3, lora_gemma3


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The Gemma 3 builder arguments beyond the common ones (:func:`check_gemma3_config`;
    ``tie_word_embeddings`` defaults to true). ``rope_scaling`` is read per layer kind there."""
    extra = check_gemma3_config(cfg, where=where, heads=heads)
    if cfg.get("tie_word_embeddings") is None:
        extra["tie_word_embeddings"] = True
    return extra
