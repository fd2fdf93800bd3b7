"""Reading back the metrics a run logged (for tests, plots and ablations).

The recipes log through torchtune's ``metric_logger``; the shipped configs use
:class:`torchtune.training.metric_logging.DiskLogger`, which writes one line per step,
``Step N | name:value name:value ...``, into ``output_dir/logs/log_<time>.txt``.
"""

from __future__ import annotations

from pathlib import Path


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
