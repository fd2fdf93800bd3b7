"""Math-equivalence grading with ``math-verify``, bounded in time (:class:`MathEquivalence`).

A completion is correct when the content of its last ``\\boxed{...}`` is mathematically
equivalent to the gold answer according to Hugging Face's ``math-verify`` (``\\frac12``,
``0.5`` and ``\\dfrac{1}{2}`` agree; so do ``(1,2]`` and ``(1, 2]``, ``\\{1,2\\}`` and
``\\{2,1\\}``, ``3\\sqrt{13}`` and ``\\sqrt{117}``).

Why a worker process: ``math-verify`` turns LaTeX into SymPy expressions, and SymPy evaluates
some of them eagerly. ``\\boxed{(10^{10})!}`` or ``\\boxed{9^{9^{9^{9}}}}`` start integer
computations that run for minutes inside C code. ``math-verify``'s own time limit is a
``SIGALRM`` handler: it works only in the main thread (it raises ``ValueError`` elsewhere) and a
Python signal handler cannot run while C code holds the interpreter, so neither that limit nor
any other in-process limit stops such a computation. :class:`MathEquivalence` therefore grades
in a separate Python process (``isolation="process"``, the default) and kills it when a pair
takes longer than ``timeout_s`` plus a short grace period; the pair scores 0 and a fresh worker
is started. Inside the worker, a ``SIGALRM`` timer at ``timeout_s`` stops Python-level work
early so that most slow pairs do not cost a restart.

This module imports only the standard library and :mod:`torchtune_grpo.rewards.answers` (itself
standard library only) at import time (``math_verify`` is imported in the worker), so the
worker starts without importing torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

# Answer extraction is shared with the training rewards (answers.py imports only the standard
# library, so the worker, which runs this file, imports it without torch).
from torchtune_grpo.rewards.answers import extract_boxed as extract_boxed
from torchtune_grpo.rewards.answers import last_number

__all__ = [
    "MathEquivalence",
    "grade_answer",
    "normalize_answer",
]

#: Accepted ``fallback`` values of :class:`MathEquivalence`.
FALLBACKS = ("none", "last_math", "last_number")
#: Accepted ``isolation`` values of :class:`MathEquivalence`.
ISOLATIONS = ("process", "inline")
#: Seconds a worker may take to start (import SymPy and math-verify) before it counts as failed.
_STARTUP_TIMEOUT_S = 120.0
#: Extra seconds the parent waits after ``timeout_s`` before it kills a worker.
_KILL_GRACE_S = 0.5

logger = logging.getLogger(__name__)

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
    """A light textual normal form of an extracted answer, used as its vote in maj@k.

    Removes whitespace, LaTeX spacing commands (``\\,``, ``\\!``...), ``\\left``/``\\right``,
    a trailing period and dollar signs, and writes ``\\dfrac``/``\\tfrac`` as ``\\frac``. It is
    not an equivalence test (``0.5`` and ``\\frac12`` stay different votes); grading uses
    math-verify.

    Args:
        answer: an extracted answer.

    Returns:
        The normalised text.
    """
    text = _SPACING_RE.sub("", answer)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    return text.rstrip(".")


# --------------------------------------------------------------------------------------------
# Grading one pair (runs in the worker, or inline)
# --------------------------------------------------------------------------------------------


class _SoftTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so that library ``except Exception``
    blocks do not swallow it."""


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> Any:
    """math-verify's parse of a gold answer (cached: a group shares its gold)."""
    from math_verify import parse

    return parse("\\boxed{" + gold + "}", parsing_timeout=None)


