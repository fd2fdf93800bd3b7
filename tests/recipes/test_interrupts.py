"""Ctrl-C from the first second (``tune run`` as a user runs it): while setting up, one line and
exit 130; during the evaluation before the first step, one line, the finished problems kept,
and the same command continues from them to the rows an uninterrupted run writes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from tests.recipes._helpers import quickstart_overrides, recipe_env, run_tune, tune_cmd

pytestmark = pytest.mark.slow

#: A start evaluation slow enough to interrupt: 48 problems x 64 samples.
SLOW_EVAL = ["eval_at_start=true", "eval_every_n_steps=null", "eval.num_samples=64",
             "eval.temperature=1.0", "eval.k=[1]", "eval_dataset.limit=48",
             "eval.forward_batch_size=64", "num_steps=1", "batch_size=2", "group_size=2"]


def _interrupt_when(args: list[str], cwd, ready, timeout: float = 180):
    """Start ``tune ARGS``, wait until ``ready()``, send SIGINT once; (exit code, output)."""
    proc = subprocess.Popen(tune_cmd(*args), cwd=cwd, env=recipe_env(2), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the point to interrupt"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _stopped_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("stopped: ")]


def test_ctrl_c_while_setting_up_is_one_line(base_model, tmp_path):
    marker = tmp_path / "marker"
    args = ["run", "grpo_full_finetune_distributed", *quickstart_overrides(
        base_model, tmp_path / "run", "dataset._component_=components.slow_addition_dataset",
        f"dataset.marker={marker}")]
    code, _, err = _interrupt_when(args, tmp_path, marker.exists)
    assert code == 130
    assert _stopped_lines(err) == ["stopped: SIGINT while setting up the run: nothing was "
                                   "trained, evaluated or saved yet"]


def test_ctrl_c_in_the_start_evaluation_keeps_and_resumes_it(base_model, tmp_path):
    out = tmp_path / "run"
    args = ["run", "grpo_full_finetune_distributed",
            *quickstart_overrides(base_model, out, *SLOW_EVAL)]
    partial = out / "eval_step_0" / "eval_samples.rank0.partial.jsonl"

    def some_rows() -> bool:
        return partial.is_file() and len(partial.read_text().splitlines()) >= 6

    code, _, err = _interrupt_when(args, tmp_path, some_rows)
    (line,) = _stopped_lines(err)
    assert code == 130 and line.startswith("stopped: evaluation interrupted after ")
    assert f"of 48 problems; they are kept in {out / 'eval_step_0'}" in line
    kept = len(partial.read_text().splitlines()) - 1  # the first line is the fingerprint
    assert 5 <= kept < 48
    assert not list(out.glob("step_*"))

    resumed = run_tune(args, cwd=tmp_path, threads=2)
    assert f"eval: {kept} of 48 problems kept from an interrupted run" in (resumed.stdout
                                                                          + resumed.stderr)
    reference = tmp_path / "reference"
    run_tune(["run", "grpo_full_finetune_distributed",
              *quickstart_overrides(base_model, reference, *SLOW_EVAL)], cwd=tmp_path, threads=2)
    rows = [json.loads(x) for x in (out / "eval_step_0" / "eval_samples.jsonl").open()]
    want = [json.loads(x) for x in (reference / "eval_step_0" / "eval_samples.jsonl").open()]
    assert [r["position"] for r in rows] == list(range(48))
    assert len({c for r in want for c in r["completions"]}) > 2  # sampled, not degenerate
    assert [r["completions"] for r in rows] == [r["completions"] for r in want]
    assert not partial.exists()
    # stopped after the evaluation, before the first step was saved: the same command reuses
    # the finished evaluation instead of running it again
    shutil.rmtree(out / "step_1")
    again = run_tune(args, cwd=tmp_path, threads=2)
    assert f"the start evaluation of this run is in {out / 'eval_step_0'}: reusing it" in (
        again.stdout + again.stderr)
