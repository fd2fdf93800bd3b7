"""`tune run grpo_eval` on a quickstart checkpoint, one and two processes."""

from __future__ import annotations

import json

import pytest

from tests.recipes._helpers import quickstart_overrides, run_tune

pytestmark = pytest.mark.slow


def test_eval_recipe_on_quickstart_checkpoint(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed",
              *quickstart_overrides(base_model, out, "num_steps=1")], cwd=tmp_path, threads=2)
    ckpt = out / "step_1"
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_quickstart", f"checkpoint_dir={ckpt}",
              "progress_bar=false", "dataset.limit=40"], cwd=tmp_path, threads=2)
    one = json.loads((ckpt / "eval_results.json").read_text())
    samples = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    assert one["num_problems"] == len(samples) == 40
    assert one["model_path"] == str(ckpt) and one["split"] == "test"
    assert one["metrics"]["pass@1"] == pytest.approx(
        sum(s["correct"][0] for s in samples) / 40)

    # two ranks split the problems and gather the same greedy results
    run_tune(["run", "--nproc_per_node", "2", "grpo_eval", "--config", "grpo/eval_quickstart",
              f"checkpoint_dir={ckpt}", "progress_bar=false", "dataset.limit=39"], cwd=tmp_path)
    two = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["index"] for s in two] == list(range(39))
    assert [s["completions"] for s in two] == [s["completions"] for s in samples[:39]]


def test_periodic_eval_lands_in_step_checkpoints(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed", *quickstart_overrides(
        base_model, out, "num_steps=3", "eval_every_n_steps=2", "eval_at_start=true",
        "eval_dataset._component_=torchtune_grpo.datasets.addition_dataset",
        "eval_dataset.split=test", "eval_dataset.limit=16")], cwd=tmp_path, threads=2)
    for step in (2, 3):  # every 2 steps and at the end
        results = json.loads((out / f"step_{step}" / "eval_results.json").read_text())
        assert results["num_problems"] == 16 and results["step"] == step
    from torchtune_grpo.metrics import read_disk_log

    rows = {int(r["step"]): r for r in read_disk_log(out / "logs")}
    assert {"eval/pass@1"} <= set(rows[0]) and "eval/pass@1" in rows[2]
