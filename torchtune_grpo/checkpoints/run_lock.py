"""One run per output folder: an ``fcntl.flock`` on ``folder/.tune_grpo.lock`` held for the
life of the process (released by the kernel however the process ends). The file names its
last holder; a file system without ``flock`` gets a warning and no lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from torchtune_grpo.errors import UserError

#: The lock file's name inside the folder it guards.
LOCK_FILE = ".tune_grpo.lock"

log = logging.getLogger(__name__)


class FolderInUseError(UserError):
    """Another process holds the folder's lock; the message names it."""


class FolderLock:
    """An exclusive, non-blocking lock on ``folder`` for this process; a context manager, or
    :meth:`acquire` / :meth:`release`.

    Args:
        folder: the folder (created if missing).
        purpose: what the holder does there, for the other process's error (``"training"``,
            ``"grpo_eval"``).
    """

    def __init__(self, folder: str | Path, purpose: str) -> None:
        self.folder = Path(folder).expanduser()
        self.purpose = purpose
        self.path = self.folder / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> FolderLock:
        """Take the lock.

        Raises:
            FolderInUseError: another process holds it; names its pid, host, start and purpose.
        """
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.seek(0)
            holder = _describe(handle.read())
            handle.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUseError(
                    f"{self.folder} is in use by another run ({holder}); wait for it to end, "
                    "or choose another output folder") from None
            log.warning(f"cannot lock {self.path} ({exc.strerror}): this file system does not "
                        "support locks, so nothing stops a second run from writing here")
            return self
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder_info(self.purpose)) + "\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        """Release the lock (the file stays, naming the last holder)."""
        if self._file is not None:
            import fcntl

            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._file is not None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder_info(purpose: str) -> dict[str, Any]:
    """What the lock file records: pid, host, start time (UTC), purpose, command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "purpose": purpose, "command": " ".join(sys.argv)[:300]}


def _describe(text: str) -> str:
    try:
        info = json.loads(text.strip().splitlines()[0])
        return (f"{info.get('purpose', 'a run')}, pid {info['pid']} on {info['host']}, started "
                f"{info['started']}")
    except (ValueError, KeyError, IndexError, TypeError):
        return "holder unknown"


def is_locked(folder: str | Path) -> bool:
    """Whether another process holds ``folder``'s lock now (False without a lock file or locks)."""
    import fcntl

    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return False
