"""Training and evaluation read the same number from the same text (rewards.answers).

The training reward (:class:`~torchtune_grpo.rewards.components.NumericCorrectness`) and the
evaluation grader's ``last_number`` fallback
(:class:`~torchtune_grpo.rewards.math_grading.MathEquivalence`) must agree on every completion:
a model must not be rewarded for an answer that evaluation then marks wrong, or the reverse.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtune_grpo.rewards import answers, grading_worker
from torchtune_grpo.rewards.answers import last_number, parse_number
from torchtune_grpo.rewards.components import NumericCorrectness
from torchtune_grpo.rewards.math_grading import MathEquivalence

# (text, the number a careful grader reads as its final answer; None: no number)
NUMBER_TABLE = [
    # signs: a minus at the start or after a space, "=", "(", "$", "{" is a sign
    ("-5", -5.0),
    ("x = -5", -5.0),
    ("x=-5", -5.0),
    ("(-3)", -3.0),
    ("so $-3$", -3.0),
    ("\\boxed{-12}", -12.0),
    ("\u22127", -7.0),
    ("-$5", -5.0),
    ("-\\$5", -5.0),
    ("$-\\!5$", -5.0),
    ("-\\frac{1}{2}", -0.5),
    # ranges and subtractions: the last number is the one after the dash
    ("10-3", 3.0),
    ("10 - 3", 3.0),
    ("pages 12-15", 15.0),
    ("10\u22123", 3.0),
    ("x-4", 4.0),
    # thousands separators and lists
    ("1,234", 1234.0),
    ("it is 1,234.", 1234.0),
    ("1,234,567", 1234567.0),
    ("$1,000.50", 1000.5),
    ("1{,}000", 1000.0),
    ("1\\,000", 1000.0),
    ("1, 2, 3", 3.0),
    ("1,2,3", 3.0),
    ("12,34", 34.0),
    # decimals and trailing periods
    ("3.50", 3.5),
    ("42.", 42.0),
    ("The answer is 42.", 42.0),
    (".5", 0.5),
    ("-.5", -0.5),
    # LaTeX
    ("\\frac{1}{2}", 0.5),
    ("\\dfrac{3}{4}", 0.75),
    ("\\tfrac{-1}{2}", -0.5),
    ("\\frac12", 0.5),
    ("$\\frac{3}{4}$ cup", 0.75),
    ("\\$5", 5.0),
    ("costs \\$1,200", 1200.0),
    ("5\\%", 5.0),
    ("50%", 50.0),
    ("\\boxed{12}", 12.0),
    # plain fractions
    ("3/4", 0.75),
    # no number at all
    ("no number here", None),
    ("", None),
]


def _as_number(text: str | None) -> float | str | None:
    """A number written as ``a``, ``-a``, ``a.b`` or ``a/b`` as a float (else the text itself)."""
    if text is None:
        return None
    num, slash, den = text.partition("/")
    try:
        return float(num) / float(den) if slash else float(num)
    except (ValueError, ZeroDivisionError):
        return text


@pytest.fixture(scope="module")
def eval_grader():
    pytest.importorskip("math_verify")
    return MathEquivalence(fallback="last_number", isolation="inline")


@pytest.mark.parametrize(("text", "expected"), NUMBER_TABLE)
def test_training_and_evaluation_read_the_same_number(text, expected, eval_grader):
    training = NumericCorrectness(answer_tag=None).extract_answer(text)
    evaluation = _as_number(eval_grader.extract_answer(text))
    assert (training, evaluation) == (expected, expected)


@pytest.mark.parametrize(("text", "expected"), [r for r in NUMBER_TABLE if r[1] is not None])
def test_training_and_evaluation_score_alike(text, expected, eval_grader):
    """The gold answer scores 1 in both; a different number scores 0 in both."""
    train = NumericCorrectness(answer_tag=None)
    gold, wrong = (str(int(x)) if x.is_integer() else repr(x) for x in (expected, expected + 1))
    assert train([text, text], [gold, wrong]) == [1.0, 0.0]
    assert eval_grader([text, text], [gold, wrong]) == [1.0, 0.0]


# ---------------------------------------------------------- the extractor itself (rewards.answers)

_PIECES = list("0123456789,.-/$%{}\\ x=(\n\u2212!") + [
    "\\frac{", "\\dfrac", "-\\frac", "}{", "\\frac12", "$-", "{-", "\\,", "\\!", "\\$", "{,}",
]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=80))
def test_last_number_and_parse_number_are_one_reading(pieces):
    text = "".join(pieces)
    written, value = last_number(text), parse_number(text)
    assert (written is None) == (value is None)
    if written is not None:
        assert _as_number(written) == value


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), min_size=400, max_size=900))
def test_scanning_from_the_end_finds_what_a_full_scan_finds(pieces):
    """Long texts are scanned in growing windows from the end; the result must not change."""
    text = "".join(pieces)
    assert answers._last_token(text) == answers._scan_last(text, 0, len(text))


@pytest.mark.parametrize(
    "text",
    ["-\\frac{1}{" * 11_000, "\\!" * 50_000, "1\\," * 33_000, "\\$" * 50_000,
     "-\\frac12" * 12_000, "\\frac1" * 16_000, "-\\frac{-1}{-" * 8_000],
)
def test_latex_heavy_inputs_are_fast(text):
    start = time.perf_counter()
    last_number(text)
    parse_number(text)
    assert time.perf_counter() - start < 0.2


def test_math_grading_worker_imports_no_torch():
    """The grading worker runs grading_worker.py, which imports the standard library only."""
    path = Path(grading_worker.__file__).resolve()
    code = grading_worker._WORKER_CODE.format(path=str(path), root=str(path.parents[2]))
    code = code.replace("module._worker_main()\n", "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "False"
