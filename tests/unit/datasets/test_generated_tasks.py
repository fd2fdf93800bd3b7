"""The real-model ladder's generated tasks: arithmetic in chat and one-step word problems."""

from __future__ import annotations

import collections
import re

import pytest

from torchtune_grpo.datasets import (
    ARITHMETIC_TEMPLATE,
    WORD_PROBLEM_TEMPLATE,
    arithmetic_dataset,
    arithmetic_problems,
    word_problem_dataset,
    word_problems,
)
from torchtune_grpo.datasets.word_problems import HELD_OUT_TEMPLATES, TEMPLATES


def _value(question: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_arithmetic_splits_are_disjoint_correct_and_fixed():
    test, train = arithmetic_problems("test"), arithmetic_problems("train")
    assert len(test) == 480 and len(train) == 3 * (8100 - 160)  # each op as often as add
    assert not {q for q, _ in test} & {q for q, _ in train}
    # every training problem is used: the shorter operations repeat, none is dropped
    assert len(set(train)) == 8100 + 4095 + 720 - 480
    ops = collections.Counter(q.split()[3] for q, _ in train)
    assert ops["+"] == ops["-"] == ops["*"]
    assert all(str(_value(q)) == a for q, a in test + train)
    assert all(int(a) >= 0 for _, a in test + train)  # subtraction never goes negative
    # train interleaves the operations: any prefix holds all three
    assert {q.split()[3] for q, _ in train[:3]} == {"+", "-", "*"}
    assert arithmetic_problems("test") == test  # the same problems every time
    assert len(arithmetic_problems("test", ["mul"])) == 160
    with pytest.raises(ValueError, match="operations"):
        arithmetic_problems("train", ["div"])
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems("dev")


def test_equation_style_is_the_same_problems_as_plain_text():
    """``style="equation"`` writes the same problems, in the same order, as ``"47 + 38 ="``;
    :data:`EQUATION_TEMPLATE` sends them as plain text (no chat template)."""
    from torchtune_grpo.datasets import EQUATION_TEMPLATE

    questions = arithmetic_problems("test")
    equations = arithmetic_problems("test", style="equation")
    assert [a for _, a in equations] == [a for _, a in questions]
    for (q, _), (e, _) in zip(questions, equations):
        assert e == q.removeprefix("What is ").removesuffix("?") + " ="
    assert EQUATION_TEMPLATE.chat is False and EQUATION_TEMPLATE.format_user("1 + 2 =") == "1 + 2 ="
    with pytest.raises(ValueError, match="style"):
        arithmetic_problems("test", style="prose")
    # the few-shot lines are solved correctly and are problems of neither split
    from torchtune_grpo.datasets import EQUATION_FEW_SHOT_TEMPLATE

    every = {q for split in ("train", "test")
             for q, _ in arithmetic_problems(split, style="equation")}
    lines = EQUATION_FEW_SHOT_TEMPLATE.user.split("\n")
    assert lines[-1] == "{question}" and EQUATION_FEW_SHOT_TEMPLATE.chat is False
    for line in lines[:-1]:
        question, answer = line.split(" = ")
        assert question + " =" not in every and _value(f"What is {question}?") == int(answer)


def test_word_problems_splits_answers_and_held_out_wording():
    test, train = word_problems("test"), word_problems("train")
    assert len(test) == 400 and len(train) == 20_000
    assert not {p["question"] for p in test} & {p["question"] for p in train}
    assert {p["operation"] for p in test} == set(TEMPLATES)
    held = [p for p in test if p["heldout_wording"]]
    assert 0 < len(held) < len(test)
    assert not any(p["heldout_wording"] for p in train)
    for p in train[:200] + test:
        numbers = [int(x) for x in re.findall(r"\d+", p["question"])]
        a, b = numbers[0], numbers[1]
        expected = {"add": a + b, "sub": a - b, "mul": a * b, "div": a // b}[p["operation"]]
        if p["operation"] == "div":
            assert a % b == 0
        assert int(p["answer"]) == expected > 0, p
    # every wording of every operation shows up (the held-out ones in test only)
    for op, wordings in TEMPLATES.items():
        assert HELD_OUT_TEMPLATES[op] == len(wordings) - 1


def test_chat_datasets_render_in_the_model_template(tokenizer):
    ds = arithmetic_dataset(tokenizer, split="test", limit=5)
    assert len(ds) == 5 and ds[0]["answer"] == arithmetic_problems("test")[0][1]
    assert ARITHMETIC_TEMPLATE.chat and "{question}" in ARITHMETIC_TEMPLATE.user
    wp = word_problem_dataset(tokenizer, split="test", operations=["div"], limit=3)
    assert len(wp) == 3 and all("equal" in wp[i]["question"] or "each" in wp[i]["question"]
                                for i in range(3))
    assert WORD_PROBLEM_TEMPLATE.chat
    with pytest.raises(ValueError, match="limit"):
        arithmetic_dataset(tokenizer, limit=0)
    with pytest.raises(ValueError, match="operations"):
        word_problem_dataset(tokenizer, operations=["pow"])