def grade_answer(
    predicted: str,
    gold: str,
    *,
    float_rounding: int = 6,
    numeric_precision: int = 15,
    strict: bool = True,
) -> bool:
    """Whether ``predicted`` is equivalent to ``gold`` according to math-verify.

    Both are bare answers (the contents of a box, e.g. ``"\\frac{1}{2}"``). Each is wrapped in
    ``\\boxed{}`` and parsed with ``math_verify.parse``; the results are compared with
    ``math_verify.verify(gold, predicted)``. When the gold answer does not parse at all, the
    stripped texts must be equal.

    **No time limit**: this runs in the calling thread and may not return for minutes on
    adversarial input (see the module docstring). Use :class:`MathEquivalence` to grade
    untrusted text.

    Args:
        predicted: the predicted answer.
        gold: the gold answer.
        float_rounding: decimal places floats are rounded to (math-verify).
        numeric_precision: significant digits of numeric comparisons (math-verify).
        strict: math-verify's strict mode (variables matter; sets and tuples differ).

    Returns:
        Whether they are equivalent.
    """
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return predicted.strip() == gold.strip() != ""
    predicted_parsed = parse("\\boxed{" + predicted + "}", parsing_timeout=None)
    if not predicted_parsed:
        return False
    return bool(
        verify(
            gold_parsed,
            predicted_parsed,
            float_rounding=float_rounding,
            numeric_precision=numeric_precision,
            strict=strict,
            timeout_seconds=None,
        )
    )


class _Alarm:
    """A SIGALRM timer that raises :class:`_SoftTimeout`; usable only in the main thread."""

    def __init__(self) -> None:
        self.armed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            raise _SoftTimeout

    @contextlib.contextmanager
    def limit(self, seconds: float):
        """Raise :class:`_SoftTimeout` inside the block after ``seconds`` (Python code only)."""
        previous = signal.signal(signal.SIGALRM, self._handler)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _grade_with_alarm(
    alarm: _Alarm | None, seconds: float, predicted: str, gold: str, options: dict[str, Any]
) -> tuple[bool, str]:
    """Grade one pair; returns ``(correct, status)`` with status ``ok``/``timeout``/``error``."""
    try:
        if alarm is None:
            return grade_answer(predicted, gold, **options), "ok"
        with alarm.limit(seconds):
            return grade_answer(predicted, gold, **options), "ok"
    except _SoftTimeout:
        return False, "timeout"
    except RecursionError:
        return False, "error"
    except Exception:  # noqa: BLE001 - arbitrary text must never make grading raise
        return False, "error"


