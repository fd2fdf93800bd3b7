"""Difficulty files on the data side: reading one (written by ``tune-grpo difficulty``) and
keeping the prompts whose pass rate lies inside a band.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchtune_grpo.errors import DataError

__all__ = ["DEFAULT_BAND", "read_difficulty", "select_by_difficulty"]

#: Default ``difficulty_band``: keep prompts solved sometimes (``0 < pass_rate < 1``).
DEFAULT_BAND = (0.0, 1.0)
_FORMAT = "torchtune_grpo.difficulty/1"  # the files' format tag (its old module name: keep it)


def _check_band(band: Any, where: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in band)
    except (TypeError, ValueError):
        raise DataError(f"{where}: difficulty_band must be [low, high] with 0 <= low < high <= 1,"
                         f" got {band!r}") from None
    if not (0.0 <= low < high <= 1.0):
        raise DataError(f"{where}: difficulty_band must be [low, high] with 0 <= low < high <= 1,"
                         f" got {list(band)!r}")
    return low, high


def read_difficulty(path: str | Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Read a difficulty file.

    Args:
        path: the JSONL file written by :func:`score_difficulty`.

    Returns:
        ``(settings, rows)``: the settings of its first line, and ``index -> row``. A last line
        cut off mid-write (an interrupted run) is ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a difficulty file, or a line other than the last is not
            valid JSON or lacks a field (naming the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"difficulty_file {str(path)!r} does not exist; make it with tune-grpo difficulty "
            "--config ... --out FILE")
    lines = path.read_text().splitlines()
    if not lines:
        raise DataError(f"difficulty_file {str(path)!r} is empty")
    try:
        settings = json.loads(lines[0])
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict) or settings.get("format") != _FORMAT:
        raise DataError(f"difficulty_file {str(path)!r} is not a difficulty file (its first "
                         f"line is not the settings line of tune-grpo difficulty)")
    rows: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines[1:], start=2):
        try:
            row = json.loads(line)
            index = int(row["index"])
            row["pass_rate"] = float(row["pass_rate"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if number == len(lines):  # a line cut off by an interrupted run
                break
            raise DataError(f"difficulty_file {str(path)!r} line {number}: not a valid row "
                             f"({type(exc).__name__}: {exc})") from None
        rows[index] = row
    return settings, rows


def select_by_difficulty(
    samples: Sequence[tuple[str, str, int]],
    difficulty_file: str | Path,
    band: Sequence[float] = DEFAULT_BAND,
    *,
    name: str = "dataset",
) -> tuple[list[tuple[str, str, int]], int]:
    """Keep the samples whose pass rate in ``difficulty_file`` lies strictly inside ``band``.

    Args:
        samples: ``(question, answer, index)`` triples of a dataset.
        difficulty_file: a file from :func:`score_difficulty` made for the same data.
        band: ``(low, high)``: a sample is kept when ``low < pass_rate < high``; the default
            ``(0, 1)`` keeps the prompts the model solves sometimes.
        name: the dataset's name, for messages.

    Returns:
        ``(kept samples, number dropped)``.

    Raises:
        ValueError: on a bad band, a sample missing from the file (the file covers other data:
            the message names the first missing row and how many are missing), a row whose
            question differs from the sample's, or no sample kept.
    """
    low, high = _check_band(band, name)
    _, rows = read_difficulty(difficulty_file)
    missing = [index for _, _, index in samples if index not in rows]
    if missing:
        raise DataError(
            f"{name}: difficulty_file {str(difficulty_file)!r} has no pass rate for {len(missing)} "
            f"of its {len(samples)} rows (first: row {missing[0] + 1}, index {missing[0]}); score "
            "the same split with "
            "tune-grpo difficulty, or set the dataset's split to the rows that were scored")
    kept = []
    for question, answer, index in samples:
        row = rows[index]
        if row.get("question") is not None and row["question"] != question:
            raise DataError(
                f"{name}: row {index + 1} (index {index}) of difficulty_file "
                f"{str(difficulty_file)!r} is another "
                f"question ({row['question'][:60]!r}... vs {question[:60]!r}...); the file was "
                "made from other data")
        if low < row["pass_rate"] < high:
            kept.append((question, answer, index))
    if not kept:
        raise DataError(
            f"{name}: no row of difficulty_file {str(difficulty_file)!r} has a pass rate "
            f"strictly between {low} and {high}; widen difficulty_band or score with more "
            "samples")
    return kept, len(samples) - len(kept)
