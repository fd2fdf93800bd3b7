"""Proof that it learns: the CPU quickstart raises held-out success; a negative control doesn't.

Held-out success is greedy pass@1 on problems never trained on, measured through the
evaluation code path the recipe runs before the first step and at the end.
"""

from __future__ import annotations

import pytest

from tests.recipes._helpers import launch, metrics, quickstart_overrides, run_overrides, run_tune

pytestmark = pytest.mark.slow

SHORT = ["num_steps=8", "eval_every_n_steps=8", "eval_at_start=true"]


@pytest.fixture(scope="module")
def warmed_up_model(tmp_path_factory):
    """The quickstart's real starting model (default warm-up and seed)."""
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("quickstart_base"))


def _run(base, out, nproc=1, *extra):
    args = quickstart_overrides(base, out, *SHORT, *extra)
    launcher = ["run"] + (["--nproc_per_node", str(nproc)] if nproc > 1 else [])
    run_tune([*launcher, "grpo_full_finetune_distributed", *args], cwd=out.parent,
             threads=2 if nproc == 1 else 1)
    rows = {int(r["step"]): r for r in metrics(out)}
    return rows[0]["eval/pass@1"], rows[8]["eval/pass@1"], rows


def test_quickstart_raises_heldout_success_and_lr0_control_does_not(warmed_up_model, tmp_path):
    start, end, rows = _run(warmed_up_model, tmp_path / "grpo")
    assert start < 0.3, "the starting policy should be far from solving the task"
    assert end - start >= 0.3, f"held-out pass@1 went from {start:.3f} to {end:.3f}"
    assert rows[8]["reward/mean"] > rows[1]["reward/mean"]

    # negative control: the same run with the policy gradient disabled (lr 0)
    c_start, c_end, _ = _run(warmed_up_model, tmp_path / "control", 1, "optimizer.lr=0")
    assert c_start == pytest.approx(start)
    assert c_end <= c_start + 0.02, f"control moved from {c_start:.3f} to {c_end:.3f}"


def test_quickstart_learns_with_two_processes(warmed_up_model, tmp_path):
    start, end, _ = _run(warmed_up_model, tmp_path / "grpo2", 2, "global_batch_size=16",
                         "batch_size=null")
    assert end - start >= 0.3, f"held-out pass@1 went from {start:.3f} to {end:.3f}"


def test_async_one_step_off_learns_with_three_processes(warmed_up_model, tmp_path):
    """1 rollout rank + 2 trainer ranks, batch t sampled by the policy of step t - 1: within
    1.5x the synchronous steps it gains as much held-out success as the synchronous test."""
    out = tmp_path / "async_k1"
    run_tune([*launch(3, "async_grpo_full_finetune_distributed"), "--config",
              "grpo/quickstart_cpu_async", *run_overrides(
                  warmed_up_model, out, "num_steps=12", "eval_every_n_steps=12",
                  "eval_at_start=true", "max_staleness=1")], cwd=tmp_path)
    rows = {int(r["step"]): r for r in metrics(out)}
    start, end = rows[0]["eval/pass@1"], rows[12]["eval/pass@1"]
    assert rows[12]["staleness/mean"] == 1
    assert end - start >= 0.3, f"held-out pass@1 went from {start:.3f} to {end:.3f}"
