"""`tune run async_grpo_full_finetune_distributed`: 1 rollout rank + 2 FSDP2 trainer ranks on
CPU (gloo). k = 0 is the synchronous recipe bit for bit; k = 1 resumes bitwise after SIGKILL;
the log-prob gap metric catches rollout ranks that never got the new weights; it learns."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.recipes._helpers import (
    HERE,
    LENGTH_REWARD_OVERRIDE,
    TIMING,
    assert_not_degenerate,
    assert_same_metrics,
    assert_same_weights,
    expect_killed,
    free_port,
    launch,
    metrics,
    quickstart_overrides,
    recipe_env,
    run_overrides,
    run_tune,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ASYNC = "async_grpo_full_finetune_distributed"
# the length reward varies within every group of the under-trained base model, so each step
# moves the weights; ppo_epochs 2 makes the ratio and the optimizer state matter
COMMON = ("global_batch_size=8", "batch_size=null", "group_size=4", "ppo_epochs=2",
          LENGTH_REWARD_OVERRIDE, "optimizer.lr=1e-4")


def _async_args(base, out, *extra):
    return ["--config", "grpo/quickstart_cpu_async", *run_overrides(base, out, *COMMON, *extra)]


def _rows(out):
    return {int(r["step"]): r for r in metrics(out) if "grad_norm" in r}


def test_k0_is_bitwise_the_synchronous_recipe(base_model, tmp_path):
    sync, k0, k1 = tmp_path / "sync", tmp_path / "k0", tmp_path / "k1"
    run_tune([*launch(2), *quickstart_overrides(base_model, sync, *COMMON, "num_steps=3")],
             cwd=tmp_path)
    run_tune([*launch(3, ASYNC), *_async_args(base_model, k0, "num_steps=3",
                                              "max_staleness=0")], cwd=tmp_path)
    assert_not_degenerate(sync, weights=(base_model, sync / "step_3"))
    assert_same_weights(sync / "step_3", k0 / "step_3")
    a, b = _rows(sync), _rows(k0)
    for step in (1, 2, 3):
        for key in (k for k in a[step] if not k.startswith(TIMING)):
            assert a[step][key] == b[step][key], (step, key)
        assert b[step]["staleness/mean"] == 0
    # the same run one step off is another algorithm: its weights differ
    run_tune([*launch(3, ASYNC), *_async_args(base_model, k1, "num_steps=3",
                                              "max_staleness=1")], cwd=tmp_path)
    assert [_rows(k1)[s]["staleness/mean"] for s in (1, 2, 3)] == [0, 1, 1]
    with pytest.raises(AssertionError):
        assert_same_weights(sync / "step_3", k1 / "step_3")


def test_k1_resumes_bitwise_after_sigkill_and_every_sync_lands(base_model, tmp_path):
    full, out = tmp_path / "full", tmp_path / "killed"
    args = ("num_steps=4", "max_staleness=1", "save_every_n_steps=2")
    run_tune([*launch(3, ASYNC), *_async_args(base_model, full, *args)], cwd=tmp_path)
    expect_killed([*launch(3, ASYNC), *_async_args(
        base_model, out, *args, "metric_logger._component_=crash_helpers.KillAfterStepLogger",
        "metric_logger.kill_at_step=3")], tmp_path)
    assert (out / "step_2" / "CHECKPOINT_COMPLETE").is_file()
    assert not (out / "step_4").exists()
    run_tune([*launch(3, ASYNC), *_async_args(base_model, out, *args,
                                              "resume_from_checkpoint=true")], cwd=tmp_path)
    assert_not_degenerate(full, weights=(base_model, full / "step_2", full / "step_4"))
    assert_same_weights(full / "step_4", out / "step_4")
    assert_same_metrics(full, out, steps=[3, 4])
    rows = _rows(full)
    assert [rows[s]["staleness/mean"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    # the engine's log-probs match the trainer's under the version that sampled each batch
    for step, row in rows.items():
        assert row["generation/logprob_diff_max"] < 1e-4, (step, row)
    assert rows[2]["weight_sync/bytes"] > 0


def test_gap_metric_catches_rollouts_without_new_weights(base_model, tmp_path):
    out = tmp_path / "no_sync"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
           "--master_port", str(free_port()), str(HERE / "async_no_weight_sync.py"),
           *_async_args(base_model, out, "num_steps=4", "max_staleness=1")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=recipe_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out)
    assert_not_degenerate(out)
    # steps 1-2 are sampled by version 0, which the rollout rank has; from step 3 on it should
    # hold version 1+, still has version 0, and the trainer sees it
    assert rows[2]["generation/logprob_diff_max"] < 1e-4
    assert rows[3]["generation/logprob_diff_max"] > 1e-3
    assert rows[4]["generation/logprob_diff_max"] > 1e-3


def test_decoupled_correction_weights_stale_tokens(base_model, tmp_path):
    """off_policy_correction: decoupled through the recipe: the trainer recomputes the proximal
    log-probs, and the behaviour weight is 1 on the fresh first batch but not on stale ones."""
    out = tmp_path / "decoupled"
    run_tune([*launch(3, ASYNC), *_async_args(
        base_model, out, "num_steps=3", "max_staleness=1", "optimizer.lr=1e-3",
        "loss.off_policy_correction=decoupled", "loss.is_weight_cap=5.0",
        # the weights of every rollout's tokens, tied groups too (skipped, they have none)
        "skip_zero_advantage_sequences=false")], cwd=tmp_path)
    rows = _rows(out)
    assert_not_degenerate(out, steps=[1, 2])  # by step 3 every completion is the longest
    assert all(rows[s]["time/old_logprobs"] > 0 for s in (1, 2, 3))
    assert abs(rows[1]["is_weight/max"] - 1) < 1e-4  # sampled by the weights it trains
    assert rows[2]["is_weight/max"] > 1 + 1e-3 and rows[3]["is_weight/max"] > 1 + 1e-3


def test_a_dead_rollout_rank_is_named_in_one_line(base_model, tmp_path):
    """The rollout rank exits during step 2: the trainers say which rank died, which step they
    waited for and which checkpoint to resume from, once and without a traceback of their own
    (torchrun's report of the failed rank follows)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torchtune._cli.tune", *launch(3, ASYNC), *_async_args(
            base_model, out, "num_steps=3", "max_staleness=0", "save_every_n_steps=1",
            "generator._component_=components.DyingGenerator", "generator.die_at_call=3")],
        cwd=tmp_path, env=recipe_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # 2 trainers, 1 rollout rank: its third call is trainer 0's share of step 2
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith("error: rollout rank 2 died while the trainers waited for the "
                                "rollout of step 2 (its connection closed); "), errors[0]
    assert errors[0].endswith(f"the newest complete checkpoint is {out / 'step_1'}: continue "
                              "with the same command and resume_from_checkpoint=true")
    assert proc.stderr.count("Traceback (most recent call last)") <= 1  # torchrun's own
