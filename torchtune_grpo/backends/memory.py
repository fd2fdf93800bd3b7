"""Measure the peak memory of this process, and of a recipe run in a fresh CPU process."""

from __future__ import annotations

import json


def proc_field_bytes(path: str, field: str) -> int | None:
    """A ``kB`` field of a Linux ``/proc`` file (``/proc/self/status``'s ``VmHWM``,
    ``/proc/meminfo``'s ``MemAvailable``) in bytes; None where the file or field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes: ``VmHWM`` of ``/proc/self/status``
    (``ru_maxrss``, which Linux carries across ``fork``/``exec``, only without ``/proc``).
    """
    import sys

    peak = proc_field_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


_CHILD = """
import json, resource, sys
import torch
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.backends.memory import peak_rss_bytes
from torchtune_grpo.training.recipe import GRPORecipe

def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize()

torch.set_num_threads(int(sys.argv[2]))
cfg = load_config(sys.argv[1], sys.argv[3:])
torch.manual_seed(0); torch.randn(8) @ torch.randn(8)  # load the math kernels first
base = rss()
recipe = GRPORecipe(cfg)
recipe.setup()
recipe.train()
peak = peak_rss_bytes()
print('RESULT ' + json.dumps({'baseline': base, 'peak': peak}))
"""


def measure_peak_memory(config: str, overrides: list[str], *, threads: int = 1,
                        timeout: float = 300) -> int:
    """Run the recipe in a fresh CPU process; return its peak RSS above the baseline of the imports
    (with ``MALLOC_MMAP_THRESHOLD_`` set so the peak measures live tensors).

    Args:
        config: config name or path (``device`` must be ``cpu``).
        overrides: ``key=value`` overrides.
        threads: torch threads in the child.
        timeout: seconds before the child is killed.

    Returns:
        Peak bytes above the baseline.
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, config, str(threads), *overrides],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    return int(result["peak"] - result["baseline"])
