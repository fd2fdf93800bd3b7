"""Tiny models and tokenizers for the CPU quickstart, the tests and the benchmarks.

Nothing here downloads anything: the tokenizer is a byte-level tiktoken file with the
Llama 3 special tokens placed right after the 256 byte tokens, and the model is a
:func:`torchtune.models.llama3_2.llama3_2` decoder with small dimensions. Both are written
in the formats a real run uses (a tiktoken ``tokenizer.model`` plus a ``tokenizer.json``
holding the special tokens; HF safetensors plus ``config.json``), so the quickstart goes
through exactly the same loading code as a run on a downloaded model.
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
    """Write a byte-level Llama 3 style tokenizer into ``directory``.

    Args:
        directory: folder to create (if needed) and write into.

    Returns:
        ``(tokenizer.model, tokenizer.json)``: the tiktoken BPE file (one line per byte,
        no merges) and an HF-style ``tokenizer.json`` whose ``added_tokens`` list the special
        tokens, as :func:`torchtune.models.llama3.llama3_tokenizer` reads them through
        ``special_tokens_path``.
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
