"""SmolLM3 (``SmolLM3ForCausalLM``, ``model_type: smollm3``) as a torchtune decoder.

A Llama layer where some layers have no RoPE (``no_rope_layers``: 1 rotates, 0 does not;
default every ``no_rope_layer_interval``-th layer without) and, with ``use_sliding_window``,
sliding-window layers. Weights are named as Llama's (:data:`SMOLLM3_NAMES`);
``docs/models.md`` has the details.
"""

from __future__ import annotations

from typing import Any

from torchtune.modules import TransformerDecoder

from torchtune_grpo.models.decoder import (
    DecoderSpec,
    build_decoder,
    build_lora_decoder,
)
from torchtune_grpo.models.families.mistral import (
    LLAMA_GLOBAL_NAMES,
    LLAMA_LAYER_NAMES,
    config_head_dim,
    config_pad_id,
    refuse_llama_extras,
)
from torchtune_grpo.models.hf_weights import HFFamilyCheckpointer, WeightNames

__all__ = ["SMOLLM3_NAMES", "SmolLM3HFCheckpointer", "check_smollm3_config", "lora_smollm3",
           "smollm3"]

#: The HF class this module builds.
SMOLLM3_ARCHITECTURE = "SmolLM3ForCausalLM"
_LAYER_TYPES = ("full_attention", "sliding_attention")

#: This family's names (:class:`~torchtune_grpo.models.hf_weights.WeightNames`).
SMOLLM3_NAMES = WeightNames(
    family="SmolLM3", model_type="SMOLLM3", global_names=LLAMA_GLOBAL_NAMES,
    layer_names=LLAMA_LAYER_NAMES, tied_by_default=True,
    not_part="part of a SmolLM3ForCausalLM (no biases)")


def SmolLM3HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of SmolLM3 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: SMOLLM3``): :class:`HFFamilyCheckpointer` with :data:`SMOLLM3_NAMES`."""
    return HFFamilyCheckpointer(SMOLLM3_NAMES, **kwargs)


def _use_rope(cfg: dict[str, Any], layers: int, where: str) -> list[bool]:
    """Per layer, whether it rotates (``no_rope_layers``, else ``no_rope_layer_interval``)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        return [(i + 1) % interval != 0 for i in range(layers)]
    flags = list(flags)
    if len(flags) != layers or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ValueError(f"{where}: no_rope_layers must list 1 (RoPE) or 0 (no RoPE) for each "
                         f"of {layers} layers; got {flags}")
    return [bool(f) for f in flags]


