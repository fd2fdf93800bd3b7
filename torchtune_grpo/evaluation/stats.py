"""How sure an evaluation is: :func:`wilson_interval` (95% interval of an accuracy, logged as
``eval/pass@1/ci95_*``) and a paired comparison of two evaluations of the same problems
(:func:`mcnemar_exact`, :func:`compare_evaluations`; ``tune-grpo compare-evals A B
[--strict-phrase PHRASE] [--json]``). ``--strict-phrase`` rescores with
:func:`strict_correct`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["compare_evaluations", "mcnemar_exact", "strict_correct", "wilson_interval"]

#: The normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054


def wilson_interval(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k / n``.

    Args:
        k: successes (may be fractional: a sum of per-problem pass rates).
        n: trials (``> 0``).
        z: the normal quantile (default: 95% two-sided).

    Returns:
        ``(low, high)`` within ``[0, 1]``.

    Raises:
        ValueError: ``n <= 0``.
    """
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be > 0, got {n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (binomial, p = 1/2).

    Args:
        only_a: problems model A gets right and model B wrong.
        only_b: problems model B gets right and model A wrong.
    """
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2 * tail)


def _read_samples(path: Path) -> dict[int, dict[str, Any]]:
    if path.is_dir():
        path = path / "eval_samples.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run tune run grpo_eval on that folder "
                                "first")
    rows = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
            rows[int(row["index"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} line {number}: not an eval sample row ({exc})") from None
    return rows


def strict_correct(completion: str, gold: str, phrase: str) -> bool:
    """Whether ``completion`` states the right answer in its answer sentence.

    Args:
        completion: the model's reply.
        gold: the reference answer (a number, as GSM8K's ``#### 18``).
        phrase: the sentence that introduces the answer, e.g. ``"The answer is"``
            (case-insensitive; its last occurrence counts).

    Returns:
        True when the first number after ``phrase`` on its line equals ``gold``.
    """
    from torchtune_grpo.rewards.answers import extract_after_phrase, numbers_match, parse_number

    after = extract_after_phrase(completion, phrase)
    if after is None:
        return False
    # the first number after the phrase: "The answer is 18. That is 9 * 2." states 18
    got = parse_number(after.split(". ")[0])
    want = parse_number(str(gold))
    return got is not None and want is not None and numbers_match(got, want)


def compare_evaluations(a: str | Path, b: str | Path,
                        strict_phrase: str | None = None) -> dict[str, Any]:
    """Compare two evaluations of the same problems by each one's first sample.

    Args:
        a: the first ``eval_samples.jsonl`` (or its folder), e.g. the base model.
        b: the second, e.g. a trained step.
        strict_phrase: None: the evaluations' own ``correct``; a phrase: :func:`strict_correct`
            of each first completion instead.

    Returns:
        ``problems``, ``accuracy_a``/``_b`` with Wilson ``ci95_a``/``_b``, ``difference``
        (b - a) with a paired ``ci95_difference``, ``only_a``/``only_b`` (discordant problems),
        ``mcnemar_p`` and mean completion lengths ``chars_a``/``chars_b`` in characters.

    Raises:
        FileNotFoundError: a missing samples file.
        ValueError: the files do not hold the same problems (indices and questions), or a row
            is not a sample row.
    """
    rows_a, rows_b = _read_samples(Path(a)), _read_samples(Path(b))
    if rows_a.keys() != rows_b.keys():
        raise ValueError(f"{a} and {b} hold different problems ({len(rows_a)} vs {len(rows_b)} "
                         "rows, or other indices): evaluate both on the same split")
    for index, row in rows_a.items():
        if row.get("question") != rows_b[index].get("question"):
            raise ValueError(f"row {index} is another question in {a} and {b}")
    n = len(rows_a)

    def right(row: dict[str, Any]) -> bool:
        if strict_phrase is None:
            return bool(row["correct"][0])
        return strict_correct(row["completions"][0], row["gold"], strict_phrase)

    right_a = [right(rows_a[i]) for i in sorted(rows_a)]
    right_b = [right(rows_b[i]) for i in sorted(rows_a)]
    only_a = sum(x and not y for x, y in zip(right_a, right_b))
    only_b = sum(y and not x for x, y in zip(right_a, right_b))
    acc_a, acc_b = sum(right_a) / n, sum(right_b) / n
    diffs = [float(y) - float(x) for x, y in zip(right_a, right_b)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
    half = Z95 * math.sqrt(var / n)

    def chars(rows):
        texts = [rows[i]["completions"][0] for i in rows]
        return sum(len(t) for t in texts) / n

    return {
        "problems": n,
        "accuracy_a": acc_a, "ci95_a": wilson_interval(sum(right_a), n),
        "accuracy_b": acc_b, "ci95_b": wilson_interval(sum(right_b), n),
        "difference": acc_b - acc_a, "ci95_difference": (mean - half, mean + half),
        "only_a": only_a, "only_b": only_b, "mcnemar_p": mcnemar_exact(only_a, only_b),
        "chars_a": chars(rows_a), "chars_b": chars(rows_b),
    }


def main(argv: list[str] | None = None) -> int:
    """``tune-grpo compare-evals A B [--json]``: the paired comparison of two evaluations."""
    parser = argparse.ArgumentParser(
        prog="tune-grpo compare-evals",
        description="Compare two evaluations of the same problems (McNemar's exact test)")
    parser.add_argument("a", help="eval_samples.jsonl or its folder (e.g. the base model)")
    parser.add_argument("b", help="eval_samples.jsonl or its folder (e.g. a trained step)")
    parser.add_argument("--strict-phrase", default=None, metavar="PHRASE",
                        help='also compare strictly: right only when the number after the '
                        'last PHRASE (e.g. "The answer is") is the gold answer')
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        result = compare_evaluations(args.a, args.b)
        strict = (None if args.strict_phrase is None
                  else compare_evaluations(args.a, args.b, strict_phrase=args.strict_phrase))
    except (FileNotFoundError, ValueError) as e:  # a missing folder, problems that differ
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result if strict is None else {"stored": result, "strict": strict},
                         indent=1))
        return 0
    _print_comparison(result, args.a, args.b, "scored as evaluated")
    if strict is not None:
        _print_comparison(strict, args.a, args.b,
                          f"strict: the number after the last {args.strict_phrase!r}")
    return 0


def _print_comparison(result: dict[str, Any], a: str, b: str, title: str) -> None:
    lo, hi = result["ci95_difference"]
    print(f"{result['problems']} problems, {title}\n"
          f"  A {result['accuracy_a']:.3f} [{result['ci95_a'][0]:.3f}, {result['ci95_a'][1]:.3f}]"
          f"  mean length {result['chars_a']:.0f} chars  ({a})\n"
          f"  B {result['accuracy_b']:.3f} [{result['ci95_b'][0]:.3f}, {result['ci95_b'][1]:.3f}]"
          f"  mean length {result['chars_b']:.0f} chars  ({b})\n"
          f"  B - A {result['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]; right only in A: "
          f"{result['only_a']}, only in B: {result['only_b']}; McNemar exact p = "
          f"{result['mcnemar_p']:.2g}")
