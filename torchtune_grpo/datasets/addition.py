"""The quickstart task: two-number addition as text (``"37+45="`` -> ``"82"``).

Problems are generated, not downloaded. All ``(a, b)`` pairs with operands in
``0 .. max_operand`` are shuffled once with a fixed seed and cut into three disjoint splits:
``test`` (held out for evaluation), ``warmup`` (only for the quickstart's supervised warm-up)
and ``train`` (GRPO prompts). The prompt is the plain text ``"a+b="`` after the BOS token; the
completion is the number, ended by a stop token.
"""

from __future__ import annotations

import random
from typing import Any

from torchtune_grpo.datasets._prompt import PromptDataset, PromptTemplate

#: Operands are drawn from ``0 .. MAX_OPERAND``.
MAX_OPERAND = 99
#: Sizes of the held-out and warm-up splits; ``train`` takes the rest.
SPLIT_SIZES = {"test": 200, "warmup": 2000}
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 1234
#: Plain-text prompt: the question as is, no chat headers.
ADDITION_TEMPLATE = PromptTemplate(user="{question}", chat=False)


def addition_problems(split: str, *, max_operand: int = MAX_OPERAND) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs, e.g. ``("37+45=", "82")``.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"`` (see the module docstring).
        max_operand: operands range over ``0 .. max_operand``.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    n_test, n_warm = SPLIT_SIZES["test"], SPLIT_SIZES["warmup"]
    if len(pairs) <= n_test + n_warm:
        raise ValueError(
            f"max_operand={max_operand} gives {len(pairs)} problems, too few for the "
            f"{n_test} held-out and {n_warm} warm-up problems; use max_operand >= 50"
        )
    ranges = {
        "test": pairs[:n_test],
        "warmup": pairs[n_test : n_test + n_warm],
        "train": pairs[n_test + n_warm :],
    }
    if split not in ranges:
        raise ValueError(f"split must be one of {sorted(ranges)}, got {split!r}")
    return [(f"{a}+{b}=", str(a + b)) for a, b in ranges[split]]


def addition_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    max_operand: int = MAX_OPERAND,
    limit: int | None = None,
) -> PromptDataset:
    """The quickstart task as a :class:`PromptDataset`.

    Args:
        tokenizer: a torchtune tokenizer.
        split: ``"train"``, ``"test"`` or ``"warmup"``.
        max_operand: operands range over ``0 .. max_operand``.
        limit: keep only the first ``limit`` problems of the split.
    """
    problems = addition_problems(split, max_operand=max_operand)[:limit]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, ADDITION_TEMPLATE, name=f"addition[{split}]")
