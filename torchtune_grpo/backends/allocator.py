"""CPU memory allocator settings: freed memory stays in the process for reuse.

:func:`keep_freed_memory` stops glibc ``malloc`` from serving large blocks by ``mmap`` and from
trimming its heap below :data:`TRIM_THRESHOLD`, so the tensors a CPU step allocates again and
again cost no fresh page faults; resident memory stays near its peak. ``docs/performance.md``
has the measurements.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["GLIBC_MALLOC_ENV", "TRIM_THRESHOLD", "keep_freed_memory"]

#: Environment variables through which glibc ``malloc`` is configured at process start; when
#: any is set, the allocator was chosen by whoever launched the process and is left alone.
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                    "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")

#: Free bytes at the top of the heap above which glibc still gives memory back (``mallopt``
#: takes an ``int``: the largest value is 2 GiB - 1).
TRIM_THRESHOLD = 2**31 - 1

# mallopt parameters (<malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_applied = False


def keep_freed_memory() -> bool:
    """Make glibc ``malloc`` keep freed memory in this process for reuse (process-wide).

    Sets ``M_MMAP_MAX = 0`` and ``M_TRIM_THRESHOLD =`` :data:`TRIM_THRESHOLD` for allocations made
    after the call; cannot be undone; a second call does nothing. Left alone (False) without glibc
    or when the environment already sets one of :data:`GLIBC_MALLOC_ENV`.

    Returns:
        bool: whether the settings are in effect (True also when an earlier call set them).
    """
    global _applied
    if _applied:
        return True
    if any(name in os.environ for name in GLIBC_MALLOC_ENV):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _applied
