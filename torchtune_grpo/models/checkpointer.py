"""The torchtune checkpointer of an HF folder, with what it needs read from the folder.

:func:`hf_checkpointer` is the ``checkpointer._component_`` of every shipped config: the weight
files (:func:`weight_files`) and the model type come from the folder, and the families this
package adds (:mod:`torchtune_grpo.models.families`) get their own weight-name tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def weight_files(folder: str | Path) -> list[str]:
    """Names of the weight files of an HF folder (``*.safetensors``, else ``*.bin``)."""
    folder = Path(folder)

    def model_files(pattern: str) -> list[str]:  # LoRA adapters sit beside the model weights
        return sorted(p.name for p in folder.glob(pattern) if not p.name.startswith("adapter"))

    files = model_files("*.safetensors") or model_files("*.bin")
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weight file in {folder}")
    return files


def hf_checkpointer(
    checkpoint_dir: str,
    model_type: str | None = None,
    output_dir: str | None = None,
    checkpoint_files: list[str] | None = None,
    **kwargs: Any,
) -> Any:
    """A torchtune ``FullModelHFCheckpointer`` that reads its weight files and model type from the
    folder.

    Args:
        checkpoint_dir: folder with the HF weights and ``config.json``.
        model_type: torchtune model type (``LLAMA3_2``, ``QWEN2``, ...); ``None`` derives it from
            ``config.json`` (:func:`torchtune_grpo.models.hf_model_type`).
        output_dir: where the checkpointer may write; a fresh temporary folder when None.
        checkpoint_files: weight files; all ``*.safetensors`` (else ``*.bin``) when None.
        **kwargs: passed to ``FullModelHFCheckpointer``.

    Raises:
        FileNotFoundError: no folder, no ``config.json`` or no weight file, naming the path.
        ValueError: ``model_type`` is None and ``config.json`` names an unsupported
            architecture.
    """
    import tempfile

    from torchtune.training import FullModelHFCheckpointer

    folder = Path(checkpoint_dir).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint_dir {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'config.json'} not found: not an HF checkpoint folder")
    if model_type is None:
        from torchtune_grpo.models.builders import hf_model_type

        model_type = hf_model_type(folder)
    if checkpoint_files is None:
        checkpoint_files = weight_files(folder)
    if output_dir is None:
        output_dir = tempfile.mkdtemp(prefix="grpo_ckpt_")
    from torchtune_grpo.models.families import family_for_model_type

    family = family_for_model_type(model_type)  # no torchtune ModelType: this package's
    if family is not None:
        from functools import partial

        from torchtune_grpo.models.hf_weights import HFFamilyCheckpointer

        FullModelHFCheckpointer = partial(HFFamilyCheckpointer, family.NAMES)  # noqa: N806
    elif str(model_type).upper() == "QWEN2":  # torchtune's, with a right PEFT adapter file
        from torchtune_grpo.models.hf_weights import qwen2_checkpointer

        FullModelHFCheckpointer = qwen2_checkpointer  # noqa: N806
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=list(checkpoint_files),
        model_type=model_type,
        output_dir=str(output_dir),
        **kwargs,
    )
    # torchtune's Qwen2 converter reads this key unconditionally; transformers treats a
    # missing one as untied
    # (Gemma 3 defaults to tied: its checkpointer reads a missing key as true)
    checkpointer._config.setdefault("tie_word_embeddings",
                                    family is not None and family.NAMES.tied_by_default)
    return checkpointer
