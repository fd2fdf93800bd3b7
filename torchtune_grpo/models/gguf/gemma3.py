"""GGUF architecture ``gemma3`` -> a Hugging Face ``Gemma3ForCausalLM`` folder (text only).

llama.cpp stores Gemma's norm weights as ``w + 1`` (1 is subtracted here, in float32), keeps
q/k rows in Hugging Face order, stores the embeddings unscaled and tied. Names follow
:data:`GEMMA3_BLOCK_TENSORS`; config values missing from the metadata are llama.cpp's
hard-coded Gemma 3 ones.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtune_grpo.models.gguf.reader import check_block_tensors

if TYPE_CHECKING:
    from torchtune_grpo.models.gguf.reader import GgufFile

__all__ = ["GEMMA3_BLOCK_TENSORS", "gemma3_config", "gemma3_state_dict", "gemma3_tensor_name"]

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: GGUF block tensor -> its Hugging Face ``Gemma3ForCausalLM`` name after ``model.layers.N.``.
GEMMA3_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer is global ("set_swa_pattern(6)")
# and the sliding layers rotate with base 10000 ("rope_freq_base_train_swa = 10000.0f"), unless
# the file says otherwise (the keys read below).
_SWA_PATTERN = 6
_LOCAL_ROPE_BASE = 10000.0
# llama.cpp scales attention by 1/sqrt(head_dim), except for the 27B model (62 layers), where it
# uses 1/sqrt(hidden_size / heads): Hugging Face's query_pre_attn_scalar 168.
_LAYERS_27B = 62


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-6, not
    9.99999997e-7)."""
    return float(str(np.float32(value)))


def gemma3_tensor_name(gguf_name: str) -> str:
    """The Hugging Face ``Gemma3ForCausalLM`` name of a llama.cpp Gemma 3 tensor name.

    Args:
        gguf_name: e.g. ``"blk.3.post_ffw_norm.weight"`` or ``"token_embd.weight"``.

    Returns:
        e.g. ``"model.layers.3.post_feedforward_layernorm.weight"``.

    Raises:
        ValueError: a name outside the text-only Gemma 3 architecture.
    """
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in GEMMA3_BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{GEMMA3_BLOCK_TENSORS[match.group(2)]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Gemma 3 counterpart "
                     f"(supported: {sorted(_GLOBAL_TENSORS)} and blk.N.{{"
                     f"{', '.join(GEMMA3_BLOCK_TENSORS)}}}.weight)")


def _layer_types(src: GgufFile, layers: int) -> list[str]:
    """``layer_types``: ``sliding_window_pattern`` from the file if it is a number, else
    llama.cpp's hard-coded 6 (layers 5, 11, 17, ... global)."""
    pattern = src.get("gemma3.attention.sliding_window_pattern", _SWA_PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{src.path}: gemma3.attention.sliding_window_pattern={pattern!r} is "
                         "not supported; supported: a positive integer (every n-th layer global)")
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def _rope_scaling(src: GgufFile) -> dict[str, Any] | None:
    """The global layers' ``rope_scaling``: ``None``, or linear with the file's factor (Gemma 3
    4B and larger)."""
    kind = src.get("gemma3.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"{src.path}: gemma3.rope.scaling.type={kind!r} is not supported; "
                         "supported: 'none', 'linear'")
    return {"rope_type": "linear", "factor": _f32(src.get("gemma3.rope.scaling.factor"))}


def gemma3_config(src: GgufFile) -> dict[str, Any]:
    """``config.json`` of the converted model (transformers' ``Gemma3TextConfig`` keys).

    Args:
        src: the GGUF file (``general.architecture`` ``gemma3``).

    Returns:
        The config as a dict.

    Raises:
        ValueError: metadata this conversion does not support (the message names the key):
            per-layer head counts, key and value head sizes that differ, partial RoPE, an
            unsupported RoPE scaling or sliding-window pattern.
    """
    p = "gemma3."
    hidden = int(src.get(p + "embedding_length"))
    heads, kv_heads = src.get(p + "attention.head_count"), src.get(p + "attention.head_count_kv")
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError(f"{src.path}: per-layer head counts are not supported for Gemma 3")
    head_dim = int(src.get(p + "attention.key_length", hidden // int(heads)))
    value_dim = int(src.get(p + "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{src.path}: attention.value_length={value_dim} != key_length "
                         f"{head_dim}; Gemma 3 uses one head size")
    rope_dim = int(src.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{src.path}: rope.dimension_count={rope_dim} != head dim {head_dim} "
                         "(partial rotary embeddings are not Gemma 3)")
    layers = int(src.get(p + "block_count"))
    scalar = hidden // int(heads) if layers == _LAYERS_27B else head_dim
    vocab = src.get(p + "vocab_size", None)
    if vocab is None:  # the rows of the embedding (GGUF shape [dim, vocab])
        vocab = int(src.tensors["token_embd.weight"].shape[-1])
    special = {f"{key}_token_id": src.get(f"tokenizer.ggml.{gguf_key}_token_id", None)
               for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(src.get(p + "feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's Gemma 3 graph: GELU (tanh)
        "rms_norm_eps": _f32(src.get(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(src.get(p + "rope.freq_base")),
        "rope_local_base_freq": _f32(src.get(p + "rope.freq_base_swa", _LOCAL_ROPE_BASE)),
        "rope_scaling": _rope_scaling(src),
        "sliding_window": int(src.get(p + "attention.sliding_window")),
        "layer_types": _layer_types(src, layers),
        "max_position_embeddings": int(src.get(p + "context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in src.tensors,
        # Gemma 3 has no soft-capping (llama.cpp's Gemma 3 graph applies none)
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "initializer_range": 0.02,
        "use_cache": True,
        **special,
        "torch_dtype": "float32",
    }


def gemma3_state_dict(src: GgufFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """All tensors under their Hugging Face names, float32, with the norms' ``+ 1`` undone.

    Args:
        src: the GGUF file.
        config: :func:`gemma3_config` of it.

    Returns:
        Hugging Face name -> float32 array.

    Raises:
        ValueError: a missing or unknown tensor, or an embedding that does not have
            ``vocab_size`` rows.
    """
    layers = config["num_hidden_layers"]
    check_block_tensors(src, GEMMA3_BLOCK_TENSORS, layers, "Gemma 3 layers")
    names = {name: gemma3_tensor_name(name) for name in src.tensors}  # unknown names raise here
    out = {}
    for gguf_name, hf_name in names.items():
        weight = src.array(gguf_name)
        if gguf_name.endswith("norm.weight"):
            weight = weight - np.float32(1.0)
        out[hf_name] = weight
    rows = out["model.embed_tokens.weight"].shape[0]
    if rows != config["vocab_size"]:
        raise ValueError(f"{src.path}: token_embd has {rows} rows but vocab_size is "
                         f"{config['vocab_size']}")
    return out
