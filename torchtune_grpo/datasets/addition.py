"""The quickstart task: add 1111 to a four-digit number (``"3812+1111="`` -> ``"4923"``).

The 4096 first operands have digits 1-8 (no carry). They are shuffled once with
:data:`SPLIT_SEED` into disjoint ``test``, ``warmup`` (supervised warm-up) and ``train`` splits;
the prompt is plain text after BOS.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.datasets._prompt import (
    PromptDataset,
    PromptTemplate,
    check_limit,
    check_split,
)

#: The second operand of every problem.
ADDEND = 1111
#: Digits of the first operand (1-8, so that adding 1111 never carries).
OPERAND_DIGITS = "12345678"
#: Number of digits of the first operand.
NUM_DIGITS = 4
#: Sizes of the held-out and warm-up splits; ``train`` takes the rest (2796 problems).
SPLIT_SIZES = {"test": 300, "warmup": 1000}
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 1234
#: Plain-text prompt: the question as is, no chat headers.
ADDITION_TEMPLATE = PromptTemplate(user="{question}", chat=False)


def addition_operands(split: str) -> list[int]:
    """First operands of one split, in the split's fixed order.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"``.

    Raises:
        ValueError: on an unknown or sliced split.
    """
    check_split("addition", split, ("train", "test", "warmup"))
    numbers = [int("".join(d)) for d in itertools.product(OPERAND_DIGITS, repeat=NUM_DIGITS)]
    random.Random(SPLIT_SEED).shuffle(numbers)
    n_test, n_warm = SPLIT_SIZES["test"], SPLIT_SIZES["warmup"]
    ranges = {
        "test": numbers[:n_test],
        "warmup": numbers[n_test : n_test + n_warm],
        "train": numbers[n_test + n_warm :],
    }
    return ranges[split]


def addition_problems(split: str) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"``.

    Raises:
        ValueError: on an unknown split.
    """
    return [(f"{a}+{ADDEND}=", str(a + ADDEND)) for a in addition_operands(split)]


def addition_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    limit: int | None = None,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """The quickstart task as a :class:`PromptDataset`.

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
    problems = addition_problems(split)[:check_limit("addition_dataset", limit)]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, ADDITION_TEMPLATE, name=f"addition[{split}]",
                         difficulty_file=difficulty_file, difficulty_band=difficulty_band)
