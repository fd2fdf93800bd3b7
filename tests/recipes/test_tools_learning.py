"""Proof that the policy learns to use a tool: ``grpo/quickstart_cpu_tools`` raises held-out
success and the tool-call rate; the same run with the tool disabled at rollout time does not.

Held-out success is greedy pass@1 on multiplication problems never trained on, through the
multi-turn evaluation the recipe runs before the first step and at the end
(``eval/pass@1``, ``eval/tools/calls_per_completion``). The reward reads only the final
answer (the number after ``Answer:``), never the tool call or its result.
"""

from __future__ import annotations

import pytest

from tests.recipes._helpers import metrics, run_overrides, run_tune

pytestmark = pytest.mark.slow

CONFIG = "grpo/quickstart_cpu_tools"
STEPS = 5
SHORT = [f"num_steps={STEPS}", f"eval_every_n_steps={STEPS}", "eval_at_start=true",
         "eval_dataset.limit=100"]


@pytest.fixture(scope="module")
def warmed_up_tool_model(tmp_path_factory):
    """The tool quickstart's real starting model (default warm-up and seed)."""
    from torchtune_grpo.quickstart import prepare_tools_quickstart

    return prepare_tools_quickstart(tmp_path_factory.mktemp("tools_quickstart_base"))


def _run(base, out, *extra):
    args = ["--config", CONFIG, *run_overrides(base, out, *SHORT, *extra)]
    run_tune(["run", "grpo_full_finetune_distributed", *args], cwd=out.parent, threads=2)
    rows = {int(r["step"]): r for r in metrics(out)}
    return rows[0], rows[STEPS], rows


def test_policy_learns_to_call_the_calculator_and_the_no_tool_control_does_not(
        warmed_up_tool_model, tmp_path):
    start, end, rows = _run(warmed_up_tool_model, tmp_path / "grpo")
    calls = "eval/tools/calls_per_completion"
    assert start["eval/pass@1"] < 0.1, "the starting policy should answer (wrongly) in its head"
    assert start[calls] < 0.2, "the starting policy should rarely call the tool greedily"
    assert end["eval/pass@1"] - start["eval/pass@1"] >= 0.2, (
        f"held-out pass@1 went from {start['eval/pass@1']:.3f} to {end['eval/pass@1']:.3f}")
    assert end[calls] - start[calls] >= 0.3, (
        f"tool calls per completion went from {start[calls]:.3f} to {end[calls]:.3f}")
    assert rows[STEPS]["tools/calls_per_completion"] > rows[1]["tools/calls_per_completion"]

    # negative control: the same run with the tool disabled at rollout time (a call gets no
    # result), so the final answer must be computed in the head: it stays low
    c_start, c_end, _ = _run(warmed_up_tool_model, tmp_path / "no_tools", "tools=null")
    assert c_start["eval/pass@1"] == pytest.approx(start["eval/pass@1"])
    assert c_end["eval/pass@1"] <= 0.05, f"control reached {c_end['eval/pass@1']:.3f}"
    assert c_end["eval/pass@1"] < end["eval/pass@1"] - 0.2
