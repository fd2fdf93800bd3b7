"""Tiny models and tokenizers for the CPU quickstart, the tests and the benchmarks, written in the
formats a real run loads (tiktoken ``tokenizer.model`` plus ``tokenizer.json``; HF safetensors
plus ``config.json``).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from torchtune.models.llama3._tokenizer import SPECIAL_TOKENS, Llama3Tokenizer

#: Number of ordinary (byte) tokens of the tiny tokenizer.
TINY_BASE_VOCAB = 256
#: Names of the special tokens, in id order after the byte tokens.
TINY_SPECIAL_TOKEN_NAMES = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.get)
#: Number of ids the tiny tokenizer can decode (bytes + special tokens).
TINY_TOKENIZER_VOCAB = TINY_BASE_VOCAB + len(TINY_SPECIAL_TOKEN_NAMES)


def tiny_special_tokens() -> dict[str, int]:
    """The special-token table of the tiny tokenizer: Llama 3 names, ids from 256 up."""
    return {name: TINY_BASE_VOCAB + i for i, name in enumerate(TINY_SPECIAL_TOKEN_NAMES)}


def write_tiny_tokenizer(directory: str | Path) -> tuple[Path, Path]:
    """Write a byte-level Llama 3 style tokenizer into ``directory`` (created if needed).

    Returns:
        ``(tokenizer.model, tokenizer.json)``: the tiktoken BPE file (one line per byte, no
        merges) and a ``tokenizer.json`` whose ``added_tokens`` list the special tokens.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_path = directory / "tokenizer.model"
    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(TINY_BASE_VOCAB)]
    model_path.write_text("\n".join(lines) + "\n")
    json_path = directory / "tokenizer.json"
    added = [
        {"id": idx, "content": name, "special": True}
        for name, idx in tiny_special_tokens().items()
    ]
    json_path.write_text(json.dumps({"added_tokens": added}, indent=1))
    return model_path, json_path


def tiny_tokenizer(directory: str | Path, max_seq_len: int | None = None) -> Llama3Tokenizer:
    """Write (if missing) and load the tiny tokenizer of ``directory``."""
    directory = Path(directory)
    model_path, json_path = directory / "tokenizer.model", directory / "tokenizer.json"
    if not (model_path.exists() and json_path.exists()):
        write_tiny_tokenizer(directory)
    return Llama3Tokenizer(
        str(model_path), special_tokens=tiny_special_tokens(), max_seq_len=max_seq_len
    )


# ---------------------------------------------------------------------------- tiny model
#: Default dimensions of the quickstart model (about 0.1M parameters).
TINY_MODEL_DIMS = dict(
    vocab_size=320, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256
)


def tiny_llama(**overrides):
    """A small policy model: a :func:`torchtune.models.llama3_2.llama3_2` decoder (tied embeddings)
    as a :class:`~torchtune_grpo.policy.decoder.PolicyDecoder`; keyword arguments override
    :data:`TINY_MODEL_DIMS`. Its vocabulary (320) exceeds the tokenizer's 269 ids, so sampling
    must avoid undefined ids.
    """
    from torchtune.models.llama3_2 import llama3_2

    from torchtune_grpo.policy.decoder import policy_decoder

    dims = {**TINY_MODEL_DIMS, **overrides}
    return policy_decoder(llama3_2(**dims))


def hf_llama_config(vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                    embed_dim: int, max_seq_len: int, intermediate_dim: int | None = None,
                    **_) -> dict:
    """The HF ``config.json`` of a :func:`tiny_llama` model (Llama 3.2 architecture)."""
    from torchtune.models.llama3._model_utils import scale_hidden_dim_for_mlp

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": embed_dim,
        "intermediate_size": intermediate_dim or scale_hidden_dim_for_mlp(embed_dim),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": embed_dim // num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": tiny_special_tokens()["<|begin_of_text|>"],
        "eos_token_id": tiny_special_tokens()["<|end_of_text|>"],
        "torch_dtype": "float32",
    }


def write_hf_checkpoint(model, directory: str | Path, dims: dict) -> Path:
    """Write ``model`` (a :func:`tiny_llama` built with ``dims``) as an HF checkpoint plus the tiny
    tokenizer into ``directory`` (created).

    Returns:
        The folder, holding ``model.safetensors``, ``config.json``, ``tokenizer.model`` and
        ``tokenizer.json``.
    """
    from safetensors.torch import save_file
    from torchtune.models.convert_weights import tune_to_hf

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_llama_config(**dims)
    state = tune_to_hf(
        {k: v.detach().cpu() for k, v in model.state_dict().items()},
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        dim=config["hidden_size"],
        head_dim=config["head_dim"],
    )
    state.pop("lm_head.weight", None)  # tied to the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tiny_tokenizer(directory)
    return directory
