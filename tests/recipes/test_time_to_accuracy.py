"""Smoke test of ``benchmarks.time_to_accuracy``: our side end to end at a tiny shape, and the
two sides' held-out evaluations agreeing on the same weights (TRL itself only where
``.venv-trl`` exists)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import time_to_accuracy as tta
from benchmarks.peers import trl_time_to_accuracy as peer
from tests.recipes._helpers import recipe_env
from torchtune_grpo.rewards.components import NumericCorrectness

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: A tiny shape of the real model: 2 prompts x 2 completions x 8 tokens a step, 6 held-out
#: problems (2 per operation) answered in up to 16 tokens.
TINY = ["--budget-s", "1", "--eval-every-s", "0.5", "--eval-problems", "6", "--threads", "1",
        "--override", "batch_size=2", "--override", "group_size=2",
        "--override", "max_generated_tokens=8", "--override", "forward_batch_size=4",
        "--override", "eval.max_generated_tokens=16"]

#: Completions and gold answers on which the last-number rule has to be read carefully.
CASES = [
    ("47 + 38 = 85", "85"), ("The answer is 85.", "85"), ("85 apples, or 86", "85"),
    ("It is 1,000", "1000"), ("-7", "-7"), ("10-3", "7"), ("x = \u22127", "-7"),
    ("$18.00", "18"), ("3/4", "0.75"), ("no number here", "5"), ("", "0"),
    ("The result is 12<|im_end|>", "12"), ("50%", "50"), ("1e3", "1000"), ("7 * 74 = 518", "518"),
]


def test_scoring_rule_is_numeric_correctness():
    """The peer's rule (our answers.py loaded by path, as the spec names it) scores every
    string as ``NumericCorrectness(answer_tag=None)``, our reward and held-out score."""
    correct = peer.load_scorer({"rule": "last_number", "module_file": str(tta.SCORING_MODULE),
                                "rel_tol": 1e-6})
    ours = NumericCorrectness(answer_tag=None)
    got = [1.0 if correct(text, gold) else 0.0 for text, gold in CASES]
    assert got == ours([t for t, _ in CASES], [g for _, g in CASES])
    assert 0.0 < sum(got) < len(CASES)  # both outcomes are exercised
    with pytest.raises(ValueError, match="rule"):
        peer.load_scorer({"rule": "answer_tag", "module_file": str(tta.SCORING_MODULE)})


def test_cut_at_stop():
    assert peer.cut_at_stop([5, 6, 2, 7, 2], [2]) == [5, 6]
    assert peer.cut_at_stop([5, 6], [2, 0]) == [5, 6]


def test_heldout_subset_is_balanced():
    from torchtune_grpo.datasets import arithmetic_problems

    test = arithmetic_problems("test")
    assert [i for i, _, _ in tta.heldout_problems()] == list(range(480))
    sub = tta.heldout_problems(31)
    ops = [q.split()[3] for _, q, _ in sub]
    assert (ops.count("+"), ops.count("-"), ops.count("*")) == (11, 10, 10)
    assert all(test[i] == (q, a) for i, q, a in sub)
    for bad in (0, 481, 2.5):
        with pytest.raises(ValueError, match="from 1 to 480"):
            tta.heldout_problems(bad)


def test_time_to_target_and_summary():
    pts = [{"step": 0, "train_seconds": 0.0, "generated_tokens": 0, "heldout_accuracy": 0.1},
           {"step": 5, "train_seconds": 50.0, "generated_tokens": 900, "heldout_accuracy": 0.6},
           {"step": 9, "train_seconds": 90.0, "generated_tokens": 1500, "heldout_accuracy": 0.5}]
    slow = [dict(p, train_seconds=p["train_seconds"] * 3) for p in pts]
    assert tta.time_to_target(pts, 0.6)["seconds"] == 50.0
    assert tta.time_to_target(pts, 0.7) is None
    for p in pts + slow:
        p["correct"] = "01"
    s = tta.summarize({"ours": {"complete": True, "points": pts},
                       "trl": {"complete": True, "points": slow}}, 0.6,
                      {"eval_problems": 2, "threads": 1, "budget_s": 270.0}, "cmd")
    assert s["trl_over_ours"] == pytest.approx(3.0) and s["goal_2x_met"]
    at_half = next(m for m in s["milestones"] if m["accuracy"] == 0.5)
    assert (at_half["ours_step"], at_half["trl_step"]) == (5, 5)
    assert (at_half["ours_seconds"], at_half["trl_seconds"]) == (50.0, 150.0)
    assert "| 0.5 | 50 (5) | 150 (5) | 3.00 |" in tta.summary_markdown(s)
    s = tta.summarize({"ours": {"complete": True, "points": pts},
                       "trl": {"complete": True, "points": pts[:1]}}, 0.6, {}, "cmd")
    assert s["trl_over_ours"] is None and s["goal_2x_met"] and "only ours" in s["verdict"]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.time_to_accuracy", "--quick", *TINY,
         "--out", str(out), *extra],
        cwd=ROOT, env=recipe_env(threads=1), capture_output=True, text=True, timeout=600,
        check=False)


@pytest.fixture(scope="module")
def ours_out(smollm2, tmp_path_factory) -> Path:
    """``--quick --sides ours`` at the tiny shape, run once for this module."""
    out = tmp_path_factory.mktemp("tta") / "out"
    proc = _run(out, "--model-dir", str(smollm2), "--sides", "ours")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_our_side_quick_and_same_weights_same_accuracy(smollm2, ours_out, tmp_path):
    """``--quick --sides ours`` writes the spec, the points, the plot and the summary; the
    peer's HF-generate evaluation of the same (base) weights on the spec's held-out prompts
    gives our recipe's completions and accuracy exactly; a complete result is not rerun."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tta"
    shutil.copytree(ours_out, out)

    ours = json.loads((out / "ours.json").read_text())
    assert ours["complete"] and ours["settings"]["eval_problems"] == 6
    points = ours["points"]
    assert points[0]["step"] == 0 and points[0]["generated_tokens"] == 0
    assert len(points) >= 2 and points[-1]["step"] == ours["steps"] >= 1
    assert points[-1]["train_seconds"] >= 1.0  # stopped at the end of the step that spent it
    assert [p["step"] for p in points] == sorted({p["step"] for p in points})
    assert all(len(p["correct"]) == 6 and 0 <= p["heldout_accuracy"] <= 1 for p in points)

    spec = json.loads((out / "spec.json").read_text())
    assert spec["batch_size"] == 2 and spec["group_size"] == 2 and spec["new_tokens"] == 8
    assert spec["eval_new_tokens"] == 16 and spec["learning_rate"] == 1e-5
    assert spec["heldout"]["indices"] == [0, 1, 160, 161, 320, 321] == ours["heldout_indices"]
    assert len(spec["prompts_per_step"]) == tta.spec_steps(1.0)
    assert all(len(s["tokens"]) == 2 for s in spec["prompts_per_step"])

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["sides"]) == {"ours"} and summary["target"] == 0.6
    assert "| torchtune-grpo (ours) |" in (out / "summary.md").read_text()
    assert (out / "time_to_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # same weights, same accuracy: the peer's evaluator on the base model
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    got = peer.greedy_heldout(
        model, tokenizer, spec["heldout"]["tokens"], spec["heldout"]["answers"],
        peer.load_scorer(spec["scoring"]), new_tokens=spec["eval_new_tokens"],
        batch_size=4, stop_ids=spec["stop_token_ids"], pad_id=spec["pad_id"])
    assert got["completions"] == points[0]["completions"]
    assert "".join("1" if c else "0" for c in got["correct"]) == points[0]["correct"]
    assert got["accuracy"] == points[0]["heldout_accuracy"]

    again = _run(out, "--model-dir", str(smollm2), "--sides", "ours")
    assert again.returncode == 0 and "not rerun" in again.stdout


def test_trl_side_quick(smollm2, ours_out, tmp_path):
    """TRL's side at the tiny shape, after ours: the peer keeps our prompt order and ids, and
    both evaluate the base model alike (skipped without ``.venv-trl``)."""
    python = ROOT / ".venv-trl" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"TRL side NOT RUN: {python} is absent (bash benchmarks/peers/setup_trl.sh)")
    out = tmp_path / "tta"
    shutil.copytree(ours_out, out)
    proc = _run(out, "--model-dir", str(smollm2), "--peer-python", str(python))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "not rerun" in proc.stdout  # our complete side is reused
    trl = json.loads((out / "trl.json").read_text())
    assert trl["complete"] and trl["prompt_ids_match"] and trl["prompt_order_match"]
    assert trl["points"][0]["step"] == 0 and trl["steps"] >= 1
    assert trl["points"][-1]["generated_tokens"] > 0
    summary = json.loads((out / "summary.json").read_text())
    check = summary["evaluator_check"]
    assert check["same_prompts"] and check["problems_scored_differently"] == 0
    assert check["identical_completions"] == 6 and check["same_accuracy"]
    assert set(summary["sides"]) == {"ours", "trl"}
