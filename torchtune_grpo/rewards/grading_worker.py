"""Grading a (predicted, gold) answer pair with ``math-verify``, bounded in time.

:func:`grade_answer` is the bare comparison. A worker process (``_Worker`` in the parent,
``_worker_main`` in the child) grades pairs sent over a pipe and is killed when a pair runs
past ``timeout_s`` plus ``_KILL_GRACE_S``, since SymPy can compute for minutes inside C code
where no signal reaches; a ``SIGALRM`` soft limit (``_Alarm``) stops Python-level work first.
Only the standard library is imported at import time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from typing import Any

__all__ = ["grade_answer"]

#: Seconds a worker may take to start (import SymPy and math-verify) before it counts as failed.
_STARTUP_TIMEOUT_S = 120.0
#: Extra seconds the parent waits after ``timeout_s`` before it kills a worker.
_KILL_GRACE_S = 0.5


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
    """Whether ``predicted`` is equivalent to ``gold`` according to math-verify, with no time limit.

    Both are bare answers (box contents), wrapped in ``\\boxed{}`` and parsed; a gold answer that
    does not parse must equal the prediction as stripped text. Grade untrusted text with
    :class:`~torchtune_grpo.rewards.math_grading.MathEquivalence`.

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
    """Silence the parse warnings math-verify and its LaTeX parser log for malformed answers."""
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
# the worker); the folder holding the package goes first on sys.path so that any import of the
# package from this file finds the same copy as the parent's.
_WORKER_CODE = (
    "import importlib.util, sys\n"
    "sys.path.insert(0, {root!r})\n"
    "spec = importlib.util.spec_from_file_location('_tg_grading_worker', {path!r})\n"
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
