"""Gemma 3 (text, ``Gemma3ForCausalLM``, ``model_type: gemma3_text``) as a torchtune decoder.

What differs from a Llama layer, and where it lives here:

* **Norms.** Gemma's RMSNorm multiplies by ``1 + w`` in float32 (:class:`~.gemma3_layers.
  GemmaRMSNorm`), and a layer has four: ``input_layernorm`` (torchtune ``sa_norm``),
  ``post_attention_layernorm`` (``sa_scale``: applied to the attention output before the
  residual add), ``pre_feedforward_layernorm`` (``mlp_norm``) and ``post_feedforward_layernorm``
  (``mlp_scale``). torchtune's ``TransformerSelfAttentionLayer`` computes exactly
  ``h = x + sa_scale(attn(sa_norm(x)))``, ``out = h + mlp_scale(mlp(mlp_norm(h)))``.
* **QK-norm before RoPE and the attention scale.** As for Qwen3, the per-head norms are part of
  the query/key projections (:class:`~.gemma3_layers.GemmaHeadNormProjection`), so every path
  that runs torchtune's attention (training, packed forwards, the native KV-cache engine, LoRA)
  applies them before RoPE. The query projection also multiplies by ``sqrt(head_dim /
  query_pre_attn_scalar)``, turning SDPA's default scale into ``query_pre_attn_scalar ** -0.5``.
* **Sliding and global layers.** ``layer_types`` (or ``sliding_window_pattern``: every
  ``pattern``-th layer global) picks each layer's kind; sliding layers see the last
  ``sliding_window`` keys (:class:`~.gemma3_layers.SlidingWindowLayer`) and rotate with
  ``rope_local_base_freq``, global layers with ``rope_theta`` (and linear scaling if any).
* **Embeddings** are multiplied by ``sqrt(hidden_size)`` (rounded to the table's dtype), the
  output projection is the (unscaled) table when tied, and the MLP is gated GELU-tanh.

Logit and attention soft-capping are null in Gemma 3; a config that sets them is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import DoRALinear, LoRALinear

from torchtune_grpo.models.families.gemma3_layers import (
    GemmaHeadNormProjection,
    GemmaRMSNorm,
    GemmaRoPE,
    ScaledEmbedding,
    SlidingWindowLayer,
    query_factor,
)

__all__ = ["check_gemma3_config", "gemma3", "lora_gemma3"]

GEMMA3_ARCHITECTURE = "Gemma3ForCausalLM"
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _rope(params: Any, where: str, key: str) -> tuple[float, float]:
    """``(theta, linear factor)`` of one ``rope_parameters`` entry."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"{where}: {key} rope_type {kind!r} is not supported for "
                         f"{GEMMA3_ARCHITECTURE}; supported: 'default', 'linear'")
    return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" \
        else 1.0


