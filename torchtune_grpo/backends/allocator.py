"""CPU memory allocator settings for training on the CPU: freed memory stays for reuse.

A GRPO step on the CPU allocates and frees the same large tensors over and over: the
activations of every layer in the update's forward and backward (``[tokens, hidden]`` blocks
of several MiB each), the logits blocks of the log-probs, the gradients. glibc's ``malloc``
serves every block above its mmap threshold (128 KiB, raised dynamically up to 32 MiB) with a
fresh ``mmap`` and gives it back to the kernel on ``free``, and trims the top of its heap when
more than the trim threshold lies free there. Either way the next block of that size starts
as untouched pages, and the kernel page-faults and zeroes them one 4 KiB page at a time as
the tensor is first written (what that costs on the real model's update, measured with
``python -m benchmarks.allocator``: ``docs/performance.md``).

:func:`keep_freed_memory` turns that off for the process: no block is served by ``mmap``
(``M_MMAP_MAX = 0``) and the heap is trimmed only when more than :data:`TRIM_THRESHOLD` bytes
lie free at its top, so a freed block is reused by the next allocation that fits (not always
one of exactly the freed size: glibc 2.36 asks a little more for torch's 64-byte-aligned
blocks, so the heap grows for a few steps before its free blocks cover the step). The cost is
that the process's resident memory stays near its peak instead of shrinking between phases
(the peak itself moves by the allocator's fragmentation: +3% on the real-model step). The
training recipes call it on ``device: cpu`` (config key ``keep_freed_cpu_memory``, on by
default); the CUDA caching allocator already does the same for GPU tensors.
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

    Sets ``M_MMAP_MAX = 0`` (no ``mmap``-served blocks: every block comes from the heap and
    returns to it when freed) and ``M_TRIM_THRESHOLD =`` :data:`TRIM_THRESHOLD` (the heap's top
    is given back only when that much lies free), so that re-allocating a block of a size the
    process used before costs no page faults. Affects allocations made after the call; cannot
    be undone. Calling it again does nothing.

    Left alone (returns False): a C library other than glibc (macOS, musl), and a process whose
    environment already configures ``malloc`` (any of :data:`GLIBC_MALLOC_ENV`, e.g. the
    ``MALLOC_MMAP_THRESHOLD_`` that
    :func:`torchtune_grpo.backends.memory.measure_peak_memory` sets to
    measure live tensors). An allocator preloaded in glibc's place (jemalloc, tcmalloc) keeps
    its own policy; the call then only configures glibc's unused one.

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
