"""Math-equivalence grading with ``math-verify``, bounded in time (:class:`MathEquivalence`).

Pairs are graded in a worker process (:mod:`torchtune_grpo.rewards.grading_worker`) that is
killed when a pair overruns, or inline under a ``SIGALRM`` timer.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.rewards.answers import after_thinking, extract_boxed, last_number
from torchtune_grpo.rewards.grading_worker import (
    _KILL_GRACE_S,
    _Alarm,
    _grade_with_alarm,
    _quiet_math_verify_logs,
    _SoftTimeout,
    _Worker,
    _WorkerDied,
    grade_answer,
)

__all__ = [
    "MathEquivalence",
    "normalize_answer",
]

#: Accepted ``fallback`` values of :class:`MathEquivalence`.
FALLBACKS = ("none", "last_math", "last_number")
#: Accepted ``isolation`` values of :class:`MathEquivalence`.
ISOLATIONS = ("process", "inline")

# --------------------------------------------------------------------------------------------
# Answer extraction (pure text, linear time; boxes and numbers: torchtune_grpo.rewards.answers)
# --------------------------------------------------------------------------------------------

# The last math block: $...$, $$...$$, \(...\) or \[...\] (contents without the delimiters).
_MATH_BLOCK_RE = re.compile(
    r"\$\$(?P<dd>[^$]+)\$\$|\$(?P<d>[^$]+)\$|\\\((?P<p>.*?)\\\)|\\\[(?P<b>.*?)\\\]", re.DOTALL
)


def _last_math(text: str) -> str | None:
    """Content of the last ``$...$``/``\\(...\\)``/``\\[...\\]`` block of ``text``."""
    last = None
    for match in _MATH_BLOCK_RE.finditer(text):
        last = match
    if last is None:
        return None
    content = next(g for g in last.groups() if g is not None).strip()
    return content or None


_SPACING_RE = re.compile(r"\\[,;:! ]|\\left|\\right|\s+")


def normalize_answer(answer: str) -> str:
    """A light textual normal form of an extracted answer, its vote in maj@k (not an equivalence
    test): no whitespace, LaTeX spacing, ``\\left``/``\\right``, trailing period or dollar signs;
    ``\\dfrac``/``\\tfrac`` written ``\\frac``.
    """
    text = _SPACING_RE.sub("", answer)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    return text.rstrip(".")


# --------------------------------------------------------------------------------------------
# The reward component
# --------------------------------------------------------------------------------------------


class MathEquivalence:
    """Correctness by mathematical equivalence: 1.0 when the boxed answer equals the gold one.

    The prediction is the last ``\\boxed{...}``, else per ``fallback``; ``math-verify`` compares it
    with the gold answer. A pair takes at most about ``timeout_s`` + 0.5 s and scores 0 when it
    runs out; ``isolation="inline"`` bounds only the main thread and not long C computations.
    Completions never make it raise.

    Args:
        timeout_s: seconds allowed per pair.
        fallback: without a box, ``"none"`` (0), ``"last_math"`` (the last ``$...$``,
            ``\\(...\\)`` or ``\\[...\\]`` block) or ``"last_number"`` (:func:`.last_number`).
        isolation: ``"process"`` or ``"inline"``.
        max_answer_chars: longest prediction that is parsed (longer ones score 0).
        memory_limit_mb: address-space limit of the worker process (``None``: no limit).
        float_rounding: decimal places floats are rounded to (math-verify).
        numeric_precision: significant digits of numeric comparisons (math-verify).
        strict: math-verify's strict mode.
        think_tag: read the answer only after the completion's reasoning block; ``None``: the
            whole completion.

    Raises:
        ValueError: on an unknown ``fallback``/``isolation`` or a non-positive limit.
        ImportError: when ``math-verify`` is not installed.

    Attributes:
        stats: counters ``graded``, ``timeouts``, ``errors``, ``restarts``, ``too_long``.
    """

    name = "correctness"

    def __init__(
        self,
        timeout_s: float = 2.0,
        fallback: str = "none",
        isolation: str = "process",
        max_answer_chars: int = 1000,
        memory_limit_mb: int | None = 4096,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        strict: bool = True,
        think_tag: str | None = None,
    ) -> None:
        self.think_tag = think_tag or None
        if fallback not in FALLBACKS:
            raise ValueError(
                f"MathEquivalence: fallback must be one of {FALLBACKS}, got {fallback!r}"
            )
        if isolation not in ISOLATIONS:
            raise ValueError(
                f"MathEquivalence: isolation must be one of {ISOLATIONS}, got {isolation!r}"
            )
        if isolation == "process" and os.name != "posix":
            raise ValueError("MathEquivalence: isolation='process' needs a POSIX system")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(
                f"MathEquivalence: timeout_s must be a positive number, got {timeout_s!r}"
            )
        if (
            isinstance(max_answer_chars, bool)
            or not isinstance(max_answer_chars, int)
            or (max_answer_chars <= 0)
        ):
            raise ValueError(
                "MathEquivalence: max_answer_chars must be a positive integer, "
                f"got {max_answer_chars!r}"
            )
        if memory_limit_mb is not None and (
            isinstance(memory_limit_mb, bool)
            or not isinstance(memory_limit_mb, int)
            or memory_limit_mb <= 0
        ):
            raise ValueError(
                "MathEquivalence: memory_limit_mb must be a positive integer or null, "
                f"got {memory_limit_mb!r}"
            )
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "MathEquivalence needs the math-verify package: pip install 'torchtune-grpo[math]'"
                " (or pip install math-verify)"
            )
        self.timeout_s = float(timeout_s)
        self.fallback = fallback
        self.isolation = isolation
        self.max_answer_chars = max_answer_chars
        self.memory_limit_mb = memory_limit_mb
        self._options = {
            "float_rounding": int(float_rounding),
            "numeric_precision": int(numeric_precision),
            "strict": bool(strict),
        }
        self.stats = {"graded": 0, "timeouts": 0, "errors": 0, "restarts": 0, "too_long": 0}
        self._worker: _Worker | None = None
        self._warm = False
        self._lock = threading.Lock()

    # -- pickling: the worker process does not travel ---------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """State without the worker process and the lock."""
        state = self.__dict__.copy()
        state["_worker"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the state; a new worker starts on first use."""
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the worker process (a new one starts when grading is needed again)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    # -- extraction ---------------------------------------------------------------------------

    def _prediction(self, completion: str) -> str | None:
        """The raw predicted answer of one completion (box content or fallback)."""
        if self.think_tag is not None:
            completion = after_thinking(completion, self.think_tag)
        if not isinstance(completion, str):
            return None
        boxed = extract_boxed(completion)
        if boxed is not None:
            return boxed or None
        if self.fallback == "last_math":
            return _last_math(completion)
        if self.fallback == "last_number":
            return last_number(completion)
        return None

    def extract_answer(self, completion: str) -> str | None:
        """:func:`normalize_answer` of one completion's predicted answer, or ``None``."""
        predicted = self._prediction(completion)
        if predicted is None:
            return None
        return normalize_answer(predicted) or None

    # -- grading ------------------------------------------------------------------------------

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Score ``N`` completions against ``N`` LaTeX gold answers: floats in ``{0.0, 1.0}``.

        Raises:
            ValueError: when the lengths differ.
            RuntimeError: when the grading worker cannot start (math-verify missing).
        """
        completions, answers = list(completions), list(answers)
        if len(completions) != len(answers):
            raise ValueError(
                f"MathEquivalence: got {len(completions)} completions but {len(answers)} answers"
            )
        scores = [0.0] * len(completions)
        todo: list[tuple[int, str, str]] = []
        for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
            predicted = self._prediction(completion)
            if predicted is None:
                continue
            if len(predicted) > self.max_answer_chars:
                self.stats["too_long"] += 1
                continue
            todo.append((i, predicted, str(answer).strip()))
        if todo:
            grade = self._grade_inline if self.isolation == "inline" else self._grade_in_worker
            for i, ok in zip(
                (i for i, _, _ in todo), grade([(p, g) for _, p, g in todo]), strict=True
            ):
                scores[i] = 1.0 if ok else 0.0
        return scores

    def _count(self, status: str) -> None:
        self.stats["graded"] += 1
        if status == "timeout":
            self.stats["timeouts"] += 1
        elif status == "error":
            self.stats["errors"] += 1

    def _grade_inline(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Grade in this process (SIGALRM bound in the main thread only)."""
        _quiet_math_verify_logs()
        if not self._warm:  # import SymPy and math-verify outside the time limit
            grade_answer("1", "1", **self._options)
            self._warm = True
        in_main = threading.current_thread() is threading.main_thread()
        alarm = _Alarm() if in_main and hasattr(signal, "setitimer") else None
        results = []
        for predicted, gold in pairs:
            try:
                ok, status = _grade_with_alarm(
                    alarm, self.timeout_s, predicted, gold, self._options
                )
            except _SoftTimeout:
                ok, status = False, "timeout"
            self._count(status)
            results.append(ok)
        return results

    def _start_worker(self) -> _Worker:
        options = {
            **self._options,
            "timeout_s": self.timeout_s,
            "memory_limit_mb": self.memory_limit_mb,
        }
        return _Worker(options)

    def _grade_in_worker(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Grade in the worker process, killing and restarting it when a pair overruns."""
        results: list[bool] = []
        with self._lock:
            retried_at = -1  # the position whose pair was already retried after a crash
            while len(results) < len(pairs):
                if self._worker is None:
                    self._worker = self._start_worker()
                worker = self._worker
                worker.wait_ready()
                try:
                    worker.send({"items": [list(p) for p in pairs[len(results) :]]})
                    while len(results) < len(pairs):
                        reply = worker.receive(self.timeout_s + _KILL_GRACE_S)
                        if reply is None:  # overran: kill, score 0, go on with a new worker
                            self._count("timeout")
                            results.append(False)
                            self._restart()
                            break
                        self._count(reply["status"])
                        results.append(bool(reply["ok"]))
                except _WorkerDied:
                    # Killed from outside (e.g. the OOM killer) while grading a pair: retry
                    # that pair once with a fresh worker, then score it 0.
                    self._restart()
                    if retried_at != len(results):
                        retried_at = len(results)
                        continue
                    self._count("error")
                    results.append(False)
        return results

    def _restart(self) -> None:
        """Kill the current worker and start a new one (it imports while we go on)."""
        if self._worker is not None:
            self._worker.close()
        self.stats["restarts"] += 1
        self._worker = self._start_worker()
