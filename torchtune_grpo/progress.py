"""What a long piece of work is doing now, reported while it runs.

A :class:`Progress` holds the current phase of rank 0's work (``rollout``, ``update``,
``eval``, ...) and its counters. The code doing the work only writes a few attributes (no I/O,
no device sync), cheap enough for a decode loop. A reporter thread reads them: once the work
has gone ``every_s`` seconds (30 by default) without a line (:meth:`Progress.mark` says one was
printed elsewhere, e.g. a step's), it logs the phase in flight, with an estimate of the time
left from the units done, and it keeps a terminal's progress bar's postfix current.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("torchtune_grpo")

#: Seconds between two lines about one phase.
REPORT_EVERY_S = 30.0


def duration(seconds: float) -> str:
    """``seconds`` for a person: ``"45 s"``, ``"3 min 20 s"``, ``"1 h 05 min"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """The current phase of this process's work and its counters, shown every ``every_s``.

    Args:
        show: report at all (False: the counters are kept and nothing is shown; other ranks).
        every_s: the most seconds without a line while a phase runs (work that prints
            more often, e.g. short steps, gets no extra line); default :data:`REPORT_EVERY_S`.
        emit: where lines go (default: the ``torchtune_grpo`` logger at INFO).
        prefix: called for each line's prefix (e.g. ``"step 3/60"``), or None.
    """

    def __init__(self, *, show: bool = True, every_s: float | None = None,
                 emit: Callable[[str], None] | None = None,
                 prefix: Callable[[], str] | None = None) -> None:
        self.show = show
        self.every_s = float(REPORT_EVERY_S if every_s is None else every_s)
        self.emit = emit or _log.info
        self.prefix = prefix
        self.bar: Any = None  # a tqdm bar whose postfix shows the phase (terminal only)
        self.phase: str | None = None
        self.total: int | None = None
        self.unit = ""
        self.done = self.already = 0
        self.token = 0  # decode step within the current generation call
        self.max_tokens = 0
        self.batch = self.batches = 0  # decode micro-batch of the call (1-based), and of how many
        self.started = self.last_line = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---------------------------------------------------------------- the working side
    def begin(self, phase: str, total: int | None = None, unit: str = "", *,
              already: int = 0) -> None:
        """Start ``phase`` (``total`` units of ``unit`` to do, if known; ``already`` of them
        done before, e.g. kept from an interrupted run: they do not count for the time left)."""
        self.phase, self.total, self.unit = phase, total, unit
        self.done = self.already = already
        self.token = self.max_tokens = self.batch = self.batches = 0
        self.started = time.monotonic()

    def advance(self, units: int = 1) -> None:
        """``units`` more of the phase are done."""
        self.done += units

    def decode_step(self, step: int, max_tokens: int) -> None:
        """A generation call is at decode step ``step`` of at most ``max_tokens``."""
        self.token, self.max_tokens = step, max_tokens

    def decode_batch(self, index: int, count: int, max_tokens: int = 0) -> None:
        """A generation call decodes its rows in ``count`` sequential batches of up to
        ``max_tokens`` tokens; ``index`` (from 1) is under way, its prompts' forward first."""
        self.batch, self.batches = index, count
        self.token, self.max_tokens = 0, max_tokens or self.max_tokens

    def end(self) -> None:
        """The phase is over (nothing is reported until the next :meth:`begin`)."""
        self.phase = None

    def mark(self) -> None:
        """A line about this work was just printed elsewhere (a step's): the next report is
        due ``every_s`` from now."""
        self.last_line = time.monotonic()

    # ---------------------------------------------------------------- the reporting side
    def describe(self, now: float | None = None) -> str | None:
        """The current phase in words, or None between phases."""
        phase = self.phase
        if phase is None:
            return None
        now = time.monotonic() if now is None else now
        elapsed = now - self.started
        parts = [phase]
        if self.total:
            parts.append(f"{min(self.done, self.total)}/{self.total} {self.unit}".rstrip())
        elif self.done:
            parts.append(f"{self.done} {self.unit}".rstrip())
        if self.batches > 1:
            parts.append(f"batch {self.batch}/{self.batches}")
        if self.max_tokens:  # token 0: the prompts' forward pass (prefill) is running
            parts.append(f"token {self.token}/{self.max_tokens}" if self.token else
                         f"prefill, up to {self.max_tokens} tokens")
        text = ", ".join(parts) + f" ({duration(elapsed)}"
        new = self.done - self.already
        if self.total and new > 0 and self.done < self.total:
            left = elapsed / new * (self.total - self.done)
            text += f", about {duration(left)} left"
        text += ")"
        prefix = self.prefix() if self.prefix is not None else ""
        return f"{prefix}: {text}" if prefix else text

    def due(self, now: float | None = None) -> str | None:
        """The line to log now, if one is due (a phase runs and no line was printed for
        ``every_s``), else None; marks it logged."""
        now = time.monotonic() if now is None else now
        if self.phase is None or now - self.last_line < self.every_s:
            return None
        line = self.describe(now)
        self.last_line = now
        return line

    def _run(self) -> None:
        while not self._stopping.wait(min(1.0, self.every_s)):
            try:
                if self.bar is not None:
                    text = self.describe()
                    self.bar.set_postfix_str(text or "", refresh=True)
                elif (line := self.due()) is not None:
                    self.emit(line)
            except Exception:  # a report must never take the run down
                pass

    def __enter__(self) -> Progress:
        """Start the reporter thread (when shown)."""
        self.mark()
        if self.show and self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the reporter thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.end()


#: Counters nobody reads: the default where no progress is wanted.
SILENT = Progress(show=False)
