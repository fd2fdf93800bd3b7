"""Step checkpoints: ``output_dir/step_{N}/`` appears only once it is complete.

A step folder holds the model in the format it was loaded from (written by the torchtune
checkpointer of the config, so an HF input gives HF safetensors plus its ``config.json`` and
tokenizer files), ``recipe_state.pt`` (what the next step reads) and, when evaluation ran at
that step, its results. It is assembled under ``output_dir/.step_{N}.partial`` and renamed
into place after an fsync, so a crash during a save never leaves a half-written
``step_{N}`` behind and never touches the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

STEP_DIR_PATTERN = re.compile(r"^step_(\d+)$")
RECIPE_STATE_FILE = "recipe_state.pt"
COMPLETE_MARKER = "CHECKPOINT_COMPLETE"


def step_dir(output_dir: str | Path, step: int) -> Path:
    """``output_dir/step_{step}``."""
    return Path(output_dir) / f"step_{step}"


def list_step_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints of ``output_dir`` as ``(step, path)``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR_PATTERN.match(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_step_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete ``step_{N}`` folder, or None."""
    found = list_step_checkpoints(output_dir)
    return found[-1][1] if found else None


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_step_checkpoint(
    *,
    output_dir: str | Path,
    step: int,
    checkpointer: Any,
    model_state_dict: dict[str, torch.Tensor],
    recipe_state: dict[str, Any],
    extra_files: dict[str, Any] | None = None,
    keep_last_n: int | None = None,
) -> Path:
    """Write ``output_dir/step_{step}`` atomically (call on rank 0 only).

    Args:
        output_dir: the run's output folder.
        step: the optimizer step just completed.
        checkpointer: a torchtune checkpointer (``FullModelHFCheckpointer`` and co.); its
            ``save_checkpoint`` converts and writes the model in the input's format.
        model_state_dict: the full (gathered) torchtune-format model state dict.
        recipe_state: tensors and plain values for exact resume; saved as
            ``recipe_state.pt``, loadable with ``torch.load(weights_only=True)``.
        extra_files: ``name -> JSON-serialisable object`` written next to the model.
        keep_last_n: delete older complete checkpoints beyond this many (never this one).

    Returns:
        The final folder.
    """
    output_dir = Path(output_dir)
    final = step_dir(output_dir, step)
    staging = output_dir / f".step_{step}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    # torchtune's checkpointers write to <their output dir>/epoch_{epoch}: point them at the
    # staging folder for the duration of the call.
    original_output = checkpointer._output_dir
    checkpointer._output_dir = staging
    try:
        checkpointer.save_checkpoint({"model": model_state_dict}, epoch=step)
    finally:
        checkpointer._output_dir = original_output
    written = staging / f"epoch_{step}"
    for item in written.iterdir():
        item.rename(staging / item.name)
    written.rmdir()

    torch.save(recipe_state, staging / RECIPE_STATE_FILE)
    for name, payload in (extra_files or {}).items():
        (staging / name).write_text(json.dumps(payload, indent=2))
    (staging / COMPLETE_MARKER).write_text(f"{step}\n")
    _fsync_tree(staging)
    if final.exists():  # a re-run of the same step replaces its old checkpoint
        shutil.rmtree(final)
    staging.rename(final)

    if keep_last_n is not None:
        for _, old in list_step_checkpoints(output_dir)[:-keep_last_n]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def load_recipe_state(checkpoint: str | Path) -> dict[str, Any]:
    """``recipe_state.pt`` of a step folder, loaded with ``weights_only=True``."""
    path = Path(checkpoint) / RECIPE_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {checkpoint} is not a complete step checkpoint")
    return torch.load(path, map_location="cpu", weights_only=True)
