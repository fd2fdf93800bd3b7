"""The metrics of an evaluation (:func:`compute_metrics`): pass@k with a Wilson interval for
pass@1, maj@k, reward means, completion length and tool use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.evaluation.stats import wilson_interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: samples drawn.
        c: correct samples among them.
        k: budget (``k <= n``).

    Raises:
        ValueError: ``k`` outside ``(0, n]`` or ``c`` outside ``[0, n]``.
    """
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0
    # prod_{i = n-c+1}^{n} (1 - k / i), the numerically stable form of the ratio
    result = 1.0
    for i in range(n - c + 1, n + 1):
        result *= 1.0 - k / i
    return 1.0 - result


def majority_correct(answers: Sequence[Any], correct: Sequence[bool], k: int) -> bool:
    """maj@k of one problem: is the most frequent extracted answer of the first ``k`` right?
    (``None`` answers do not vote, ties go to the answer seen first, no votes is wrong.)
    """
    votes = [(a, c) for a, c in zip(answers[:k], correct[:k]) if a is not None]
    if not votes:
        return False
    counts = Counter(a for a, _ in votes)
    best = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == best)
    return next(c for a, c in votes if a == winner)


def compute_metrics(rows: list[dict[str, Any]], settings: EvalSettings) -> dict[str, float]:
    """The metrics of an evaluation from its per-problem rows.

    Args:
        rows: one row per problem, as :func:`~torchtune_grpo.evaluation.evaluate.evaluate`
            builds them (``correct``, ``extracted``, ``rewards``, ``completions``;
            ``transcripts`` with tools).
        settings: the sampling settings (``num_samples``, the ``k`` of pass@k and maj@k).

    Returns:
        ``pass@k`` for every ``k`` (and 1), ``pass@1/ci95_low`` and ``_high``, ``maj@k`` for
        ``k > 1``, ``reward/<name>``, ``response_chars/mean`` and, with tools,
        ``tools/calls_per_completion`` and ``tools/errors``; ``{}`` for no rows.
    """
    if not rows:
        return {}
    n = settings.num_samples
    metrics: dict[str, float] = {}
    for k in sorted(set(settings.k) | {1}):
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(r["correct"]), k) for r in rows) / len(rows)
        if k == 1:  # 95% Wilson interval over problems (of per-problem pass rates when n > 1)
            low, high = wilson_interval(metrics["pass@1"] * len(rows), len(rows))
            metrics["pass@1/ci95_low"], metrics["pass@1/ci95_high"] = low, high
        if k > 1:
            metrics[f"maj@{k}"] = sum(
                majority_correct(r["extracted"], r["correct"], k) for r in rows
            ) / len(rows)
    for name in rows[0]["rewards"]:
        values = [v for r in rows for v in r["rewards"][name]]
        metrics[f"reward/{name}"] = sum(values) / len(values)
    metrics["response_chars/mean"] = sum(len(c) for r in rows for c in r["completions"]) / (
        len(rows) * n
    )
    if "transcripts" in rows[0]:  # a multi-turn evaluation: tool results per completion
        results = [s["text"] for r in rows for t in r["transcripts"] for s in t
                   if s["source"] == "tool"]
        metrics["tools/calls_per_completion"] = len(results) / (len(rows) * n)
        metrics["tools/errors"] = sum(_is_tool_error(t) for t in results) / (len(rows) * n)
    return metrics


def _is_tool_error(segment: str) -> bool:
    """Whether a tool segment's text (``<result>error: ...</result>``) reports an error."""
    from torchtune_grpo.rollout.tools.base import ERROR_PREFIX

    return ERROR_PREFIX in segment
