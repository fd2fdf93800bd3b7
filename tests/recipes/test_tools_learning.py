"""Proof that the policy learns to use a tool: ``grpo/quickstart_cpu_tools`` raises held-out
success and the tool-call rate; the same run with the tool disabled at rollout time does not.

Held-out success is greedy pass@1 on multiplication problems never trained on, through the
multi-turn evaluation the recipe runs before the first step and at the end
(``eval/pass@1``, ``eval/tools/calls_per_completion``). The reward reads only the final
answer (the number after ``Answer:``), never the tool call or its result.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.recipes._helpers import metrics, recipe_env, run_overrides, tune_cmd

pytestmark = pytest.mark.slow

CONFIG = "grpo/quickstart_cpu_tools"
STEPS = 5
SHORT = [f"num_steps={STEPS}", f"eval_every_n_steps={STEPS}", "eval_at_start=true",
         "eval_dataset.limit=100"]


@pytest.fixture(scope="module")
def warmed_up_tool_model(tmp_path_factory):
    """The tool quickstart's real starting model (default warm-up and seed)."""
    import torch

    from torchtune_grpo.quickstart.tools import prepare_tools_quickstart

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from a second thread
    try:
        return prepare_tools_quickstart(tmp_path_factory.mktemp("tools_quickstart_base"))
    finally:
        torch.set_num_threads(threads)


def _run_both(base, tmp_path):
    """The run and its negative control (``tools=null``), at the same time, one thread each
    (the two cores of CI): ``{name: (step-0 row, last row, rows by step)}``."""
    runs = {"grpo": [], "no_tools": ["tools=null"]}
    procs = {}
    for name, extra in runs.items():
        out = tmp_path / name
        args = ["--config", CONFIG, *run_overrides(base, out, *SHORT, *extra)]
        procs[name] = subprocess.Popen(
            tune_cmd("run", "grpo_full_finetune_distributed", *args), cwd=tmp_path,
            env=recipe_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{output[-6000:]}"
        rows = {int(r["step"]): r for r in metrics(tmp_path / name)}
        results[name] = rows[0], rows[STEPS], rows
    return results


def test_policy_learns_to_call_the_calculator_and_the_no_tool_control_does_not(
        warmed_up_tool_model, tmp_path):
    results = _run_both(warmed_up_tool_model, tmp_path)
    start, end, rows = results["grpo"]
    calls = "eval/tools/calls_per_completion"
    assert start["eval/pass@1"] < 0.1, "the starting policy should answer (wrongly) in its head"
    assert start[calls] < 0.2, "the starting policy should rarely call the tool greedily"
    assert end["eval/pass@1"] - start["eval/pass@1"] >= 0.3, (
        f"held-out pass@1 went from {start['eval/pass@1']:.3f} to {end['eval/pass@1']:.3f}")
    assert end[calls] - start[calls] >= 0.5, (
        f"tool calls per completion went from {start[calls]:.3f} to {end[calls]:.3f}")
    assert rows[STEPS]["tools/calls_per_completion"] > rows[1]["tools/calls_per_completion"]

    # negative control: the same run with the tool disabled at rollout time (a call gets no
    # result), so the final answer must be computed in the head: it stays low
    c_start, c_end, _ = results["no_tools"]
    assert c_start["eval/pass@1"] == pytest.approx(start["eval/pass@1"])
    assert c_end["eval/pass@1"] <= 0.05, f"control reached {c_end['eval/pass@1']:.3f}"
    assert c_end["eval/pass@1"] < end["eval/pass@1"] - 0.3
