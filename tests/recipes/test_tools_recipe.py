"""The recipes with ``tools:``: multi-turn rollouts, tool tokens masked from the loss, the
``tools/...`` metrics, evaluation transcripts, and 1 rank = 2 ranks.

The quickstart model writes digits, not ``<calculator>`` tags, so these runs give the
calculator a call syntax the model cannot help writing: the tool is named ``8`` and its tags
are ``6`` ... ``8``. Every ``8`` a completion writes closes a call: ``6348`` runs the
calculator on ``34`` and appends ``(34)``; an ``8`` with no ``6`` before it appends
``(error: 8 without 6)``. So tool calls, tool tokens and tool errors happen from the first
step on, with the real native engine and the real recipe.

Breaking the wiring once: dropping ``tool_mask=`` from ``PolicyUpdate.micro_batch_logprobs``
makes the training forward read the results as padding, so the policy's tokens after a
result are scored in another context than they were sampled in:
``generation/logprob_diff_max`` goes from ~1e-5 to ~0.1, and both single-device tests fail.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    launch,
    metrics,
    quickstart_config,
    quickstart_overrides,
    run_tune,
    train_metrics,
)

#: The calculator, called as ``6<expression>8`` and answered as ``(<result>)``.
TOOL_OVERRIDES = [
    "tools=" + json.dumps([{"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator",
                            "name": "8"}]),
    "tool_syntax=" + json.dumps({"call_open": "6", "call_close": "{name}",
                                 "result_open": "(", "result_close": ")"}),
    "max_tool_calls=2",
    "max_generated_tokens=12",
    LENGTH_REWARD_OVERRIDE,  # rewards vary within groups: the update is never empty
]
TOOL_METRICS = ("tools/calls_per_completion", "tools/errors", "tools/result_tokens")
#: Native engine in fp32: the rollout's and the training forward's log-probs agree to ~1e-5
#: when the training forward attends to the tool tokens as the rollout did.
LOGPROB_GAP = 1e-4


def _check_tool_metrics(rows):
    for row in rows:
        for name in TOOL_METRICS:
            assert name in row, name
        assert row["generation/logprob_diff_max"] < LOGPROB_GAP, row
    assert any(r["tools/calls_per_completion"] > 0 and r["tools/result_tokens"] > 0
               for r in rows), rows
    assert all(r["grad_norm"] > 0 for r in rows)


def _check_transcripts(samples_path):
    rows = [json.loads(line) for line in samples_path.read_text().splitlines()]
    assert rows
    tool_segments = 0
    for row in rows:
        assert len(row["transcripts"]) == len(row["completions"])
        for text, segments in zip(row["completions"], row["transcripts"]):
            assert "".join(s["text"] for s in segments) == text
            assert {s["source"] for s in segments} <= {"model", "tool"}
            for s in segments:
                if s["source"] == "tool":
                    tool_segments += 1
                    assert s["text"].startswith("(")  # the end may be cut by the budget
    assert tool_segments > 0  # the greedy policy calls the tool on some problems


@pytest.mark.slow
def test_tune_run_with_tools_logs_tool_metrics_and_evaluates_with_tools(base_model, tmp_path):
    """``tune run grpo_full_finetune_single_device`` with a calculator: tool metrics logged,
    the training forward matches the rollout, the in-training evaluation (and ``grpo_eval``
    on the step folder, which reads the tools from its ``recipe_state.pt``) store transcripts
    with the tool results marked."""
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_single_device",
              *quickstart_overrides(base_model, out, "num_steps=2", *TOOL_OVERRIDES,
                                    "eval_every_n_steps=2", "eval.num_samples=1")],
             cwd=tmp_path, threads=2)
    rows = train_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    _check_tool_metrics(rows)
    evals = [r for r in metrics(out) if "eval/pass@1" in r]
    assert evals and "eval/tools/calls_per_completion" in evals[-1]
    assert "eval/tools/errors" in evals[-1]
    _check_transcripts(out / "step_2" / "eval_samples.jsonl")

    # grpo_eval on the checkpoint: no tools key in the eval config, the checkpoint's are used
    step = out / "step_2"
    (step / "eval_samples.jsonl").unlink()
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_quickstart", f"checkpoint_dir={step}",
              "max_generated_tokens=12", "progress_bar=false"], cwd=tmp_path, threads=2)
    _check_transcripts(step / "eval_samples.jsonl")
    results = json.loads((step / "eval_results.json").read_text())
    assert results["metrics"]["tools/calls_per_completion"] > 0
    # tools: null in the eval config: single-turn, no transcripts
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_quickstart", f"checkpoint_dir={step}",
              "max_generated_tokens=12", "progress_bar=false", "tools=null"],
             cwd=tmp_path, threads=2)
    first = json.loads((step / "eval_samples.jsonl").read_text().splitlines()[0])
    assert "transcripts" not in first


def test_tool_tokens_carry_no_logprob_and_no_loss(base_model, tmp_path):
    """In the recipe's update, every micro-batch's loss mask excludes the tool tokens, their
    log-probs and entropies are 0, and the loss normaliser counts policy tokens only; the
    logged lengths count policy tokens, ``tools/result_tokens`` the tool tokens."""
    from torchtune_grpo.rollout.tool_trajectory import decode_with_tools
    from torchtune_grpo.training.recipe import GRPORecipe

    out = tmp_path / "run"
    # every rollout goes through the update (the counts below include tied groups)
    cfg = quickstart_config(base_model, out, "num_steps=1", "ppo_epochs=2",
                            "forward_batch_size=32", "loss.aggregation=token_mean",
                            "skip_zero_advantage_sequences=false", *TOOL_OVERRIDES)
    recipe = GRPORecipe(cfg)
    recipe.setup()
    seen = {"rows": None, "loss_tokens": 0, "micro_batches": 0}
    updates = []

    micro_batch_logprobs = recipe.policy_update.micro_batch_logprobs

    def spy_logprobs(model, traj, rows, **kwargs):
        logprobs, entropy = micro_batch_logprobs(model, traj, rows, **kwargs)
        tool = traj.tool_mask[rows]
        assert not (traj.response_mask[rows] & tool).any()
        assert (logprobs[tool] == 0).all()
        if entropy is not None:
            assert (entropy[tool] == 0).all()
        seen["rows"], seen["traj"] = rows, traj
        return logprobs, entropy

    loss_forward = recipe.loss_fn.forward

    def spy_loss(logprobs, old, advantages, mask, **kwargs):
        tool = seen["traj"].tool_mask[seen["rows"]]
        assert not (mask & tool).any(), "a tool token entered the loss"
        seen["loss_tokens"] += int(mask.sum())
        seen["micro_batches"] += 1
        return loss_forward(logprobs, old, advantages, mask, **kwargs)

    update = recipe.update

    def spy_update(traj, advantages, ref, loss_mask=None, **kwargs):
        updates.append((traj, loss_mask))
        return update(traj, advantages, ref, loss_mask, **kwargs)

    recipe.policy_update.micro_batch_logprobs = spy_logprobs
    recipe.loss_fn.forward = spy_loss
    recipe.update = spy_update
    try:
        recipe.train()
    finally:
        recipe.cleanup()

    (traj, loss_mask), = updates
    assert traj.tool_mask.any(), "no tool call: the test needs some"
    assert not (loss_mask & traj.tool_mask).any()
    assert seen["micro_batches"] == 2 * traj.num_sequences // 32
    assert seen["loss_tokens"] == 2 * int(loss_mask.sum())  # ppo_epochs passes
    (row,) = train_metrics(out)
    _check_tool_metrics([row])
    n = traj.num_sequences
    assert row["response_length/mean"] == pytest.approx(float(traj.response_mask.sum()) / n)
    assert row["tools/result_tokens"] == pytest.approx(float(traj.tool_mask.sum()) / n)
    calls = torch.tensor([len(s) for s in _tool_runs(traj.tool_mask)], dtype=torch.float)
    assert row["tools/calls_per_completion"] == pytest.approx(float(calls.sum()) / n)
    # the step folder carries the tools for grpo_eval
    from torchtune_grpo.checkpoints.step_folder import tool_settings_from_checkpoint

    saved = tool_settings_from_checkpoint(out / "step_1")
    assert [dict(t) for t in saved["tools"]] == json.loads(TOOL_OVERRIDES[0][len("tools="):])
    assert saved["max_tool_calls"] == 2 and saved["tool_syntax"]["call_open"] == "6"
    assert tool_settings_from_checkpoint(base_model) == {"tools": None}  # no recipe state
    # the rewards read the model's and the tools' text (length reward: characters)
    texts = decode_with_tools(recipe.tokenizer, traj, recipe.stop_tokens.tolist())
    assert row["reward/mean"] == pytest.approx(sum(map(len, texts)) / n)
    assert any("(" in t for t in texts)


def test_the_tool_loop_around_the_native_engine_runs_the_policy():
    """The recipe gathers an FSDP2 policy's weights once per rollout for engines that run the
    policy: the native one, alone or inside the tool loop (not, e.g., vLLM)."""
    from torchtune_grpo.rollout.multiturn import ToolUseGenerator
    from torchtune_grpo.rollout.native import NativeGenerator
    from torchtune_grpo.rollout.tools.calculator import Calculator
    from torchtune_grpo.rollout.vllm_engine import VLLMGenerator

    assert NativeGenerator().runs_policy()
    assert ToolUseGenerator([Calculator()]).runs_policy()
    assert ToolUseGenerator([Calculator()], inner=ToolUseGenerator()).runs_policy()
    vllm = VLLMGenerator.__new__(VLLMGenerator)  # not set up: no vLLM needed
    assert not vllm.runs_policy()
    assert not ToolUseGenerator([Calculator()], inner=vllm).runs_policy()


def _tool_runs(tool_mask: torch.Tensor) -> list[list[int]]:
    """Per row, the start positions of its runs of tool tokens (one run per result)."""
    starts = tool_mask & ~torch.nn.functional.pad(tool_mask, (1, 0))[:, :-1]
    return [row.nonzero().squeeze(1).tolist() for row in starts]


@pytest.mark.slow
def test_one_and_two_ranks_take_the_same_first_step_with_tools(base_model, tmp_path):
    """1 rank vs 2 ranks (FSDP2, gloo) with tools: the same rollouts (rows in different
    turns on different ranks stay in lockstep), the same tool counts, the same update."""
    runs = []
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        args = quickstart_overrides(
            base_model, out, "num_steps=1", "global_batch_size=4", "batch_size=null",
            "group_size=4", "forward_batch_size=4", "loss.aggregation=token_mean",
            "loss.entropy_coeff=0.01", "temperature=1.5", *TOOL_OVERRIDES)
        run_tune([*launch(nproc), *args], cwd=tmp_path, threads=1)
        runs.append(train_metrics(out))
    (one,), (two,) = runs
    _check_tool_metrics([one, two])
    for key in ("reward/mean", "response_length/mean", *TOOL_METRICS):
        assert two[key] == one[key], key
    for key in ("loss", "grad_norm", "entropy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
