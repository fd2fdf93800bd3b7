"""A run owns its output_dir: a fresh run refuses another run's steps unless told, and a resume
that has nothing left to do says so (in-process runs, one rank)."""

from __future__ import annotations

import logging

import pytest

from tests.recipes._helpers import quickstart_config, train_in_process, train_metrics
from torchtune_grpo.checkpoints.saving import list_step_checkpoints
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow

SHORT = ["num_steps=2", "batch_size=2", "group_size=2"]


def test_fresh_run_refuses_then_overwrites_and_resume_says_finished(base_model, tmp_path,
                                                                     caplog):
    out = tmp_path / "run"
    train_in_process(base_model, out, *SHORT)
    assert [s for s, _ in list_step_checkpoints(out)] == [2]

    recipe = GRPORecipe(quickstart_config(base_model, out, *SHORT))
    with pytest.raises(FileExistsError, match="step_2.*resume_from_checkpoint=true"):
        recipe.setup()  # before any model is built
    assert not hasattr(recipe, "model")
    recipe.cleanup()

    caplog.set_level(logging.INFO)
    finished = train_in_process(base_model, out, *SHORT, "resume_from_checkpoint=true")
    assert finished.step == 2 and "already finished" in caplog.text
    assert [r["step"] for r in train_metrics(out)] == [1, 2]  # no step was added

    train_in_process(base_model, out, "num_steps=1", "batch_size=2", "group_size=2",
                     "overwrite_output_dir=true")
    assert [s for s, _ in list_step_checkpoints(out)] == [1]  # the old step_2 is gone


def test_non_finite_weights_never_enter_or_leave_a_checkpoint(base_model, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    recipe = train_in_process(base_model, out, *SHORT)
    # leaving: a policy whose weights went NaN is not saved; step_2 stays the newest
    recipe = GRPORecipe(quickstart_config(base_model, out, "num_steps=3", "batch_size=2",
                                          "group_size=2", "resume_from_checkpoint=true"))
    recipe.setup()
    with torch.no_grad():
        next(recipe.model.parameters())[0, 0] = float("nan")
    recipe.step = 3
    with pytest.raises(ValueError, match=r"refusing to save step_3 .* NaN or infinite"):
        recipe.save_checkpoint()
    recipe.cleanup()
    assert [s for s, _ in list_step_checkpoints(out)] == [2]
    # entering: a step folder whose bytes were overwritten with NaN is refused at load
    (weights,) = sorted((out / "step_2").glob("model*.safetensors"))
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    recipe = GRPORecipe(quickstart_config(base_model, out, "num_steps=3", "batch_size=2",
                                          "group_size=2", "resume_from_checkpoint=true"))
    with pytest.raises(ValueError, match=r"refusing to load the weights in .*step_2: 1 weight"):
        recipe.setup()
    recipe.cleanup()
    assert [s for s, _ in list_step_checkpoints(out)] == [2]


def test_progress_is_one_line_per_step_when_not_on_a_terminal(base_model, tmp_path):
    """Output sent to a file gets ``step N/M: ...`` lines, not a tqdm bar redrawn with \\r."""
    from tests.recipes._helpers import quickstart_overrides, run_tune

    proc = run_tune(["run", "grpo_full_finetune_single_device",
                     *quickstart_overrides(base_model, tmp_path / "run", "num_steps=2",
                                           "batch_size=2", "group_size=2",
                                           "progress_bar=true")], cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert "step 1/2: reward" in output and "step 2/2: reward" in output
    assert "\r" not in output


def test_unwritable_output_dir_and_missing_eval_folder_are_one_line(base_model, tmp_path):
    """A read-only output_dir and a missing grpo_eval checkpoint_dir: exit 2 with one line
    naming the folder, no traceback (and no spurious DiskLogger error)."""
    import os
    import subprocess

    from tests.recipes._helpers import quickstart_overrides, recipe_env, tune_cmd

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode bits: nothing to test here
            pytest.skip("running as a user who can write anywhere")
        proc = subprocess.run(tune_cmd("run", "grpo_full_finetune_single_device",
                                       *quickstart_overrides(base_model, locked / "run")),
                              cwd=tmp_path, env=recipe_env(), capture_output=True, text=True)
    finally:
        locked.chmod(0o700)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: output_dir {locked / 'run'}" in proc.stderr and "Traceback" not in proc.stderr
    assert "DiskLogger" not in proc.stderr


def test_missing_eval_checkpoint_dir_is_named(tmp_path):
    import subprocess

    from tests.recipes._helpers import recipe_env, tune_cmd

    missing = tmp_path / "nope" / "step_9"
    proc = subprocess.run(tune_cmd("run", "grpo_eval", "--config", "grpo/eval_quickstart",
                                   f"checkpoint_dir={missing}"),
                          cwd=tmp_path, env=recipe_env(), capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: checkpoint_dir {missing} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_writable_names_the_folder(tmp_path, monkeypatch):
    """The check itself, whoever runs it (root ignores mode bits, so the write is made to
    fail)."""
    from pathlib import Path

    from torchtune_grpo.checkpoints.saving import check_writable

    check_writable(tmp_path / "new" / "run")
    assert (tmp_path / "new" / "run").is_dir()

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(PermissionError, match=r"output_dir .*run is not writable "
                                              r"\(Permission denied\)"):
        check_writable(tmp_path / "new" / "run")


def test_prepare_quickstart_keeps_an_existing_model(tmp_path, capsys):
    from safetensors.torch import load_file

    from torchtune_grpo.quickstart.cli import main

    out = tmp_path / "base"
    main(["--output-dir", str(out), "--warmup-steps", "0", "--seed", "0"])
    first = load_file(str(out / "model.safetensors"))
    main(["--output-dir", str(out), "--warmup-steps", "0", "--seed", "1"])
    assert "already holds a quickstart model: kept" in capsys.readouterr().out
    assert all(first[k].equal(v) for k, v in load_file(str(out / "model.safetensors")).items())
    main(["--output-dir", str(out), "--warmup-steps", "0", "--seed", "1", "--overwrite"])
    assert any(not first[k].equal(v)
               for k, v in load_file(str(out / "model.safetensors")).items())
