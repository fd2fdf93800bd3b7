"""Step metrics: timing the phases of a step, peak memory, and reading back what a run logged
(for tests, plots and ablations).

The recipes log through torchtune's ``metric_logger``; the shipped configs use
:class:`torchtune.training.metric_logging.DiskLogger`, which writes one line per step,
``Step N | name:value name:value ...``, into ``output_dir/logs/log_<time>.txt``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_disk_log(path: str | Path) -> list[dict[str, float]]:
    """Metrics of every logged step, in order, each with its ``step``.

    Args:
        path: a DiskLogger file, or a folder holding them: all are read, oldest first, and a
            step logged again (a resumed run repeats the steps after its checkpoint) keeps
            its newest values.

    Raises:
        FileNotFoundError: no log file at ``path``.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("log_*.txt"), key=lambda p: (p.stat().st_mtime, p.name))
        if not files:
            raise FileNotFoundError(f"no DiskLogger file (log_*.txt) in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"metric log {path} not found")
    rows: dict[int, dict[str, float]] = {}
    for file in files:
        _read_into(file, rows)
    return [rows[k] for k in sorted(rows)]


def _read_into(path: Path, rows: dict[int, dict[str, float]]) -> None:
    seen: set[int] = set()
    for line in path.read_text().splitlines():
        if not line.startswith("Step ") or "|" not in line:
            continue
        head, _, body = line.partition("|")
        step = int(head.split()[1])
        if step not in seen:  # first line of this step in this file: replaces older values
            rows[step] = {"step": float(step)}
            seen.add(step)
        row = rows[step]
        for item in body.split():
            name, _, value = item.rpartition(":")
            try:
                row[name] = float(value)
            except ValueError:
                continue


class PhaseTimer:
    """Seconds spent in each named phase of a step: ``with timer("update"): ...``.

    A phase entered several times (one per gradient-accumulation chunk) accumulates;
    :attr:`seconds` maps phase names to totals, in first-entry order.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Time the ``with`` body and add it to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def peak_memory_gb(device: Any) -> float:
    """Peak memory of this process since the start, in GB (10**9 bytes).

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only). CPU: the process's peak resident
    set size (:func:`~torchtune_grpo.backends.memory.peak_rss_bytes`; Python, libraries and data
    included), the only peak the OS keeps.
    """
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    from torchtune_grpo.backends.memory import peak_rss_bytes

    return peak_rss_bytes() / 1e9
