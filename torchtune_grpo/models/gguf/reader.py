"""Reading a GGUF file: its metadata as Python values and its tensors dequantized to float32.

Shared by the weight conversion (:mod:`torchtune_grpo.models.gguf`) and the tokenizer rebuild
(:mod:`torchtune_grpo.models.gguf.tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def _field_value(field: Any) -> Any:
    """The value of a ``gguf.ReaderField`` (works on gguf releases without ``contents()``)."""
    from gguf import GGUFValueType

    def scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        kind = field.types[-1]
        if kind == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [value for i in field.data for value in field.parts[i].tolist()]
    return scalar(field.parts[field.data[0]], field.types[0])


@dataclass
class GgufFile:
    """What the conversion needs from a GGUF file.

    Attributes:
        path: the file.
        metadata: every metadata key (``GGUF.*`` header fields left out) -> its value.
        tensors: GGUF tensor name -> ``gguf.ReaderTensor``.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # GGUF name -> gguf.ReaderTensor

    @classmethod
    def read(cls, path: Path) -> GgufFile:
        """Open ``path`` with ``gguf.GGUFReader`` (tensors are memory-mapped, not loaded)."""
        from gguf import GGUFReader

        reader = GGUFReader(path)
        metadata = {key: _field_value(field) for key, field in reader.fields.items()
                    if not key.startswith("GGUF.")}
        return cls(path, metadata, {tensor.name: tensor for tensor in reader.tensors})

    def get(self, key: str, default: Any = ...) -> Any:
        """Metadata ``key``; without ``default`` a missing key is a ``ValueError`` naming it."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return default

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, in PyTorch dimension order."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"{self.path}: tensor {name} has type {tensor.tensor_type.name}, "
                             f"which gguf {_gguf_version()} cannot dequantize") from exc
        return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def check_block_tensors(src: GgufFile, block_tensors: Any, layers: int, what: str) -> None:
    """Raise unless ``src`` holds the embedding, the final norm and every ``block_tensors`` part
    of each of its ``layers`` blocks.

    Raises:
        ValueError: naming the file, the first missing tensors and ``layers`` ``what``.
    """
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{n}.{part}.weight" for n in range(layers) for part in block_tensors}
    missing = sorted(expected - set(src.tensors))
    if missing:
        raise ValueError(f"{src.path}: missing tensors {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} for {layers} {what}")