def _quiet_math_verify_logs() -> None:
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _worker_main() -> None:
    """Entry point of the grading worker process.

    Protocol (JSON lines): the parent passes the options as ``argv[1]``; the worker answers
    ``{"ready": true}`` (or ``{"fatal": message}``), then for every request line
    ``{"items": [[predicted, gold], ...]}`` writes one line ``{"ok": bool, "status": str}``
    per item, in order. It exits at the end of its input.
    """
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    options = json.loads(sys.argv[1])
    memory_mb = options.pop("memory_limit_mb", None)
    seconds = float(options.pop("timeout_s"))
    if memory_mb:
        with contextlib.suppress(Exception):
            import resource

            limit = int(memory_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        _quiet_math_verify_logs()
        import math_verify  # noqa: F401

        grade_answer("1", "1", **options)  # warm up SymPy and the parser
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        send({"fatal": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": True})
    alarm = _Alarm()
    for line in sys.stdin:
        if not line.strip():
            continue
        for predicted, gold in json.loads(line)["items"]:
            try:
                ok, status = _grade_with_alarm(alarm, seconds, predicted, gold, options)
            except _SoftTimeout:  # the alarm fired just outside the grading call
                ok, status = False, "timeout"
            send({"ok": ok, "status": status})


# The worker runs this file's code without importing the package's heavy modules (no torch in
# the worker); the folder holding the package goes first on sys.path so that this file's import
# of torchtune_grpo.rewards.answers finds the same copy as the parent's.
_WORKER_CODE = (
    "import importlib.util, sys\n"
    "sys.path.insert(0, {root!r})\n"
    "spec = importlib.util.spec_from_file_location('_tg_math_grading_worker', {path!r})\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main()\n"
)


def _terminate(proc: subprocess.Popen) -> None:
    """Kill a worker process and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(Exception):
            proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(Exception):
            stream.close()


class _WorkerDied(Exception):
    """The worker exited or closed its output."""


class _Worker:
    """One grading subprocess and its line-based pipe protocol."""

    def __init__(self, options: dict[str, Any]) -> None:
        path = os.path.abspath(__file__)
        root = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        code = _WORKER_CODE.format(path=path, root=root)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            close_fds=True,
        )
        self._finalizer = weakref.finalize(self, _terminate, self.proc)
        self._buffer = b""
        self.ready = False

    def close(self) -> None:
        """Kill the process."""
        self._finalizer()

    def send(self, message: dict[str, Any]) -> None:
        """Write one request line."""
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise _WorkerDied(str(exc)) from exc

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next reply line, or ``None`` when none arrives within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerDied(f"worker exited with code {self.proc.poll()}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait_ready(self) -> None:
        """Block until the worker has imported math-verify."""
        if self.ready:
            return
        try:
            reply = self.receive(_STARTUP_TIMEOUT_S)
        except _WorkerDied as exc:
            raise RuntimeError(
                f"MathEquivalence: the grading worker failed to start ({exc})"
            ) from exc
        if reply is None or "fatal" in reply:
            self.close()
            why = "it did not start in time" if reply is None else reply["fatal"]
            raise RuntimeError(
                f"MathEquivalence: the grading worker failed to start: {why}. Install the "
                "grader with `pip install 'torchtune-grpo[math]'` (math-verify)."
            )
        self.ready = True


# --------------------------------------------------------------------------------------------
# The reward component
# --------------------------------------------------------------------------------------------


class MathEquivalence:
    """Correctness by mathematical equivalence: 1.0 when the boxed answer equals the gold one.

    The predicted answer is the content of the completion's last ``\\boxed{...}`` (see
    :func:`.extract_boxed`). Without a box, ``fallback`` decides: ``"none"`` scores 0,
    ``"last_math"`` takes the last ``$...$``/``\\(...\\)``/``\\[...\\]`` block, ``"last_number"``
    the last number of the text as the training rewards read it (:func:`.last_number`: ``10-3``
    ends with 3, ``1,234`` is 1234, ``-\\frac{1}{2}`` is -1/2). The prediction and the gold
    answer are compared by ``math-verify`` (see :func:`grade_answer`), so equivalent forms
    agree: fractions and decimals, ``\\dfrac``/``\\frac``, intervals, sets and tuples, radicals,
    ``x = 5`` and ``5``, degrees and percent signs, ``\\text{...}`` answers.

    **Time bound.** Every (completion, gold) pair takes at most about ``timeout_s`` plus 0.5 s
    of wall time; a pair that runs out of time scores 0. With ``isolation="process"`` (default)
    the bound holds for any input: grading runs in a worker process that is killed and
    restarted when it overruns (a restart costs about a second, not counted in the bound).
    With ``isolation="inline"`` grading runs in the calling process and the bound is a
    ``SIGALRM`` timer, which only works in the main thread (elsewhere there is no bound) and
    cannot interrupt long C computations (huge factorials or powers); use it for debugging or
    where subprocesses are not allowed. Predictions longer than ``max_answer_chars`` score 0
    without being parsed. Completions never make it raise.

    Args:
        timeout_s: seconds allowed per pair.
        fallback: ``"none"``, ``"last_math"`` or ``"last_number"`` (see above).
        isolation: ``"process"`` or ``"inline"``.
        max_answer_chars: longest prediction that is parsed.
        memory_limit_mb: address-space limit of the worker process (``None``: no limit), so
            that an expression which allocates huge integers fails fast instead of swapping.
        float_rounding: decimal places floats are rounded to (math-verify).
        numeric_precision: significant digits of numeric comparisons (math-verify).
        strict: math-verify's strict mode.

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
    ) -> None:
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
        """The final answer of one completion, normalised for maj@k voting.

        Args:
            completion: the generated text.

        Returns:
            :func:`normalize_answer` of the predicted answer, or ``None`` when there is none.
        """
        predicted = self._prediction(completion)
        if predicted is None:
            return None
        return normalize_answer(predicted) or None

    # -- grading ------------------------------------------------------------------------------

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Score a batch.

        Args:
            completions: ``N`` generated texts.
            answers: ``N`` gold answers (LaTeX, e.g. ``"\\frac{14}{3}"``).
            **kwargs: ignored.

        Returns:
            ``N`` floats in ``{0.0, 1.0}``.

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
