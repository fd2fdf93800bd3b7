"""Tests of math-equivalence grading: extraction, math-verify equivalences, the time bound."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import shared_data
from torchtune_grpo.datasets import format_boxed_completion, math_gold_answer
from torchtune_grpo.rewards.answers import extract_boxed
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.rewards.math_grading import MathEquivalence, normalize_answer

pytest.importorskip("math_verify")

TIMEOUT_S = 1.0
# Upper bound on one pathological pair: the time limit, the kill grace (0.5 s) and slack for
# a loaded 2-core machine.
PATHOLOGICAL_BOUND_S = TIMEOUT_S + 2.5


@pytest.fixture(scope="module")
def grader():
    g = MathEquivalence(timeout_s=TIMEOUT_S)
    g(["\\boxed{1}"], ["1"])  # start the worker once for the module
    yield g
    g.close()


# ------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{5}$.", "5"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{ (1, 2] }", "(1, 2]"),
        ("\\boxed{3} and a truncated \\boxed{\\frac{1", "3"),
        ("\\fbox{7}", "7"),
        ("\\boxed 42.", "42."),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\boxed{\\boxed{4}}", "\\boxed{4}"),
        ("no box here: 5", None),
        ("\\boxed{", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_is_linear_on_adversarial_text():
    for text in ("\\boxed{" * 200_000, "{" * 300_000 + "\\boxed{1}", "\\{" * 300_000):
        start = time.perf_counter()
        extract_boxed(text)
        assert time.perf_counter() - start < 2.0


def test_extract_answer_and_fallbacks():
    plain = MathEquivalence()
    assert plain.extract_answer("so \\boxed{\\dfrac{1}{2}}.") == "\\frac{1}{2}"
    assert plain.extract_answer("\\boxed{ \\left( 3, 4 \\right) }") == "(3,4)"
    assert plain.extract_answer("the answer is $5$") is None
    assert plain.extract_answer("\\boxed{}") is None
    assert MathEquivalence(fallback="last_math").extract_answer("so $x=2$ and $5$.") == "5"
    assert MathEquivalence(fallback="last_number").extract_answer("it is 1,234.") == "1234"
    assert normalize_answer("\\tfrac{1}{2}\\,.") == "\\frac{1}{2}"


def test_bad_arguments():
    for kwargs, match in [
        ({"fallback": "last"}, "fallback"),
        ({"isolation": "thread"}, "isolation"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"max_answer_chars": 0}, "max_answer_chars"),
        ({"memory_limit_mb": -1}, "memory_limit_mb"),
    ]:
        with pytest.raises(ValueError, match=match):
            MathEquivalence(**kwargs)
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        MathEquivalence()(["a", "b"], ["1"])


# ------------------------------------------------------------------------------- equivalence

EQUIVALENT = [
    ("\\frac12", "0.5"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"),
    ("\\frac{1}{2}", "\\frac12"),
    ("(1,2]", "(1, 2]"),
    ("(-\\infty, 3)", "(-\\infty,3)"),
    ("[0,3)", "[0, 3)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("(3,-1)", "(3, -1)"),
    ("3\\sqrt{13}", "\\sqrt{117}"),
    ("p - q", "-q+p"),
    ("x=5", "5"),
    ("90^\\circ", "90"),
    ("10\\%", "10"),
    ("\\$18.90", "18.9"),
    ("\\text{Evelyn}", "\\text{Evelyn}"),
    ("\\text{(C)}", "C"),
    ("6 - 5i", "6-5i"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("1,2", "2, 1"),
]
DIFFERENT = [
    ("\\frac12", "0.51"),
    ("(1,2]", "[1,2]"),
    ("(3,-1)", "(3,1)"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("3\\sqrt{13}", "\\sqrt{118}"),
    ("\\frac{14}{3}", "\\frac{14}{3}+1"),
    ("p - q", "q - p"),
    ("\\pi", "3.14159"),
    ("2", "3"),
]


def test_equivalent_forms_score_one(grader):
    completions = [f"Work.\n\nThe final answer is $\\boxed{{{p}}}$." for _, p in EQUIVALENT]
    scores = grader(completions, [g for g, _ in EQUIVALENT])
    assert scores == [1.0] * len(EQUIVALENT), [
        e for e, s in zip(EQUIVALENT, scores, strict=True) if s != 1
    ]


def test_different_answers_score_zero(grader):
    completions = [f"\\boxed{{{p}}}" for _, p in DIFFERENT]
    scores = grader(completions, [g for g, _ in DIFFERENT])
    assert scores == [0.0] * len(DIFFERENT), [
        d for d, s in zip(DIFFERENT, scores, strict=True) if s != 0
    ]


def test_missing_box_and_too_long_answers(grader):
    assert grader(["The answer is 5.", "\\boxed{" + "1+" * 600 + "1}"], ["5", "1201"]) == [0, 0]
    assert grader.stats["too_long"] >= 1
    assert MathEquivalence(fallback="last_number")(["The answer is 5."], ["5"]) == [1.0]


def test_inline_isolation_matches_process(grader):
    inline = MathEquivalence(isolation="inline")
    pairs = EQUIVALENT[:6] + DIFFERENT[:4]
    completions = [f"\\boxed{{{p}}}" for _, p in pairs]
    golds = [g for g, _ in pairs]
    assert inline(completions, golds) == grader(completions, golds)


def test_reward_set_builds_and_pickles():
    rewards = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.math_grading.MathEquivalence", "timeout_s": 1.5}]
    )
    assert rewards.names == ["correctness"] and rewards.success_name == "correctness"
    out = rewards(["\\boxed{\\frac{2}{4}}", "\\boxed{2}"], ["0.5", "0.5"])
    assert out.success.tolist() == [True, False]
    copy = pickle.loads(pickle.dumps(rewards.entries[0].fn))
    assert copy(["\\boxed{0.5}"], ["1/2"]) == [1.0]
    copy.close()
    rewards.entries[0].fn.close()


# ------------------------------------------------------------------------------- time bound

PATHOLOGICAL = [
    "9^{9^{9^{9}}}",
    "(10^{10})!",
    "(10^{8})!",
    "10^{10^{10}}+1",
    "2^{2^{2^{2^{2^{2}}}}}",
    "\\binom{10^{9}}{10^{5}}",
]


@pytest.mark.parametrize("expression", PATHOLOGICAL)
def test_pathological_answers_are_bounded(grader, expression):
    start = time.perf_counter()
    scores = grader([f"\\boxed{{{expression}}}", "\\boxed{5}"], ["5", "5"])
    elapsed = time.perf_counter() - start
    assert scores == [0.0, 1.0]
    assert elapsed < PATHOLOGICAL_BOUND_S, f"{expression} took {elapsed:.1f} s"


def test_stuck_worker_is_killed_and_replaced():
    """A worker that stops answering (as in C code no signal can stop) is killed at the bound."""
    g = MathEquivalence(timeout_s=TIMEOUT_S)
    g(["\\boxed{1}"], ["1"])
    os.kill(g._worker.proc.pid, signal.SIGSTOP)
    start = time.perf_counter()
    scores = g(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], ["1", "2", "4"])
    assert scores == [0.0, 1.0, 0.0]  # the stuck pair scores 0; the rest are graded normally
    assert g.stats["restarts"] == 1 and g.stats["timeouts"] == 1
    assert time.perf_counter() - start < 30  # bound + one worker start
    g.close()


def test_dead_worker_is_restarted():
    g = MathEquivalence(timeout_s=TIMEOUT_S)
    g(["\\boxed{1}"], ["1"])
    g._worker.proc.kill()
    g._worker.proc.wait()
    assert g(["\\boxed{1}", "\\boxed{2}"], ["1", "2"]) == [1.0, 1.0]
    g.close()


def test_grading_from_a_thread(grader):
    """math-verify's own signal timeout refuses threads; the worker does not care."""
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(s=grader(["\\boxed{0.25}"], ["\\frac{1}{4}"]))
    )
    thread.start()
    thread.join(timeout=60)
    assert result["s"] == [1.0]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(max_size=300)
    | st.lists(
        st.sampled_from(
            [
                "\\boxed{",
                "}",
                "{",
                "\\frac",
                "^",
                "!",
                "9",
                "\\{",
                "\\}",
                "x",
                "=",
                "(",
                ",",
                "]",
                "\\sqrt",
                "\\infty",
                "$",
                "\\text{",
                "\\",
                "\\left(",
                "\\right)",
                "i",
                "-",
                ".",
            ]
        ),
        max_size=40,
    ).map("".join),
    gold=st.sampled_from(["5", "\\frac{1}{2}", "(1,2]", "\\text{Evelyn}", "x^2+1", "\\{1,2\\}"]),
)
def test_fuzz_never_raises_and_is_bounded(grader, text, gold):
    start = time.perf_counter()
    scores = grader([text, "\\boxed{" + text], [gold, gold])
    assert len(scores) == 2 and all(s in (0.0, 1.0) for s in scores)
    assert time.perf_counter() - start < 2 * PATHOLOGICAL_BOUND_S + 20  # + a possible restart


