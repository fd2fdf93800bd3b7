"""The one error type for mistakes a user can fix, and how entry points report it.

Entry points print a :class:`UserError` as one line (``error: ...``) and exit 2; an
:class:`Interrupted` run exits 130 (SIGINT) or 143 (SIGTERM). ``TUNE_GRPO_DEBUG=1`` keeps the
traceback of a user error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator

#: Exit status of a user error (as argparse uses for bad arguments).
USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in the input (config, data, checkpoint, model folder, disk, flags) that the
    user can fix; the message names what is wrong and where, in one line."""


class DataError(UserError, ValueError):
    """A data set, data file or prompt template that cannot be used; names the file, the row or
    line (counted from 1) and the field."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or model folder that cannot be used as asked: damaged, non-finite, another
    model's, or another run's (a seed that differs on resume)."""


class ComponentError(UserError, RuntimeError):
    """A user-supplied component (a reward function, a tool) raised: the message names the
    component, its exception and the input it failed on; ``TUNE_GRPO_DEBUG=1`` shows the
    component's traceback."""


class Interrupted(Exception):
    """The run was stopped by a signal before there was anything to save.

    Args:
        message: what was stopped and what was kept.
        exit_code: 130 for SIGINT, 143 for SIGTERM.
    """

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def debug() -> bool:
    """Whether ``TUNE_GRPO_DEBUG`` asks for tracebacks of user errors."""
    return os.environ.get("TUNE_GRPO_DEBUG", "").strip() not in ("", "0", "false")


def one_line(message: str) -> str:
    """``message`` with its line breaks folded into ``"; "`` (a user error prints as one line)."""
    parts = [p.strip(" -") for p in str(message).splitlines()]
    return "; ".join(p for p in parts if p).replace(":;", ":")


def first_to_report(line: str) -> bool:
    """Whether this process is the first of its ``torchrun`` launch on this machine to print
    ``line`` (always True outside torchrun): the ranks of a launch usually hit the same user
    error, and it is printed once, not once per rank; different lines are all printed.

    The first rank to create a marker file named by the launch's run id and the line wins.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    digest = hashlib.sha256(f"{run_id}\0{line}".encode()).hexdigest()[:24]
    marker = os.path.join(tempfile.gettempdir(), f"tune_grpo_reported_{digest}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:  # no temporary folder to write: print rather than lose the line
        return True
    return True


def _print_once(line: str) -> None:
    if first_to_report(line):
        print(line, file=sys.stderr, flush=True)


def report(exc: BaseException, prefix: str = "error") -> None:
    """Print the user error ``exc`` as its one line now (once per torchrun launch) and mark it
    reported: the entry point then exits 2 without printing it again. For a process that may be
    killed before it reaches its entry point (torchrun stops the other workers soon after one
    fails)."""
    if debug() or getattr(exc, "reported", False):
        return
    _print_once(f"{prefix}: {one_line(_message(exc))}")
    exc.reported = True  # type: ignore[attr-defined]


def _reported_cause(exc: BaseException) -> BaseException | None:
    """A user error already :func:`report`-ed that ``exc`` was raised while handling."""
    seen = exc.__context__
    while seen is not None:
        if getattr(seen, "reported", False):
            return seen
        seen = seen.__context__
    return None


@contextlib.contextmanager
def reported_as_one_line(prefix: str = "error") -> Iterator[None]:
    """Turn a :class:`UserError` (and the user-facing built-in errors of a missing, existing or
    unwritable file) into ``{prefix}: ...`` on stderr and ``SystemExit(2)``; an
    :class:`Interrupted` into one line and its exit status. Other exceptions pass through.
    Under ``torchrun`` a line that several ranks would print is printed once
    (:func:`first_to_report`).
    """
    try:
        yield
    except Interrupted as exc:
        if debug():
            raise
        if _reported_cause(exc) is not None:  # a signal while cleaning up after a user error
            raise SystemExit(USER_ERROR_EXIT) from None
        _print_once(f"stopped: {one_line(str(exc))}")
        raise SystemExit(exc.exit_code) from None
    except (UserError, FileNotFoundError, FileExistsError, PermissionError,
            IsADirectoryError, NotADirectoryError) as exc:
        if debug():
            raise
        report(exc, prefix)
        raise SystemExit(USER_ERROR_EXIT) from None


def _message(exc: BaseException) -> str:
    """The text of ``exc``; built-in OS errors raised with ``(errno, text, path)`` read as
    ``text: path``."""
    if isinstance(exc, OSError) and exc.strerror and not str(exc).startswith("[Errno"):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)
