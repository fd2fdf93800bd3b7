"""Exact resume after SIGKILL, crash-safe saves, and SIGTERM (preemption) handling."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    assert_same_metrics,
    assert_same_weights,
    expect_killed,
    launch,
    metrics,
    quickstart_overrides,
    recipe_env,
    run_tune,
    tune_cmd,
)

pytestmark = pytest.mark.slow


def _args(base, out, *extra):
    # ppo_epochs=2 and an LR schedule make optimizer and scheduler state matter; the length
    # reward makes every step update the weights, and the low learning rate keeps its groups
    # varied for all four steps (at 1e-3 every completion has the maximal length by step 3)
    return quickstart_overrides(
        base, out, "num_steps=4", "global_batch_size=8", "batch_size=null", "group_size=4",
        "ppo_epochs=2", "lr_scheduler._component_=torchtune.training.lr_schedulers."
        "get_cosine_schedule_with_warmup", "lr_scheduler.num_warmup_steps=2",
        LENGTH_REWARD_OVERRIDE, "optimizer.lr=1e-4", *extra)


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_after_sigkill_is_bitwise_exact(base_model, tmp_path, nproc):
    full = tmp_path / "full"
    run_tune([*launch(nproc), *_args(base_model, full, "save_every_n_steps=2")], cwd=tmp_path)

    out = tmp_path / "killed"
    expect_killed([*launch(nproc), *_args(
        base_model, out, "save_every_n_steps=2",
        "metric_logger._component_=crash_helpers.KillAfterStepLogger",
        "metric_logger.kill_at_step=3")], tmp_path)
    assert (out / "step_2" / "CHECKPOINT_COMPLETE").is_file()
    assert not (out / "step_4").exists()
    run_tune([*launch(nproc), *_args(base_model, out, "save_every_n_steps=2",
                                     "resume_from_checkpoint=true")], cwd=tmp_path)
    assert_same_weights(full / "step_4", out / "step_4")
    assert_same_metrics(full, out, steps=[3, 4])
    assert_not_degenerate(full, weights=(base_model, full / "step_2", full / "step_4"))


def test_resume_with_dynamic_sampling_is_bitwise_exact(base_model, tmp_path):
    """Extra draws (prompts and rollout seeds) are a pure function of (seed, step, draw):
    a run killed after step 2 and resumed trains step 3 exactly as the uninterrupted run,
    on 2 ranks, whose collective decides the number of extra draws."""
    import json

    from tests.unit.training.test_dynamic_sampling import PARITY_REWARD

    extra = ("num_steps=3", "save_every_n_steps=2", "rewards=" + json.dumps(PARITY_REWARD),
             "dynamic_sampling={max_batches: 2}")
    full = tmp_path / "full"
    run_tune([*launch(2), *_args(base_model, full, *extra)], cwd=tmp_path)
    step_3 = {int(r["step"]): r for r in metrics(full)}[3]
    assert step_3["dynamic_sampling/extra_rollouts"] > 0  # the step after the resume draws more

    out = tmp_path / "killed"
    expect_killed([*launch(2), *_args(
        base_model, out, *extra, "metric_logger._component_=crash_helpers.KillAfterStepLogger",
        "metric_logger.kill_at_step=3")], tmp_path)
    assert (out / "step_2" / "CHECKPOINT_COMPLETE").is_file()
    assert not (out / "step_3").exists()
    run_tune([*launch(2), *_args(base_model, out, *extra, "resume_from_checkpoint=true")],
             cwd=tmp_path)
    assert_same_weights(full / "step_3", out / "step_3")
    assert_same_metrics(full, out, steps=[3])
    assert_not_degenerate(full, weights=(base_model, full / "step_2", full / "step_3"))


def test_crash_during_save_keeps_previous_checkpoint(base_model, tmp_path):
    reference = tmp_path / "reference"
    run_tune([*launch(1), *_args(base_model, reference, "save_every_n_steps=2")],
             cwd=tmp_path, threads=2)

    out = tmp_path / "crashed"
    expect_killed([*launch(1), *_args(
        base_model, out, "save_every_n_steps=1",
        "checkpointer._component_=crash_helpers.CrashingCheckpointer",
        "checkpointer.crash_at_step=3")], tmp_path, threads=2)
    assert (out / "step_2" / "CHECKPOINT_COMPLETE").is_file()
    assert not (out / "step_3").exists() and (out / ".step_3.partial").exists()
    from torchtune_grpo.checkpoints.saving import latest_step_checkpoint

    assert latest_step_checkpoint(out).name == "step_2"
    run_tune([*launch(1), *_args(base_model, out, "save_every_n_steps=1",
                                 "resume_from_checkpoint=true")], cwd=tmp_path, threads=2)
    assert_same_weights(reference / "step_4", out / "step_4")
    assert not list(out.glob(".step_*"))
    assert_not_degenerate(reference, weights=(base_model, reference / "step_2",
                                              reference / "step_4"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_saves_at_step_boundary_and_exits_cleanly(base_model, tmp_path, sig):
    """Preemption (SIGTERM) and Ctrl-C (SIGINT) alike: the step in progress finishes and is
    saved, the run exits 0 and says how to resume."""
    out = tmp_path / "run"
    args = quickstart_overrides(base_model, out, "num_steps=500")
    proc = subprocess.Popen(tune_cmd(*launch(1), *args), cwd=tmp_path, env=recipe_env(2),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        logs = list((out / "logs").glob("log_*.txt")) if (out / "logs").exists() else []
        if logs and "Step 1 |" in logs[0].read_text():
            break
        time.sleep(0.5)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    from torchtune_grpo.checkpoints.saving import list_step_checkpoints

    saved = list_step_checkpoints(out)
    assert len(saved) == 1 and 1 <= saved[0][0] < 500
    assert len(metrics(out)) == saved[0][0]
    assert "resume_from_checkpoint=true" in output
