"""Evaluation metrics against their definitions, and the evaluate() loop on a tiny model."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from torchtune_grpo.datasets import addition_dataset
from torchtune_grpo.evaluation import (
    RESULTS_FILE,
    SAMPLES_FILE,
    EvalSettings,
    evaluate,
    majority_correct,
    pass_at_k,
)
from torchtune_grpo.modeling import token_rules
from torchtune_grpo.rlhf.rewards import build_reward_set


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k))
    assert pass_at_k(n, 0, 1) == 0.0
    assert pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_hand_values_and_errors():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_vote():
    # answer 7 wins 2-1 and is wrong; with k=1 only the first (right) sample votes
    assert majority_correct([5, 7, 7], [True, False, False], 3) is False
    assert majority_correct([5, 7, 7], [True, False, False], 1) is True
    assert majority_correct([None, None, 5], [False, False, True], 3) is True
    assert majority_correct([None, None], [False, False], 2) is False
    assert majority_correct([3, 4], [False, True], 2) is False  # tie: first seen wins


def test_settings_validation():
    with pytest.raises(ValueError, match="temperature"):
        EvalSettings(num_samples=4, temperature=0.0)
    with pytest.raises(ValueError, match="k values"):
        EvalSettings(num_samples=2, temperature=1.0, k=[4])


def test_evaluate_writes_results_and_samples(tokenizer, tiny_model, tmp_path):
    dataset = addition_dataset(tokenizer, split="test", limit=12)
    rewards = build_reward_set([{
        "_component_": "torchtune_grpo.rlhf.rewards.NumericCorrectness",
        "answer_tag": None, "success": True,
    }])
    rules = token_rules(tokenizer, tiny_model, torch.device("cpu"))
    settings = EvalSettings(num_samples=4, temperature=1.0, k=[1, 2, 4],
                            max_generated_tokens=4, forward_batch_size=16)
    result = evaluate(tiny_model, tokenizer, dataset, rewards, settings,
                      device=torch.device("cpu"), logit_bias=rules.logit_bias,
                      allowed_tokens=rules.allowed, stop_tokens=rules.stop_tokens,
                      pad_id=rules.pad_id)
    assert len(result.samples) == 12
    assert [r["index"] for r in result.samples] == list(range(12))
    # metrics recomputed from the per-problem rows
    p1 = sum(sum(r["correct"]) / 4 for r in result.samples) / 12
    assert result.metrics["pass@1"] == pytest.approx(p1)
    assert result.metrics["pass@4"] == pytest.approx(
        sum(any(r["correct"]) for r in result.samples) / 12)
    assert {"maj@2", "maj@4", "reward/correctness"} <= set(result.metrics)
    result.write(tmp_path, dataset="addition", split="test", model_path="tiny")
    summary = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert summary["num_problems"] == 12 and summary["dataset"] == "addition"
    assert summary["sampling"]["num_samples"] == 4 and summary["metrics"] == result.metrics
    lines = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 12
    row = json.loads(lines[0])
    assert {"prompt", "completions", "extracted", "gold", "correct"} <= set(row)
    assert len(row["completions"]) == 4
