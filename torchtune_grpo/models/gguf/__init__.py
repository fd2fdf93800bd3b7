"""Hugging Face model folders from GGUF files (architectures ``llama`` and ``gemma3``).

The folder holds ``model.safetensors`` (float32, dequantized), ``config.json``,
``generation_config.json`` and the tokenizer files (:mod:`~torchtune_grpo.models.gguf.tokenizer`).
For ``llama``, names follow :func:`hf_tensor_name` and ``q_proj``/``k_proj`` rows are
un-permuted (:func:`unpermute_rotary`); ``gemma3`` is :mod:`~torchtune_grpo.models.gguf.gemma3`.
The folder is written through a hidden sibling renamed at the end, and a complete one is reused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from torchtune_grpo.models.gguf.gemma3 import gemma3_config, gemma3_state_dict
from torchtune_grpo.models.gguf.reader import GgufFile, check_block_tensors
from torchtune_grpo.models.gguf.tokenizer import tokenizer_from_gguf

__all__ = [
    "HF_FILES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "gguf_to_hf",
    "hf_tensor_name",
    "is_converted",
    "unpermute_rotary",
]

#: ``general.architecture`` values :func:`gguf_to_hf` converts.
SUPPORTED_GGUF_ARCHITECTURES = ("gemma3", "llama")
#: The files of a complete conversion.
HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not
    9.99999974e-6), i.e. as it was written before it was stored in float32."""
    return float(str(np.float32(value)))


