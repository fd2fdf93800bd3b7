"""The quickstart task: write a number's digits in reverse order (``"rev(3812)="`` -> ``"2183"``).

Problems are generated, not downloaded. Every number of ``num_digits`` digits drawn from 1-9
(no zeros, so a reversed answer never has a leading zero and its numeric value is its text)
is shuffled once with a fixed seed and cut into three disjoint splits: ``test`` (held out for
evaluation), ``warmup`` (only for the quickstart's supervised warm-up, see
:mod:`torchtune_grpo.quickstart`) and ``train`` (GRPO prompts). The prompt is the plain text
``"rev(3812)="`` after the BOS token; the completion is the reversed number, ended by a stop
token, and is scored by :class:`~torchtune_grpo.rlhf.rewards.NumericCorrectness` with
``answer_tag: null``.

Each problem needs its own answer: no constant output scores more than one problem in
``9 ** num_digits``, and echoing the digits unreversed scores only on palindromes.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from torchtune_grpo.datasets._prompt import PromptDataset, PromptTemplate

#: Number of digits of every problem (digits are 1-9, so there are ``9 ** NUM_DIGITS`` problems).
NUM_DIGITS = 4
#: Sizes of the held-out and warm-up splits; ``train`` takes the rest.
SPLIT_SIZES = {"test": 300, "warmup": 2000}
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 1234
#: Plain-text prompt: the question as is, no chat headers.
REVERSAL_TEMPLATE = PromptTemplate(user="{question}", chat=False)


def reversal_question(digits: str) -> str:
    """The prompt text for ``digits``: ``"3812"`` -> ``"rev(3812)="``."""
    return f"rev({digits})="


def reversal_problems(split: str, *, num_digits: int = NUM_DIGITS) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs, e.g. ``("rev(3812)=", "2183")``.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"`` (see the module docstring).
        num_digits: number of digits of every problem.

    Raises:
        ValueError: on an unknown split, or when ``num_digits`` gives too few problems for the
            held-out and warm-up splits.
    """
    numbers = ["".join(d) for d in itertools.product("123456789", repeat=num_digits)]
    random.Random(SPLIT_SEED).shuffle(numbers)
    n_test, n_warm = SPLIT_SIZES["test"], SPLIT_SIZES["warmup"]
    if len(numbers) <= n_test + n_warm:
        raise ValueError(
            f"num_digits={num_digits} gives {len(numbers)} problems, too few for the "
            f"{n_test} held-out and {n_warm} warm-up problems; use num_digits >= 4"
        )
    ranges = {
        "test": numbers[:n_test],
        "warmup": numbers[n_test : n_test + n_warm],
        "train": numbers[n_test + n_warm :],
    }
    if split not in ranges:
        raise ValueError(f"split must be one of {sorted(ranges)}, got {split!r}")
    return [(reversal_question(d), d[::-1]) for d in ranges[split]]


def reversal_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    num_digits: int = NUM_DIGITS,
    limit: int | None = None,
) -> PromptDataset:
    """The quickstart task as a :class:`PromptDataset`.

    Args:
        tokenizer: a torchtune tokenizer.
        split: ``"train"``, ``"test"`` or ``"warmup"``.
        num_digits: number of digits of every problem.
        limit: keep only the first ``limit`` problems of the split.
    """
    problems = reversal_problems(split, num_digits=num_digits)[:limit]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, REVERSAL_TEMPLATE, name=f"reversal[{split}]")
