"""Intervals and paired tests of evaluations (torchtune_grpo.evaluation.stats)."""

from __future__ import annotations

import json
import math

import pytest

from torchtune_grpo.cli.main import main as cli
from torchtune_grpo.evaluation.stats import compare_evaluations, mcnemar_exact, wilson_interval


def test_wilson_interval_known_values():
    # 30 of 100: the textbook Wilson interval (0.2189, 0.3958)
    low, high = wilson_interval(30, 100)
    assert low == pytest.approx(0.2189, abs=1e-4) and high == pytest.approx(0.3958, abs=1e-4)
    assert wilson_interval(0, 50)[0] == pytest.approx(0.0, abs=1e-12)
    assert 0 < wilson_interval(0, 50)[1] < 0.08
    assert wilson_interval(50, 50)[1] == 1.0
    with pytest.raises(ValueError):
        wilson_interval(1, 0)


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    # 0 vs 10 discordant: 2 * 0.5**10
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    # 2 vs 12: 2 * sum_{i<=2} C(14, i) / 2**14
    assert mcnemar_exact(12, 2) == pytest.approx(2 * (1 + 14 + 91) / 2**14)


def _samples(path, correct, chars=10):
    path.mkdir()
    with (path / "eval_samples.jsonl").open("w") as f:
        for i, c in enumerate(correct):
            f.write(json.dumps({"index": i, "question": f"q{i}", "correct": [c],
                                "completions": ["x" * chars]}) + "\n")
    return path


def test_compare_evaluations_is_paired(tmp_path, capsys):
    base = [True] * 10 + [False] * 90
    step = [True] * 8 + [False] * 2 + [True] * 30 + [False] * 60
    a, b = _samples(tmp_path / "a", base, 100), _samples(tmp_path / "b", step, 40)
    out = compare_evaluations(a, b)
    assert out["problems"] == 100 and out["only_a"] == 2 and out["only_b"] == 30
    assert out["accuracy_a"] == 0.10 and out["accuracy_b"] == 0.38
    assert out["difference"] == pytest.approx(0.28)
    assert out["mcnemar_p"] == pytest.approx(mcnemar_exact(2, 30)) and out["mcnemar_p"] < 1e-5
    lo, hi = out["ci95_difference"]
    assert lo < 0.28 < hi and lo > 0.1
    assert out["chars_a"] == 100 and out["chars_b"] == 40
    assert cli(["compare-evals", str(a), str(b)]) == 0
    assert "McNemar exact p" in capsys.readouterr().out
    other = _samples(tmp_path / "c", base[:50])
    with pytest.raises(ValueError, match="different problems"):
        compare_evaluations(a, other)
    with pytest.raises(FileNotFoundError, match="grpo_eval"):
        compare_evaluations(tmp_path / "missing", a)
    # on the command line: one line naming the folder, no traceback
    capsys.readouterr()
    assert cli(["compare-evals", str(tmp_path / "missing"), str(a)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err and "Traceback" not in err
    assert math.isfinite(out["ci95_a"][0])


def test_strict_correct_reads_the_answer_sentence():
    from torchtune_grpo.evaluation.stats import strict_correct

    phrase = "The answer is"
    assert strict_correct("3 + 4 = 7.\nThe answer is 7.", "7", phrase)
    assert strict_correct("so the answer is $1,000. That is a lot: 999 + 1.", "1000", phrase)
    assert strict_correct("The answer is 5. No wait. The answer is 7", "7", phrase)  # the last
    # the right number, but not stated as the answer: lenient scoring counts it, strict not
    assert not strict_correct("3 + 4 = 7", "7", phrase)
    assert not strict_correct("The answer is 8. 3 + 4 = 7", "7", phrase)
    assert not strict_correct("The answer is seven.", "7", phrase)


def test_compare_evaluations_strict_phrase(tmp_path, capsys):
    """Strict scoring re-grades the stored completions against ``gold``: a reply whose last
    number is right (stored correct) but whose answer sentence is missing counts as wrong."""
    def write(path, completions):
        path.mkdir()
        with (path / "eval_samples.jsonl").open("w") as f:
            for i, text in enumerate(completions):
                f.write(json.dumps({"index": i, "question": f"q{i}", "gold": "7",
                                    "correct": [text.rstrip(".").endswith("7")],
                                    "completions": [text]}) + "\n")
        return path

    a = write(tmp_path / "a", ["4 + 3 = 7"] * 4 + ["The answer is 7."] * 2 + ["8"] * 4)
    b = write(tmp_path / "b", ["The answer is 7."] * 8 + ["8"] * 2)
    phrase = "The answer is"
    stored = compare_evaluations(a, b)
    strict = compare_evaluations(a, b, strict_phrase=phrase)
    assert stored["accuracy_a"] == 0.6 and stored["accuracy_b"] == 0.8
    assert strict["accuracy_a"] == 0.2 and strict["accuracy_b"] == 0.8
    assert strict["only_a"] == 0 and strict["only_b"] == 6
    assert cli(["compare-evals", str(a), str(b), "--strict-phrase", phrase]) == 0
    out = capsys.readouterr().out
    assert "scored as evaluated" in out and "strict: the number after the last" in out
    assert out.count("McNemar exact p") == 2
    assert cli(["compare-evals", str(a), str(b), "--strict-phrase", phrase, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strict"]["accuracy_a"] == 0.2 and data["stored"]["accuracy_a"] == 0.6