# --------------------------------------------------------------------------------------------
# Weights and config
# --------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor name.

    Args:
        gguf_name: e.g. ``"blk.3.attn_q.weight"`` or ``"token_embd.weight"``.

    Returns:
        e.g. ``"model.layers.3.self_attn.q_proj.weight"`` or ``"model.embed_tokens.weight"``.

    Raises:
        ValueError: a name outside the Llama architecture (e.g. ``rope_freqs.weight`` of Llama
            3.1's scaled RoPE, or MoE experts).
    """
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart "
                     f"(supported: {sorted(_GLOBAL_TENSORS)} and blk.N.{{"
                     f"{', '.join(_BLOCK_TENSORS)}}}.weight)")


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a ``q_proj`` / ``k_proj`` weight.

    Per head of size ``d``: ``hf[h*d + j*d/2 + i] = gguf[h*d + 2*i + j]`` (``0 <= i < d/2``,
    ``j in {0, 1}``), ggml rotating adjacent rows and Hugging Face half-split ones.

    Args:
        weight: ``[n_heads * d, in_features]`` as stored in the GGUF (dequantized).
        n_heads: query heads for ``q_proj``, key/value heads for ``k_proj``.

    Returns:
        ``[n_heads * d, in_features]`` in Hugging Face order (a new array).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    heads = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(heads.swapaxes(1, 2).reshape(weight.shape))


def _hf_config(src: GgufFile, arch: str) -> dict[str, Any]:
    """``config.json`` of the converted model (transformers' LlamaConfig keys)."""
    p = f"{arch}."
    hidden = int(src.get(p + "embedding_length"))
    heads = src.get(p + "attention.head_count")
    kv_heads = src.get(p + "attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError(f"{src.path}: per-layer head counts are not supported by Llama")
    head_dim = int(src.get(p + "attention.key_length", hidden // int(heads)))
    rope_dim = int(src.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{src.path}: rope.dimension_count={rope_dim} != head dim {head_dim} "
                         "(partial rotary embeddings are not Llama)")
    scaling = src.get(p + "rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in src.tensors:
        raise ValueError(f"{src.path}: scaled RoPE (rope.scaling.type={scaling!r}, rope_freqs "
                         "tensor) is not supported; only plain RoPE is")
    if int(src.get(p + "expert_count", 0)):
        raise ValueError(f"{src.path}: mixture-of-experts Llama models are not supported")
    vocab = src.get(p + "vocab_size", None)
    if vocab is None:  # older files: the rows of the embedding (GGUF shape [dim, vocab])
        vocab = int(src.tensors["token_embd.weight"].shape[-1])
    special = {f"{key}_token_id": src.get(f"tokenizer.ggml.{gguf_key}_token_id", None)
               for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(src.get(p + "feed_forward_length")),
        "num_hidden_layers": int(src.get(p + "block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(src.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(src.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(src.get(p + "context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in src.tensors,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        **special,
        "torch_dtype": "float32",
    }


def _state_dict(src: GgufFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """All tensors under their HF names, float32, q/k un-permuted."""
    layers = config["num_hidden_layers"]
    check_block_tensors(src, _BLOCK_TENSORS, layers, "layers")
    names = {name: hf_tensor_name(name) for name in src.tensors}  # unknown names raise here
    out = {}
    for gguf_name, hf_name in names.items():
        weight = src.array(gguf_name)
        if gguf_name.endswith(".attn_q.weight"):
            weight = unpermute_rotary(weight, config["num_attention_heads"])
        elif gguf_name.endswith(".attn_k.weight"):
            weight = unpermute_rotary(weight, config["num_key_value_heads"])
        out[hf_name] = weight
    rows = out["model.embed_tokens.weight"].shape[0]
    if rows != config["vocab_size"]:
        raise ValueError(f"{src.path}: token_embd has {rows} rows but vocab_size is "
                         f"{config['vocab_size']}")
    return out


# --------------------------------------------------------------------------------------------
# Writing the folder
# --------------------------------------------------------------------------------------------


def is_converted(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete conversion (every file of :data:`HF_FILES`, and a
    ``config.json`` that parses)."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in HF_FILES):
        return False
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def _remove_stale_temporaries(output_dir: Path) -> None:
    """Delete temporary folders of earlier runs for ``output_dir`` whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(output_dir.name)}\.(?:tmp|old)-(\d+)-.*")
    for sibling in output_dir.parent.glob(f".{output_dir.name}.*"):
        match = pattern.fullmatch(sibling.name)
        if not match or not sibling.is_dir():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(sibling, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass


def gguf_to_hf(gguf_path: str | Path, output_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert a ``llama`` or ``gemma3`` GGUF file into a Hugging Face model folder.

    Args:
        gguf_path: the ``.gguf`` file.
        output_dir: the folder to write; created with its parents.
        overwrite: rewrite a folder that already holds a complete conversion (by default it is
            returned untouched).

    Returns:
        ``output_dir`` holding :data:`HF_FILES`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``output_dir`` exists, is not empty and is not a complete conversion,
            and ``overwrite`` is False.
        ValueError: the GGUF's architecture is not one of :data:`SUPPORTED_GGUF_ARCHITECTURES`,
            or it holds something the conversion does not support (the message says what).
    """
    gguf_path, output_dir = Path(gguf_path).expanduser(), Path(output_dir).expanduser()
    if not overwrite and is_converted(output_dir):
        return output_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if (not overwrite and output_dir.exists()
            and (not output_dir.is_dir() or any(output_dir.iterdir()))):
        raise FileExistsError(f"{output_dir} exists and is not a complete conversion; pass "
                              "overwrite=True (--overwrite) to replace it, or choose another "
                              "folder")

    src = GgufFile.read(gguf_path)
    arch = src.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(repr(a) for a in SUPPORTED_GGUF_ARCHITECTURES)}")
    config = gemma3_config(src) if arch == "gemma3" else _hf_config(src, arch)
    tokenizer, tokenizer_config, special_map = tokenizer_from_gguf(src)
    weights = gemma3_state_dict(src, config) if arch == "gemma3" else _state_dict(src, config)
    generation_config = {key: config[key] for key in ("bos_token_id", "eos_token_id",
                                                      "pad_token_id") if config[key] is not None}

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(output_dir)
    # os.mkdir (not mkdtemp, which makes it private) so the folder gets the umask's mode
    tmp = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        from safetensors.numpy import save_file

        for name, content in (("config.json", config),
                              ("generation_config.json", generation_config),
                              ("tokenizer_config.json", tokenizer_config),
                              ("special_tokens_map.json", special_map)):
            (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        shutil.copymode(tmp / "config.json", tmp / "model.safetensors")  # it is written 0600
        if output_dir.is_dir() and any(output_dir.iterdir()):  # overwrite: swap, then delete
            old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
            os.replace(output_dir, old)
            os.replace(tmp, output_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if output_dir.is_dir():
                output_dir.rmdir()
            elif output_dir.exists():
                output_dir.unlink()
            os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir
