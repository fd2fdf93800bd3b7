"""The tool quickstart's task: multiply a two-digit by a three-digit number with the calculator.

``"What is 37*412?"`` -> ``15244``, 81,000 generated problems. The answer is the number after
the last ``Answer:`` (:data:`MULTIPLICATION_ANSWER_PHRASE`), never the tool's ``<result>``.
Shuffled once with :data:`SPLIT_SEED` into disjoint ``test``, ``warmup`` and ``train`` splits;
the prompt is plain text after BOS.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.datasets._prompt import (
    PromptDataset,
    PromptTemplate,
    check_limit,
    check_split,
)

#: Range of the first (two-digit) operand, inclusive.
FIRST_OPERAND = (10, 99)
#: Range of the second (three-digit) operand, inclusive.
SECOND_OPERAND = (100, 999)
#: Sizes of the held-out and warm-up splits; ``train`` takes the rest (75,700 problems).
MULTIPLICATION_SPLIT_SIZES = {"test": 300, "warmup": 5000}
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 4321
#: The phrase that introduces the final answer (the reward's ``answer_phrase``).
MULTIPLICATION_ANSWER_PHRASE = "Answer:"
#: Plain-text prompt: the question as is, no chat headers.
MULTIPLICATION_TEMPLATE = PromptTemplate(user="{question}", chat=False,
                                         answer_phrase=MULTIPLICATION_ANSWER_PHRASE)


def multiplication_operands(split: str) -> list[tuple[int, int]]:
    """Operand pairs ``(a, b)`` of one split, in the split's fixed order.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"``.

    Raises:
        ValueError: on an unknown or sliced split.
    """
    check_split("multiplication", split, ("train", "test", "warmup"))
    pairs = [(a, b) for a in range(FIRST_OPERAND[0], FIRST_OPERAND[1] + 1)
             for b in range(SECOND_OPERAND[0], SECOND_OPERAND[1] + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    n_test, n_warm = MULTIPLICATION_SPLIT_SIZES["test"], MULTIPLICATION_SPLIT_SIZES["warmup"]
    ranges = {
        "test": pairs[:n_test],
        "warmup": pairs[n_test : n_test + n_warm],
        "train": pairs[n_test + n_warm :],
    }
    return ranges[split]


def multiplication_question(a: int, b: int) -> str:
    """The prompt text of ``a * b``: ``"What is 37*412?"``."""
    return f"What is {a}*{b}?"


def multiplication_problems(split: str) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"``.

    Raises:
        ValueError: on an unknown split.
    """
    return [(multiplication_question(a, b), str(a * b)) for a, b in multiplication_operands(split)]


def multiplication_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    limit: int | None = None,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """The tool quickstart's task as a :class:`PromptDataset`.

    Args:
        tokenizer: a torchtune tokenizer.
        split: ``"train"``, ``"test"`` or ``"warmup"``.
        limit: keep only the first ``limit`` problems of the split (its splits are whole:
            ``limit``, not ``split="test[:N]"``).
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.

    Raises:
        ValueError: on an unknown or sliced split, or a non-positive ``limit``.
    """
    problems = multiplication_problems(split)[:check_limit("multiplication_dataset", limit)]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, MULTIPLICATION_TEMPLATE,
                         name=f"multiplication[{split}]", difficulty_file=difficulty_file,
                         difficulty_band=difficulty_band)
