"""Crash consistency, measured: SIGKILL at 20 random instants of training, half of them inside
a checkpoint write; every resume finds a complete step and finishes bitwise equal to the run
that was never interrupted (docs/reliability.md).

The instants are drawn with ``CRASH_SEED`` (default 0): ``CRASH_SEED=7 pytest
tests/recipes/test_crash_consistency.py`` tries 20 others. ``tests/recipes/crash_runner.py``
does the killing (a count of Python calls, so an instant is reproducible and can be aimed
inside ``save_step_checkpoint``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from tests.recipes._helpers import (
    HERE,
    LENGTH_REWARD_OVERRIDE,
    QUICKSTART,
    assert_not_degenerate,
    assert_same_metrics,
    assert_same_weights,
    recipe_env,
)

pytestmark = pytest.mark.slow

TRIALS = 20
NUM_STEPS = 4


def _overrides(base):
    # every step saved and evaluated, only the last two steps kept (deletions happen too),
    # ppo_epochs=2 and an LR schedule (optimizer and scheduler state matter), a reward that
    # varies within groups (the weights move every step)
    return [f"model_dir={base}", "progress_bar=false", f"num_steps={NUM_STEPS}",
            "save_every_n_steps=1", "keep_last_n_checkpoints=2", "eval_every_n_steps=2",
            "eval_at_start=false", "eval_dataset.limit=16", "global_batch_size=8",
            "batch_size=null", "group_size=4", "ppo_epochs=2",
            "lr_scheduler._component_=torchtune.training.lr_schedulers."
            "get_cosine_schedule_with_warmup", "lr_scheduler.num_warmup_steps=2",
            LENGTH_REWARD_OVERRIDE, "optimizer.lr=1e-4"]


def test_sigkill_at_random_instants_resumes_bitwise(base_model, tmp_path):
    rng = random.Random(int(os.environ.get("CRASH_SEED", "0")))
    trials = [{"out": str(tmp_path / f"trial_{i:02d}"), "phase": "save" if i % 2 else "all",
               "fraction": rng.uniform(0.01, 0.97)} for i in range(TRIALS)]
    reference = tmp_path / "reference"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": QUICKSTART, "overrides": _overrides(base_model),
                                "reference": str(reference), "trials": trials}))
    result_file = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(HERE / "crash_runner.py"), str(spec),
                           str(result_file)], cwd=tmp_path, env=recipe_env(1),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(result_file.read_text())
    assert result["reference"] == {"signal": None, "exit": 0}, proc.stderr[-6000:]
    final = f"step_{NUM_STEPS}"
    assert_not_degenerate(reference, weights=(base_model, reference / f"step_{NUM_STEPS - 1}",
                                              reference / final))
    assert result["counts"]["save"] > 0

    inside_save = left_staging = 0
    for trial in result["trials"]:
        name = trial["out"].rsplit("/", 1)[-1]
        # the kill happened (an instant is a count of calls: it falls inside the run)
        assert trial["killed"]["signal"] == signal.SIGKILL, (name, trial)
        # whatever the instant, every step folder that looks complete is complete and loads
        assert not trial["left"]["broken"], (name, trial["left"])
        inside_save += trial["phase"] == "save"
        left_staging += any(h.endswith((".partial", ".deleting")) for h in trial["left"]["hidden"])
        assert trial["resumed"] == {"signal": None, "exit": 0}, (name, trial)
        out = tmp_path / name
        assert not trial["after"]["broken"] and not trial["after"]["hidden"], (name, trial)
        assert trial["after"]["complete_steps"] == [NUM_STEPS - 1, NUM_STEPS], (name, trial)
        assert_same_weights(reference / final, out / final)
        assert_same_metrics(reference, out, steps=list(range(1, NUM_STEPS + 1)))
    # the instants did land inside checkpoint writes: some kills left a half-written step
    assert inside_save == TRIALS // 2 and left_staging >= 3, result["trials"]
    print(f"\ncrash consistency: {TRIALS} kills ({inside_save} inside a save, {left_staging} "
          f"left a half-written .step_N), {TRIALS} resumes bitwise equal to the reference")