def check_smollm3_config(cfg: dict[str, Any], *, where: str, heads: int,
                         rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Refuse the SmolLM3 ``config.json`` fields this implementation does not compute.

    Args:
        cfg, where, heads, rope_scaling: the parsed ``config.json``, the file's name in
            messages, ``num_attention_heads``, the folder's RoPE scaling (None: plain RoPE).

    Returns:
        ``head_dim``, ``use_rope`` and ``sliding_windows`` (per layer), ``pad_id``,
        ``tie_word_embeddings`` (true when unset).

    Raises:
        ValueError: one line naming the field: RoPE scaling,
            ``attention_bias``/``mlp_bias`` true, ``hidden_act`` other than ``silu``, a bad
            ``no_rope_layers`` or ``layer_types``, sliding layers without a ``sliding_window``
            or with ``use_sliding_window: false``.
    """
    refuse_llama_extras(cfg, where=where, arch=SMOLLM3_ARCHITECTURE, rope_scaling=rope_scaling)
    layers = int(cfg["num_hidden_layers"])
    use_rope = _use_rope(cfg, layers, where)
    window, sliding_on = cfg.get("sliding_window"), bool(cfg.get("use_sliding_window"))
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: the layers without RoPE slide
        types = ["sliding_attention" if sliding_on and window is not None and not rope
                 else "full_attention" for rope in use_rope]
    types = list(types)
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"{where}: layer_types must list 'full_attention' or "
                         f"'sliding_attention' for each of {layers} layers; got {types}")
    if "sliding_attention" in types:
        if not sliding_on:
            raise ValueError(f"{where}: layer_types holds 'sliding_attention' while "
                             "use_sliding_window=false is not supported for "
                             f"{SMOLLM3_ARCHITECTURE}; supported: use_sliding_window=true "
                             "with a sliding_window, or only 'full_attention' layers")
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"{where}: sliding_window {window!r} is not supported for "
                             f"{SMOLLM3_ARCHITECTURE}'s sliding layers; supported: a positive "
                             "integer")
    extra: dict[str, Any] = dict(
        head_dim=config_head_dim(cfg, where=where, heads=heads), use_rope=use_rope,
        sliding_windows=[window if t == "sliding_attention" else None for t in types],
        pad_id=config_pad_id(cfg))
    if cfg.get("tie_word_embeddings") is None:
        extra["tie_word_embeddings"] = True
    return extra


def _spec(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, max_seq_len: int,
          use_rope: list[bool] | None = None, head_dim: int | None = None,
          sliding_windows: list[int | None] | None = None, attn_dropout: float = 0.0,
          norm_eps: float = 1e-6, rope_base: float = 2_000_000.0,
          tie_word_embeddings: bool = True, pad_id: int | None = None) -> DecoderSpec:
    if use_rope is None:
        use_rope = [(i + 1) % 4 != 0 for i in range(num_layers)]
    if len(use_rope) != num_layers:
        raise ValueError(f"use_rope has {len(use_rope)} entries for {num_layers} layers")
    return DecoderSpec(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, embed_dim=embed_dim, intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len, head_dim=head_dim or embed_dim // num_heads,
        rope_bases=tuple(float(rope_base) if rope else None for rope in use_rope),
        norm_eps=norm_eps,
        sliding_windows=None if sliding_windows is None else tuple(sliding_windows),
        tie_word_embeddings=tie_word_embeddings, pad_id=pad_id, attn_dropout=attn_dropout)


def smollm3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    use_rope: list[bool] | None = None,
    head_dim: int | None = None,
    sliding_windows: list[int | None] | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 2_000_000.0,
    tie_word_embeddings: bool = True,
    pad_id: int | None = None,
) -> TransformerDecoder:
    """A SmolLM3 decoder.

    Args:
        vocab_size: ``V``. num_layers, num_heads, num_kv_heads, embed_dim (``D``),
            intermediate_dim, max_seq_len: the dimensions.
        use_rope: per layer, whether it applies RoPE; ``None``: every 4th layer without.
        head_dim: channels per head; ``None``: ``embed_dim // num_heads``.
        sliding_windows: per layer, the keys it sees (query included) or ``None``; ``None``:
            full attention everywhere.
        attn_dropout: attention dropout (training only).
        norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
        rope_base: RoPE ``theta`` of the layers that rotate.
        tie_word_embeddings: the output projection is the embedding table.
        pad_id: the embedding's padding index (no gradient), or ``None``.

    Returns:
        A :class:`~torchtune.modules.TransformerDecoder`: tokens ``[b, s]`` -> logits
        ``[b, s, V]``.
    """
    return build_decoder(_spec(**locals()))


def lora_smollm3(
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
    """:func:`smollm3` with LoRA (or DoRA) adapters (:func:`~.decoder.build_lora_decoder`).

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        **model: :func:`smollm3`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    return build_lora_decoder(
        _spec(**model), lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        use_dora=use_dora, quantize_base=quantize_base)


#: The interface :mod:`torchtune_grpo.models.families` asks of a family module.
ARCHITECTURE = SMOLLM3_ARCHITECTURE
NAMES = SMOLLM3_NAMES
build, build_lora = smollm3, lora_smollm3


def check_config(cfg: dict[str, Any], *, where: str, heads: int,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The SmolLM3 builder arguments beyond the common ones, or a one-line ``ValueError``
    (:func:`check_smollm3_config`)."""
    return check_smollm3_config(cfg, where=where, heads=heads, rope_scaling=rope_scaling)
