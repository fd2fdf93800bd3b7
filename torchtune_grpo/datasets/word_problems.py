"""One-step word problems in chat: "Tom has 12 apples and buys 7 more. How many apples ...?"

Generated from :data:`TEMPLATES`; ``train`` and ``test`` use different seeds
(:data:`SPLIT_SEEDS`) and share no question, and the wordings of :data:`HELD_OUT_TEMPLATES`
appear in ``test`` only.
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
    "HELD_OUT_TEMPLATES",
    "TEMPLATES",
    "WORD_PROBLEM_TEMPLATE",
    "word_problem_dataset",
    "word_problems",
]

#: The question and a one-line instruction as the user turn, in the model's chat template.
WORD_PROBLEM_TEMPLATE = PromptTemplate(
    user="{question} Answer with a number.", chat=True)
#: Problems in the ``test`` split (a quarter per operation).
TEST_SIZE = 400
#: Problems in the ``train`` split.
TRAIN_SIZE = 20_000
#: Seeds of the two splits (independent of a run's seed).
SPLIT_SEEDS = {"train": 7, "test": 8}

NAMES = ["Tom", "Anna", "Liam", "Maya", "Omar", "Sofia", "Ben", "Chloe", "Ravi", "Elena",
         "Jack", "Nora", "Leo", "Zara", "Sam", "Ivy", "Max", "Lucy", "Hugo", "Mia"]
#: (plural object, container, containers) triples.
OBJECTS = [("apples", "basket", "baskets"), ("pencils", "box", "boxes"),
           ("marbles", "bag", "bags"), ("stickers", "sheet", "sheets"),
           ("cookies", "tray", "trays"), ("books", "shelf", "shelves"),
           ("eggs", "carton", "cartons"), ("cards", "pack", "packs"),
           ("stamps", "album", "albums"), ("flowers", "vase", "vases"),
           ("coins", "jar", "jars"), ("shells", "bucket", "buckets")]

#: Wordings per operation. Fields: ``{name}``, ``{other}`` (a second name), ``{obj}``,
#: ``{box}`` / ``{boxes}`` (a container), ``{a}``, ``{b}``; the answer is ``a op b``.
TEMPLATES: dict[str, list[str]] = {
    "add": [
        "{name} has {a} {obj}. {name} gets {b} more {obj}. How many {obj} does {name} have now?",
        "There are {a} {obj} in the {box} and {b} {obj} on the table. How many {obj} are there "
        "in all?",
        "{name} picked {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} did {name} "
        "pick in total?",
        "{name} has {a} {obj} and {other} has {b} {obj}. How many {obj} do they have together?",
    ],
    "sub": [
        "{name} had {a} {obj} and gave {b} of them to {other}. How many {obj} does {name} have "
        "left?",
        "A {box} held {a} {obj}. {name} took out {b} {obj}. How many {obj} are still in the "
        "{box}?",
        "{name} needs {a} {obj} and already has {b}. How many more {obj} does {name} need?",
        "{name} has {a} {obj} and {other} has {b} {obj}. How many more {obj} does {name} have "
        "than {other}?",
    ],
    "mul": [
        "Each {box} holds {a} {obj}. How many {obj} are in {b} {boxes}?",
        "{name} buys {b} {boxes} of {obj}. Each {box} has {a} {obj}. How many {obj} does {name} "
        "buy?",
        "{name} puts {a} {obj} on each of {b} tables. How many {obj} are on the tables?",
        "There are {b} rows with {a} {obj} in each row. How many {obj} are there?",
    ],
    "div": [
        "{name} shares {a} {obj} equally among {b} friends. How many {obj} does each friend "
        "get?",
        "{a} {obj} are packed into {b} {boxes} with the same number in each. How many {obj} are "
        "in each {box}?",
        "{name} has {a} {obj} and puts {b} {obj} in each {box}. How many {boxes} does {name} "
        "fill?",
        "{a} {obj} are split into {b} equal groups. How many {obj} are in each group?",
    ],
}
#: Index of the wording of each operation used only in ``test``.
HELD_OUT_TEMPLATES = {op: len(wordings) - 1 for op, wordings in TEMPLATES.items()}
OPERATIONS = tuple(TEMPLATES)


def _numbers(op: str, rng: random.Random) -> tuple[int, int, int]:
    """``(a, b, answer)`` for one problem of ``op``."""
    if op == "add":
        a, b = rng.randint(10, 89), rng.randint(2, 49)
        return a, b, a + b
    if op == "sub":
        a = rng.randint(20, 99)
        b = rng.randint(2, a - 5)
        return a, b, a - b
    if op == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        return a, b, a * b
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    return b * q, b, q


def _draw(op: str, wording: int, rng: random.Random) -> tuple[str, str]:
    name, other = rng.sample(NAMES, 2)
    obj, box, boxes = rng.choice(OBJECTS)
    a, b, answer = _numbers(op, rng)
    text = TEMPLATES[op][wording].format(name=name, other=other, obj=obj, box=box,
                                         boxes=boxes, a=a, b=b)
    return text, str(answer)


def word_problems(split: str) -> list[dict[str, Any]]:
    """The problems of one split.

    Args:
        split: ``"train"`` or ``"test"``.

    Returns:
        Dicts with ``question``, ``answer`` (an integer as text), ``operation`` and
        ``heldout_wording`` (the wording never appears in ``train``), in the split's fixed
        order.

    Raises:
        ValueError: on an unknown or sliced split.
    """
    check_split("word_problems", split, tuple(SPLIT_SEEDS))
    rng = random.Random(SPLIT_SEEDS[split])
    train_questions = ({p["question"] for p in word_problems("train")}
                       if split == "test" else set())
    size = TEST_SIZE if split == "test" else TRAIN_SIZE
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(out) < size:
        op = OPERATIONS[len(out) % len(OPERATIONS)]
        wordings = range(len(TEMPLATES[op]))
        if split == "train":
            wordings = [w for w in wordings if w != HELD_OUT_TEMPLATES[op]]
        wording = rng.choice(list(wordings))
        question, answer = _draw(op, wording, rng)
        if question in seen or question in train_questions:
            continue
        seen.add(question)
        out.append({"question": question, "answer": answer, "operation": op,
                    "heldout_wording": wording == HELD_OUT_TEMPLATES[op]})
    return out


def word_problem_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    template: PromptTemplate | Any = None,
    limit: int | None = None,
    operations: Sequence[str] = OPERATIONS,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """One-step word problems as a :class:`PromptDataset` (``grpo/smollm2_word_problems_cpu``).

    Args:
        tokenizer: a torchtune tokenizer (with a chat template for the default template).
        split: ``"train"`` or ``"test"``.
        template: the prompt template (``None``: :data:`WORD_PROBLEM_TEMPLATE`).
        limit: keep only the first ``limit`` problems of the split (after ``operations``; its
            splits are whole: ``limit``, not ``split="test[:N]"``).
        operations: which of ``add``, ``sub``, ``mul``, ``div`` to keep.
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.

    Raises:
        ValueError: on an unknown or sliced split, an unknown operation, or a non-positive
            ``limit``.
    """
    ops = [operations] if isinstance(operations, str) else list(operations)
    if not ops or any(op not in TEMPLATES for op in ops):
        raise DataError(f"word_problem_dataset: operations must be names from "
                         f"{list(OPERATIONS)}, got {list(ops)!r}")
    check_limit("word_problem_dataset", limit)
    rows = [(p["question"], p["answer"], i) for i, p in enumerate(word_problems(split))
            if p["operation"] in ops][:limit]
    return PromptDataset(rows, tokenizer, template if template is not None
                         else WORD_PROBLEM_TEMPLATE, name=f"word_problems[{split}]",
                         difficulty_file=difficulty_file, difficulty_band=difficulty_band)