# ------------------------------------------------------------------------------- real data


def _perturbed(gold: str) -> str:
    """A reliably wrong answer: the first digit changed (d -> d+1 mod 10), else ``gold + 1``.

    Changing the first digit changes the leading number of every MATH/AIME answer (a number, a
    fraction's numerator, a coordinate, a coefficient); answers without digits (``p - q``,
    ``\\text{Evelyn}``, ``\\pi``) get ``+ 1``, which no such answer absorbs.
    """
    match = re.search(r"[0-9]", gold)
    if match is None:
        return gold + " + 1"
    return gold[: match.start()] + str((int(match.group()) + 1) % 10) + gold[match.end() :]


@pytest.mark.parametrize("relative", ["math/math500_test.json", "math/aime_train.json"])
def test_real_gold_answers_grade_against_themselves(grader, relative):
    rows = json.loads(shared_data(relative).read_text())
    golds = [math_gold_answer(row) for row in rows]
    assert all(golds) and len(golds) in (500, 975)
    right = [format_boxed_completion("Reasoning.", g) for g in golds]
    wrong = [format_boxed_completion("Reasoning.", _perturbed(g)) for g in golds]
    timeouts = grader.stats["timeouts"]
    start = time.perf_counter()
    right_scores = grader(right, golds)
    wrong_scores = grader(wrong, golds)
    elapsed = time.perf_counter() - start
    bad_right = [g for g, s in zip(golds, right_scores, strict=True) if s != 1.0]
    bad_wrong = [(g, _perturbed(g)) for g, s in zip(golds, wrong_scores, strict=True) if s != 0.0]
    assert not bad_right, f"{len(bad_right)} gold answers do not match themselves: {bad_right[:5]}"
    assert not bad_wrong, f"{len(bad_wrong)} wrong answers graded correct: {bad_wrong[:5]}"
    assert grader.stats["timeouts"] == timeouts
    print(f"{relative}: {2 * len(golds) / elapsed:.0f} answers/s")
