"""Arithmetic in chat: "What is 47 + 38?" asked of a chat model in its own chat template.

Generated problems: ``add`` (two-digit + two-digit), ``sub`` (two-digit, non-negative) and
``mul`` (one-digit x two-digit), each shuffled once with :data:`SPLIT_SEED`; the first
:data:`TEST_PER_OPERATION` of each form ``test``, the rest ``train`` (operations interleaved).
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
from torchtune_grpo.errors import DataError

__all__ = [
    "ARITHMETIC_OPERATIONS",
    "ARITHMETIC_TEMPLATE",
    "EQUATION_FEW_SHOT_TEMPLATE",
    "EQUATION_TEMPLATE",
    "QUESTION_STYLES",
    "arithmetic_dataset",
    "arithmetic_problems",
]

#: The operations and their symbols in the question.
ARITHMETIC_OPERATIONS = {"add": "+", "sub": "-", "mul": "*"}
#: Held-out problems per operation (480 in the ``test`` split with all three).
TEST_PER_OPERATION = 160
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 2026
#: The question and a one-line instruction as the user turn, in the model's chat template.
ARITHMETIC_TEMPLATE = PromptTemplate(user="{question} Reply with the result only.", chat=True)
#: The equation alone as plain text, no chat template (``style="equation"``: ``"47 + 38 ="``),
#: for base models such as Gemma 3 270M.
EQUATION_TEMPLATE = PromptTemplate(user="{question}", chat=False)
#: :data:`EQUATION_TEMPLATE` after four solved equations, one a line, none of them a problem of
#: either split (operands outside their ranges): the answer format a base model then follows
#: (Gemma 3 270M: held-out greedy accuracy 0.07 without them, 0.17 with four such lines).
EQUATION_FEW_SHOT_TEMPLATE = PromptTemplate(
    user="5 + 8 = 13\n123 + 45 = 168\n15 - 9 = 6\n7 * 8 = 56\n{question}", chat=False)


def _operands(operation: str) -> list[tuple[int, int]]:
    if operation == "add":
        return [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if operation == "sub":
        return [(a, b) for a in range(10, 100) for b in range(10, a + 1)]
    return [(a, b) for a in range(2, 10) for b in range(10, 100)]


def _value(operation: str, a: int, b: int) -> int:
    return a + b if operation == "add" else a - b if operation == "sub" else a * b


def _check_operations(operations: Sequence[str]) -> list[str]:
    if isinstance(operations, str):
        operations = [operations]
    ops = list(operations)
    unknown = [op for op in ops if op not in ARITHMETIC_OPERATIONS]
    if not ops or unknown or len(set(ops)) != len(ops):
        raise DataError(
            f"arithmetic: operations must be distinct names from {sorted(ARITHMETIC_OPERATIONS)}, "
            f"got {list(operations)!r}"
        )
    return ops


#: How a problem is written: a question for chat models, an equation to complete for base
#: models (``"47 + 38 ="``: a plain-text prompt a base model continues with the result).
QUESTION_STYLES = {"question": "What is {a} {symbol} {b}?", "equation": "{a} {symbol} {b} ="}


def arithmetic_problems(
    split: str, operations: Sequence[str] = ("add", "sub", "mul"), style: str = "question",
) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs, e.g. ``("What is 47 + 38?", "85")``.

    Args:
        split: ``"train"`` or ``"test"``.
        operations: which of ``"add"``, ``"sub"``, ``"mul"`` to include.
        style: a key of :data:`QUESTION_STYLES`; the problems and their order do not depend on it.

    Returns:
        ``test`` by operation; ``train`` with the operations in turn, the shorter ones repeated
        so every operation comes equally often.

    Raises:
        ValueError: on an unknown or sliced split, or an unknown operation.
    """
    check_split("arithmetic", split, ("train", "test"))
    if style not in QUESTION_STYLES:
        raise DataError(f"arithmetic: style must be one of {sorted(QUESTION_STYLES)}, got "
                        f"{style!r}")
    per_op: list[list[tuple[str, str]]] = []
    for op in _check_operations(operations):
        pairs = _operands(op)
        random.Random(f"{SPLIT_SEED}-{op}").shuffle(pairs)
        chosen = pairs[:TEST_PER_OPERATION] if split == "test" else pairs[TEST_PER_OPERATION:]
        symbol = ARITHMETIC_OPERATIONS[op]
        per_op.append([(QUESTION_STYLES[style].format(a=a, symbol=symbol, b=b),
                        str(_value(op, a, b))) for a, b in chosen])
    if split == "test":
        return [p for problems in per_op for p in problems]
    out: list[tuple[str, str]] = []
    for i in range(max(len(p) for p in per_op)):
        out.extend(problems[i % len(problems)] for problems in per_op)
    return out


def arithmetic_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    operations: Sequence[str] = ("add", "sub", "mul"),
    style: str = "question",
    template: PromptTemplate | Any = None,
    limit: int | None = None,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """Arithmetic in chat as a :class:`PromptDataset` (``grpo/smollm2_arithmetic_cpu``).

    Args:
        tokenizer: a torchtune tokenizer (with a chat template for the default template).
        split: ``"train"`` or ``"test"``.
        operations: which of ``"add"``, ``"sub"``, ``"mul"`` to include.
        style: ``"question"`` (``"What is 47 + 38?"``) or ``"equation"`` (``"47 + 38 ="``).
        template: the prompt template (``None``: :data:`ARITHMETIC_TEMPLATE`).
        limit: keep only the first ``limit`` problems of the split (its splits are whole:
            ``limit``, not ``split="test[:N]"``).
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.

    Raises:
        ValueError: on an unknown or sliced split, an unknown operation, or a non-positive
            ``limit``.
    """
    check_limit("arithmetic_dataset", limit)
    problems = arithmetic_problems(split, operations, style)[:limit]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, template if template is not None
                         else ARITHMETIC_TEMPLATE, name=f"arithmetic[{split}]",
                         difficulty_file=difficulty_file, difficulty_band=difficulty_band)