def check_gemma3_config(cfg: dict[str, Any], *, where: str, heads: int) -> dict[str, Any]:
    """Refuse what this implementation does not compute; return the Gemma-only builder kwargs.

    Args:
        cfg: the parsed ``config.json``.
        where: how to name the file in messages.
        heads: ``num_attention_heads``.

    Returns:
        ``head_dim``, ``query_pre_attn_scalar``, ``sliding_window``, ``layer_types``,
        ``rope_base``, ``rope_scale``, ``local_rope_base``, ``pad_id``.

    Raises:
        ValueError: one line naming the field: soft-capping, bidirectional attention,
            attention biases, another activation, another RoPE type, an unknown layer type.
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


def _decoder(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
             embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int,
             query_pre_attn_scalar: float, sliding_window: int | None, layer_types: list[str],
             rope_base: float, rope_scale: float, local_rope_base: float, norm_eps: float,
             tie_word_embeddings: bool, attn_dropout: float, pad_id: int | None,
             linear: Callable[[str, int, int], nn.Module],
             output: Callable[[int, int], nn.Module] | None) -> TransformerDecoder:
    """The decoder, every projection made by ``linear(torchtune_name, in, out)``."""
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    ropes = {"full_attention": GemmaRoPE(head_dim, max_seq_len, rope_base, rope_scale),
             "sliding_attention": GemmaRoPE(head_dim, max_seq_len, local_rope_base)}
    factor = query_factor(head_dim, query_pre_attn_scalar)
    memo: dict = {}
    layers = nn.ModuleList()
    for kind in layer_types:
        attn = MultiHeadAttention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=GemmaHeadNormProjection(linear("q_proj", embed_dim, num_heads * head_dim),
                                           head_dim, norm_eps, factor),
            k_proj=GemmaHeadNormProjection(linear("k_proj", embed_dim, num_kv_heads * head_dim),
                                           head_dim, norm_eps),
            v_proj=linear("v_proj", embed_dim, num_kv_heads * head_dim),
            output_proj=linear("output_proj", num_heads * head_dim, embed_dim),
            pos_embeddings=ropes[kind], q_norm=None, k_norm=None, kv_cache=None,
            max_seq_len=max_seq_len, attn_dropout=attn_dropout,
        )
        mlp = FeedForward(gate_proj=linear("w1", embed_dim, intermediate_dim),
                          down_proj=linear("w2", intermediate_dim, embed_dim),
                          up_proj=linear("w3", embed_dim, intermediate_dim),
                          activation=nn.GELU(approximate="tanh"))
        parts = dict(attn=attn, mlp=mlp, sa_norm=GemmaRMSNorm(embed_dim, norm_eps),
                     sa_scale=GemmaRMSNorm(embed_dim, norm_eps),
                     mlp_norm=GemmaRMSNorm(embed_dim, norm_eps),
                     mlp_scale=GemmaRMSNorm(embed_dim, norm_eps))
        if kind == "sliding_attention" and sliding_window is not None:
            layers.append(SlidingWindowLayer(window=sliding_window, memo=memo, **parts))
        else:
            layers.append(TransformerSelfAttentionLayer(**parts))
    tok_embeddings = ScaledEmbedding(vocab_size, embed_dim, embed_dim**0.5, padding_idx=pad_id)
    if tie_word_embeddings:
        head: nn.Module = TiedLinear(tok_embeddings)
    elif output is not None:
        head = output(embed_dim, vocab_size)
    else:
        head = nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(tok_embeddings=tok_embeddings, layers=layers,
                              max_seq_len=max_seq_len, num_heads=num_heads, head_dim=head_dim,
                              norm=GemmaRMSNorm(embed_dim, norm_eps), output=head)


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
    """A Gemma 3 text decoder (see the module docstring).

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
    return _decoder(**{k: v for k, v in locals().items()},
                    linear=lambda _n, d_in, d_out: nn.Linear(d_in, d_out, bias=False),
                    output=None)


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
    """:func:`gemma3` with LoRA (or DoRA) adapters on the named projections.

    Args:
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on ``w1``, ``w2``, ``w3`` too.
        apply_lora_to_output: an adapter on the output projection (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters.
        **model: :func:`gemma3`'s arguments.

    Raises:
        ValueError: no or unknown ``lora_attn_modules``; an output adapter on tied embeddings.
    """
    unknown = sorted(set(lora_attn_modules) - set(LORA_ATTN_MODULES))
    if not lora_attn_modules or unknown:
        raise ValueError(f"lora_attn_modules {list(lora_attn_modules)}: name one or more of "
                         f"{list(LORA_ATTN_MODULES)}")
    if apply_lora_to_output and model.get("tie_word_embeddings", True):
        raise ValueError("apply_lora_to_output is incompatible with tied embeddings "
                         "(tie_word_embeddings: true): the output projection is the embedding")
    adapter_cls = DoRALinear if use_dora else LoRALinear
    adapted = set(lora_attn_modules) | ({"w1", "w2", "w3"} if apply_lora_to_mlp else set())
    make_adapter = partial(adapter_cls, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)

    def linear(name: str, d_in: int, d_out: int) -> nn.Module:
        if name in adapted:
            return make_adapter(d_in, d_out, quantize_base=quantize_base)
        return nn.Linear(d_in, d_out, bias=False)

    defaults = dict(rope_base=1_000_000.0, rope_scale=1.0, local_rope_base=10_000.0,
                    norm_eps=1e-6, tie_word_embeddings=True, attn_dropout=0.0, pad_id=None)
    decoder = _decoder(**{**defaults, **model}, linear=linear,
                       output=(lambda d_in, d_out: make_adapter(d_in, d_out))
                       if apply_lora_to_output else None)
    if quantize_base:
        decoder._register_state_dict_hook(partial(
            reparametrize_as_dtype_state_dict_post_hook,
            dtype=decoder.tok_embeddings.weight.dtype, offload_to_cpu=True))
    return decoder

