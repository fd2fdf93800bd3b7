"""Ctrl-C (SIGINT) and SIGTERM for the whole life of a run, from its first second.

A recipe installs :class:`StopSignals` when it is constructed, before any model loads:

* **setting up** (nothing to save yet): the first signal stops at once with one line
  (:class:`~torchtune_grpo.errors.Interrupted`, exit 130 or 143);
* **evaluating or training** (inside :meth:`StopSignals.deferred`): the first signal is
  recorded; an evaluation stops after its current batch of problems, keeping the finished ones
  on disk, and a training step finishes, is saved, and the run stops with the command that
  continues it. A second Ctrl-C stops at once, losing only the step in progress.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from torchtune import utils

from torchtune_grpo.errors import Interrupted

log = utils.get_logger("INFO")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopSignals:
    """The run's SIGINT and SIGTERM handlers (see the module docstring).

    Args:
        what: what is running, for the messages (``"the run"``).
        quiet: log nothing (ranks other than 0).
    """

    def __init__(self, what: str = "the run", *, quiet: bool = False) -> None:
        self.what = what
        self.quiet = quiet
        #: why the run should stop at its next save point: the first signal received while
        #: deferred (``"SIGTERM"``) or the reason given to :meth:`request`; None to go on
        self.requested: str | None = None
        #: a signal was received (what makes an evaluation stop early; a :meth:`request`
        #: lets it finish)
        self.signalled = False
        self._deferring = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Install the handlers (in the main thread; elsewhere a no-op)."""
        try:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: the caller's handlers stay
            self._previous.clear()
        return self

    def restore(self) -> None:
        """Put the handlers found at :meth:`install` back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def request(self, reason: str = "request") -> None:
        """Ask the run to stop after the current step, saving it (a time budget, say); unlike
        a signal, an evaluation in progress still finishes."""
        self.requested = self.requested or reason

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within this block a first signal is recorded, not raised (see the module)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self._deferring:
            raise Interrupted(f"{name} while setting up {self.what}: nothing was trained, "
                              "evaluated or saved yet", _EXIT.get(signum, 130))
        if self.requested is not None and signum == signal.SIGINT:
            raise Interrupted(f"second Ctrl-C: {self.what} stopped at once; the step in "
                              "progress is lost, the saved step folders are intact", 130)
        if self.requested is None and not self.quiet:
            extra = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            log.warning(f"received {name}: stopping at the next point where the work done "
                        f"can be kept{extra}")
        self.requested = self.requested or name
        self.signalled = True


@contextlib.contextmanager
def signals_only_logged(who: str) -> Iterator[None]:
    """Within this block SIGINT and SIGTERM are logged and otherwise ignored: for a process
    that must outlive a stop request until its peers finish (an asynchronous rollout rank
    keeps serving the trainers while they save; dying would make torchrun kill them mid-save).

    Args:
        who: the process, for the log line (``"rollout rank 2"``).
    """
    def note(signum: int, _frame: Any) -> None:
        log.warning(f"{who}: {signal.Signals(signum).name}, stopping when the trainers do")

    previous = {sig: signal.signal(sig, note) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
