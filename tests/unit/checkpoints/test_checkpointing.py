"""Step checkpoints appear only once complete; pruning; resume resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtune_grpo.checkpoints.saving import (
    COMPLETE_MARKER,
    latest_step_checkpoint,
    list_step_checkpoints,
    load_recipe_state,
    resolve_resume,
    save_step_checkpoint,
)
from torchtune_grpo.errors import UserError


class FakeCheckpointer:
    """Writes like torchtune's checkpointers: into <_output_dir>/epoch_<N>/."""

    def __init__(self, output_dir: Path, fail_at: int | None = None):
        self._output_dir = output_dir
        self.fail_at = fail_at

    def save_checkpoint(self, state_dict, epoch, adapter_only=False):
        folder = Path(self._output_dir) / f"epoch_{epoch}"
        folder.mkdir(parents=True)
        torch.save(state_dict["model"], folder / "model.pt")
        (folder / "config.json").write_text("{}")
        (folder / "eval_results.json").write_text("stale")  # as copied from a resumed step
        if epoch == self.fail_at:
            raise RuntimeError("disk full")


def _save(out, step, ckpt, keep=None):
    return save_step_checkpoint(output_dir=out, step=step, checkpointer=ckpt,
                                checkpoint={"model": {"w": torch.full((2,), float(step))}},
                                recipe_state={"step": step, "seed": 0}, keep_last_n=keep,
                                extra_files={"eval_results.json": "fresh"} if step == 2 else None)


def test_save_is_complete_and_prunes(tmp_path):
    ckpt = FakeCheckpointer(tmp_path)
    for step in (1, 2, 3):
        _save(tmp_path, step, ckpt, keep=2)
    assert [s for s, _ in list_step_checkpoints(tmp_path)] == [2, 3]
    folder = latest_step_checkpoint(tmp_path)
    assert folder.name == "step_3" and (folder / COMPLETE_MARKER).is_file()
    assert not (folder / "eval_results.json").exists()  # never inherited
    assert (tmp_path / "step_2" / "eval_results.json").read_text() == "fresh"
    assert load_recipe_state(folder)["step"] == 3
    assert ckpt._output_dir == tmp_path  # restored after the save


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    ckpt = FakeCheckpointer(tmp_path, fail_at=2)
    _save(tmp_path, 1, ckpt)
    with pytest.raises(RuntimeError, match="disk full"):
        _save(tmp_path, 2, ckpt)
    assert latest_step_checkpoint(tmp_path).name == "step_1"
    assert not (tmp_path / "step_2").exists()
    # a folder without the completion marker is never picked up
    (tmp_path / "step_9").mkdir()
    assert latest_step_checkpoint(tmp_path).name == "step_1"


def test_resolve_resume(tmp_path):
    assert resolve_resume(False, tmp_path) is None
    assert resolve_resume(True, tmp_path) is None  # nothing yet: fresh start
    _save(tmp_path, 1, FakeCheckpointer(tmp_path))
    assert resolve_resume(True, tmp_path).name == "step_1"
    assert resolve_resume(str(tmp_path / "step_1"), tmp_path).name == "step_1"
    with pytest.raises(UserError, match="not a complete step checkpoint"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_weight_files_skip_lora_adapters(tmp_path):
    from torchtune_grpo.models.checkpointer import weight_files

    for name in ("model-00001-of-00001.safetensors", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert weight_files(tmp_path) == ["model-00001-of-00001.safetensors"]


def test_a_fresh_run_refuses_another_runs_steps_unless_told(tmp_path):
    from torchtune_grpo.checkpoints.saving import (
        COMPLETE_MARKER,
        claim_output_dir,
        list_step_checkpoints,
    )

    assert claim_output_dir(tmp_path / "new") == []  # nothing there: fine
    for step in (4, 11):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / COMPLETE_MARKER).write_text("")
    (tmp_path / ".step_12.partial").mkdir()
    (tmp_path / "logs").mkdir()
    with pytest.raises(FileExistsError, match=r"step_11.*resume_from_checkpoint=true.*"
                                              r"overwrite_output_dir=true"):
        claim_output_dir(tmp_path)
    assert len(list_step_checkpoints(tmp_path)) == 2  # refused: nothing deleted
    deleted = claim_output_dir(tmp_path, overwrite=True)
    assert [p.name for p in deleted] == ["step_4", "step_11"]
    assert list_step_checkpoints(tmp_path) == [] and not (tmp_path / ".step_12.partial").exists()
    assert (tmp_path / "logs").is_dir()


def test_a_full_disk_is_named_and_leaves_no_partial_step(tmp_path, monkeypatch):
    """Not enough space: one clear error before writing; a write that fails midway removes
    its staging folder and says "no space" (torch.save's own message does not)."""
    import errno
    import shutil
    from collections import namedtuple

    from torchtune_grpo.checkpoints import saving as C

    usage = namedtuple("usage", "total used free")
    checkpoint = {"model": {"w": torch.zeros(1024, 1024)}}  # 4 MiB
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1, 0, 1024))
    with pytest.raises(OSError, match=r"no space left to save step_3 .* needs about 4.0 MiB "
                       r"and 1.0 KiB are free"):
        C.save_step_checkpoint(output_dir=tmp_path, step=3, checkpointer=None,
                               checkpoint=checkpoint, recipe_state={})
    assert not list(tmp_path.iterdir())

    class FailingCheckpointer:  # torch.save on a full disk raises RuntimeError, no errno
        _output_dir = tmp_path

        def save_checkpoint(self, state, epoch, adapter_only=False):
            (self._output_dir / f"epoch_{epoch}").mkdir()
            raise RuntimeError("[enforce fail at inline_container.cc:783] unexpected pos 213888")

    frees = iter([10 * 2**30, 1024])  # enough before writing, nothing left after
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1, 0, next(frees)))
    with pytest.raises(OSError, match="no space left to save step_3") as info:
        C.save_step_checkpoint(output_dir=tmp_path, step=3, checkpointer=FailingCheckpointer(),
                               checkpoint=checkpoint, recipe_state={})
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / ".step_3.partial").exists() and not (tmp_path / "step_3").exists()
