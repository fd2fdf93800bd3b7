"""Every step folder of a run can be resumed, evaluated and loaded by transformers, whatever it
was resumed from and whatever ``keep_last_n_checkpoints`` deleted since; two runs never share an
output folder. Runs go through the stock ``tune`` command, as a user runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch

from tests.recipes._helpers import quickstart_overrides, recipe_env, run_tune, tune_cmd
from torchtune_grpo.checkpoints.run_lock import is_locked
from torchtune_grpo.checkpoints.saving import list_step_checkpoints
from torchtune_grpo.checkpoints.step_folder import check_step_folder

pytestmark = pytest.mark.slow


def _usable_everywhere(step, tmp_path, evaluate: bool = True) -> None:
    """``step`` passes the folder check, loads in transformers with finite logits and (with
    ``evaluate``) is evaluated by ``tune run grpo_eval``."""
    transformers = pytest.importorskip("transformers")
    report = check_step_folder(step)
    assert report.is_step and report.damaged() == [], "\n".join(report.lines())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == 320 and bool(torch.isfinite(logits).all())
    if not evaluate:
        return
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_quickstart", f"checkpoint_dir={step}",
              "progress_bar=false", "dataset.limit=4"], cwd=tmp_path)
    assert json.loads((step / "eval_results.json").read_text())["num_problems"] == 4


@pytest.mark.parametrize("keep", [1, 2])
def test_a_resume_chain_leaves_usable_step_folders(base_model, tmp_path, keep):
    """Three invocations (3, then 6, then 8 steps), saving every step: before the fix the
    second left step folders with weights only once the folder it resumed from was pruned,
    and the third failed on the missing config.json. ``grpo_eval`` runs on the last folder
    (every folder gets the same files; the folder check and transformers see each)."""
    out = tmp_path / "run"
    for num_steps, resume in ((3, "false"), (6, "true"), (8, "true")):
        run_tune(["run", "grpo_full_finetune_distributed", *quickstart_overrides(
            base_model, out, f"num_steps={num_steps}", "save_every_n_steps=1",
            f"keep_last_n_checkpoints={keep}", f"resume_from_checkpoint={resume}",
            "batch_size=4", "group_size=4")], cwd=tmp_path)
        steps = list_step_checkpoints(out)
        assert [s for s, _ in steps] == list(range(num_steps - keep + 1, num_steps + 1))
        for _, path in steps:
            _usable_everywhere(path, tmp_path, evaluate=num_steps == 8 and path == steps[-1][1])


def test_a_second_run_into_the_same_output_dir_stops_in_one_line(base_model, tmp_path):
    out = tmp_path / "run"
    args = ["run", "grpo_full_finetune_distributed", *quickstart_overrides(
        base_model, out, "num_steps=100000", "save_every_n_steps=5", "batch_size=4",
        "group_size=4")]
    first = subprocess.Popen(tune_cmd(*args), cwd=tmp_path, env=recipe_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not is_locked(out):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.1)
        second = subprocess.run(tune_cmd(*args, "seed=1"), cwd=tmp_path, env=recipe_env(),
                                capture_output=True, text=True, timeout=300)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2, second.stderr[-3000:]
        assert len(errors) == 1 and "is in use by another run (training, pid" in errors[0]
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first run goes on, untouched
        first.send_signal(signal.SIGTERM)  # preemption: it saves its step and stops
        assert first.wait(timeout=300) == 0, first.stdout.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert list_step_checkpoints(out)
    seeds = {torch.load(p / "recipe_state.pt", weights_only=True)["seed"]
             for _, p in list_step_checkpoints(out)}
    assert seeds == {0}  # every step is the first run's
    assert not is_locked(out)  # released when the run ended
