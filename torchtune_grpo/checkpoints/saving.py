"""Step checkpoints: ``output_dir/step_{N}/`` appears only once it is complete.

A step folder (model in its input format with its config and tokenizer files,
``recipe_state.pt``, eval results) is assembled under ``.step_{N}.partial``, fsynced and
renamed into place; a step folder is deleted by renaming it to ``.step_{N}.deleting`` first.
A crash thus never leaves a ``step_{N}`` that looks complete but is not.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torchtune_grpo.checkpoints.run_lock import is_locked
from torchtune_grpo.checkpoints.step_folder import (
    RECIPE_STATE_FILE,
    check_step_folder,
    safetensors_problem,
)
from torchtune_grpo.errors import CheckpointError, UserError, one_line

STEP_DIR_PATTERN = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "CHECKPOINT_COMPLETE"
#: Files of a step folder that describe that step only; never carried into a later one.
_NOT_INHERITED = {COMPLETE_MARKER, RECIPE_STATE_FILE, "eval_results.json", "eval_samples.jsonl"}


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors inside ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"4.0 MiB"`` (B, KiB, MiB, GiB, TiB; one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class DiskFullError(UserError, OSError):
    """No space left to write a step folder (``errno`` ``ENOSPC``); the message gives sizes."""


def _no_space(step: int, output_dir: Path, need: int, free: int) -> str:
    return (f"no space left to save step_{step} in {output_dir}: it needs about "
            f"{human_bytes(need)} and {human_bytes(free)} are free; free some space or "
            "point output_dir elsewhere (earlier step folders are untouched)")


@contextlib.contextmanager
def _quiet_torchtune() -> Iterator[None]:
    """Mute torchtune's INFO lines while it saves (they name staging paths and "epochs")."""
    logger = logging.getLogger("torchtune.utils._logging")
    previous = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(previous)


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


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` that hold a NaN or an infinity.

    Args:
        state_dict: name -> tensor (other values are ignored).

    Returns:
        The offending names, in the state dict's order.
    """
    bad = []
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            if not bool(torch.isfinite(value).all()):
                bad.append(name)
    return bad


def check_finite(state_dict: dict[str, Any], where: str, *, action: str) -> None:
    """Refuse weights with NaN or infinite values.

    Args:
        state_dict: the weights.
        where: the folder or file they come from (or go to), for the message.
        action: what is refused, e.g. ``"load"`` or ``"save"``.

    Raises:
        CheckpointError: naming ``where``, the first offending tensors and their number.
    """
    bad = non_finite_tensors(state_dict)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(
            f"refusing to {action} {where}: {len(bad)} weight tensor(s) hold NaN or infinite "
            f"values ({shown}); resume from an earlier step_N, or lower the learning rate")


def check_writable(output_dir: str | Path) -> None:
    """Create ``output_dir`` if needed and make sure files can be written in it.

    Raises:
        PermissionError: naming the folder, when it cannot be created or written (before any
            model is loaded).
    """
    root = Path(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"output_dir {root} is not writable ({exc.strerror or exc}); choose another "
            "output_dir or fix its permissions") from None


def claim_output_dir(output_dir: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Refuse a fresh run into a folder holding another run's step checkpoints, or with
    ``overwrite`` delete them (and half-written ones); call on rank 0.

    Args:
        output_dir: the run's output folder.
        overwrite: delete the step folders found instead of refusing.

    Returns:
        The step folders deleted (empty when there were none).

    Raises:
        FileExistsError: ``output_dir`` holds step checkpoints and ``overwrite`` is False; the
            message names the newest one and the two ways on.
    """
    import shutil

    root = Path(output_dir)
    found = [path for _, path in list_step_checkpoints(root)]
    partial = (sorted(root.glob(".step_*.partial")) + sorted(root.glob(".step_*.deleting"))
               if root.is_dir() else [])
    if found and not overwrite:
        raise FileExistsError(
            f"output_dir {root} already holds {len(found)} step checkpoint(s) of a run "
            f"(newest: {found[-1].name}); continue that run with resume_from_checkpoint=true, "
            "start over with overwrite_output_dir=true (deletes them), or choose another "
            "output_dir")
    if overwrite and (root / "eval_step_0").is_dir():  # the start evaluation of that run
        shutil.rmtree(root / "eval_step_0")
    for path in found + partial:
        shutil.rmtree(path)
    return found


def latest_step_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete ``step_{N}`` folder, or None."""
    found = list_step_checkpoints(output_dir)
    return found[-1][1] if found else None


def resume_hint(output_dir: str | Path) -> str:
    """Where a run stopped by a failure continues from: the newest complete step folder of
    ``output_dir`` and the command, or that no step was saved yet."""
    latest = latest_step_checkpoint(output_dir) if str(output_dir) else None
    if latest is None:
        return "no step was saved yet"
    return (f"the newest complete checkpoint is {latest}: continue with the same command and "
            "resume_from_checkpoint=true")


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
    checkpoint: dict[str, Any],
    recipe_state: dict[str, Any],
    extra_files: dict[str, str] | None = None,
    keep_last_n: int | None = None,
    adapter_only: bool = False,
    model_files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``output_dir/step_{step}`` atomically (call on rank 0 only).

    Args:
        output_dir: the run's output folder.
        step: the optimizer step just completed.
        checkpointer: a torchtune checkpointer; its ``save_checkpoint`` writes the model in the
            input's format.
        checkpoint: ``{"model": full state dict}``, plus ``"adapter"`` and ``"adapter_config"``
            for LoRA.
        recipe_state: tensors and plain values for exact resume, saved as ``recipe_state.pt``
            (loadable with ``torch.load(weights_only=True)``).
        extra_files: ``name -> text`` written next to the model (evaluation results).
        keep_last_n: delete older complete checkpoints beyond this many (never this one).
        adapter_only: write only the LoRA adapters.
        model_files: ``name -> content`` of the model files (config, tokenizer), written over
            what the checkpointer copied.

    Returns:
        The final folder.

    Raises:
        OSError: no space left (:class:`DiskFullError`, with the sizes), or a weight file that
            reads back truncated.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = step_dir(output_dir, step)
    staging = output_dir / f".step_{step}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    need = _nbytes(checkpoint) + _nbytes(recipe_state)
    free = shutil.disk_usage(output_dir).free
    if need > free:
        raise DiskFullError(errno.ENOSPC, _no_space(step, output_dir, need, free))
    staging.mkdir(parents=True)
    try:
        # torchtune's checkpointers write to <their output dir>/epoch_{epoch}: point them at
        # the staging folder for the duration of the call (their progress lines muted: they
        # name the staging folder and an "epoch")
        original_output = checkpointer._output_dir
        checkpointer._output_dir = staging
        try:
            with _quiet_torchtune():
                checkpointer.save_checkpoint(dict(checkpoint), epoch=step,
                                             adapter_only=adapter_only)
        finally:
            checkpointer._output_dir = original_output
        written = staging / f"epoch_{step}"
        for item in written.iterdir():
            if item.name in _NOT_INHERITED:  # copied from a step folder we resumed from
                continue
            item.rename(staging / item.name)
        shutil.rmtree(written)

        for name, data in (model_files or {}).items():
            (staging / name).write_bytes(data)
        torch.save(recipe_state, staging / RECIPE_STATE_FILE)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        _fsync_tree(staging)
        for path in sorted(staging.glob("*.safetensors")):  # read back: header against size
            if (why := safetensors_problem(path)) is not None:
                raise OSError(errno.EIO, f"step_{step}: {path.name} was written {why}")
        (staging / COMPLETE_MARKER).write_text(f"{step}\n")
        _fsync_tree(staging)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-written step behind
        free = shutil.disk_usage(output_dir).free
        if isinstance(exc, Exception) and (getattr(exc, "errno", None) == errno.ENOSPC
                                           or free < 64 * 2**20):
            raise DiskFullError(errno.ENOSPC, _no_space(step, output_dir, need, free)) from exc
        raise
    if final.exists():  # a re-run of the same step replaces its old checkpoint
        _remove_step(final)
    staging.rename(final)

    if keep_last_n is not None:
        for _, old in list_step_checkpoints(output_dir)[:-keep_last_n]:
            if old == final:
                continue
            if is_locked(old):  # grpo_eval is writing into it: pruned by a later save
                logging.getLogger(__name__).warning(
                    f"keep_last_n_checkpoints: kept {old.name} for now: an evaluation is "
                    "writing into it")
                continue
            _remove_step(old)
    for doomed in output_dir.glob(".step_*.deleting"):  # a deletion a crash cut short
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def _remove_step(path: Path) -> None:
    """Delete a step folder: first renamed out of the step names (atomic), then removed."""
    doomed = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def resolve_resume(resume: bool | str | None, output_dir: str | Path) -> Path | None:
    """The step folder to resume from, or None for a fresh start.

    With ``resume=True`` the newest intact step is taken (a damaged newer one is skipped with a
    warning). Whether a step can be resumed is the ``"resume"`` verdict of
    :func:`~torchtune_grpo.checkpoints.step_folder.check_step_folder`, as ``tune-grpo
    check-step`` prints it: a model file the step lacks and its base model folder holds is no
    damage (the recipe writes it into the step before loading it).

    Args:
        resume: ``resume_from_checkpoint``: False/None (fresh), True (the newest intact
            ``step_{N}`` of ``output_dir``; fresh, with a warning, when there is none) or a path
            to a step folder.
        output_dir: the run's output folder.

    Raises:
        UserError: an explicit path that is not a complete, intact step checkpoint, or
            ``resume=True`` where every step folder is damaged.
    """
    import logging

    log = logging.getLogger(__name__)
    if not resume:
        return None
    if resume is True:
        found = list_step_checkpoints(output_dir)
        if not found:
            log.warning(f"resume_from_checkpoint: no complete step_N checkpoint in {output_dir}; "
                        "starting from the base model")
            return None
        damaged = []
        for _, path in reversed(found):
            problems = _resume_problems(path)
            if not problems:
                if damaged:
                    log.warning(f"resume_from_checkpoint: {'; '.join(damaged)}; resuming from "
                                f"{path.name}, the newest intact step (the damaged folders are "
                                "left as they are)")
                return path
            damaged.append(f"{path.name} is damaged ({'; '.join(problems)})")
        raise UserError(f"resume_from_checkpoint: every step folder of {output_dir} is damaged: "
                        + "; ".join(damaged))
    path = Path(str(resume)).expanduser()
    if not (path / COMPLETE_MARKER).is_file() or not (path / RECIPE_STATE_FILE).is_file():
        raise UserError(
            f"resume_from_checkpoint: {path} is not a complete step checkpoint (expected "
            f"{COMPLETE_MARKER} and {RECIPE_STATE_FILE} in it)"
        )
    problems = _resume_problems(path)
    if problems:
        raise UserError(f"resume_from_checkpoint: {path} is damaged ({'; '.join(problems)}); "
                        "resume from another step_N folder")
    return path


def _resume_problems(path: Path) -> list[str]:
    """What keeps the step folder ``path`` from being resumed: the folder check's verdict."""
    return check_step_folder(path).problems["resume"]


def load_recipe_state(checkpoint: str | Path) -> dict[str, Any]:
    """``recipe_state.pt`` of a step folder, loaded with ``weights_only=True``.

    Raises:
        UserError: the file is missing or cannot be read.
    """
    path = Path(checkpoint) / RECIPE_STATE_FILE
    if not path.is_file():
        raise UserError(f"{path} not found: {checkpoint} is not a complete step checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({one_line(str(exc))}): the file is damaged; "
                        "resume from another step_N folder") from None
