"""The files an evaluation writes into the checkpoint folder it describes, and the result they
are written from.

``eval_results.json`` (:data:`RESULTS_FILE`) holds the metrics, settings and provenance;
``eval_samples.jsonl`` (:data:`SAMPLES_FILE`) one line per problem (prompt, completions,
extracted and gold answers, correctness, ``transcripts`` with tools). While an evaluation
runs each rank appends its scored rows to a partial file (:class:`PartialSamples`);
:meth:`EvalResult.write` replaces both files atomically, then removes the partial files.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchtune_grpo.evaluation.settings import EvalSettings

RESULTS_FILE = "eval_results.json"
#: Folder of a training run's ``output_dir`` that holds its start evaluation (step 0).
START_EVAL_DIR = "eval_step_0"
SAMPLES_FILE = "eval_samples.jsonl"
#: Per-rank file that :func:`~torchtune_grpo.evaluation.evaluate.evaluate` appends each scored
#: problem to (``{rank}``: the rank).
PARTIAL_SAMPLES_FILE = "eval_samples.rank{rank}.partial.jsonl"


def partial_samples_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` appends its scored problems while evaluating into ``directory``."""
    return Path(directory) / PARTIAL_SAMPLES_FILE.format(rank=rank)


def _plain(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: tensors/arrays as lists, mapping keys
    as strings, any other object as its ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    return str(value)


def eval_fingerprint(model_dir: str | Path | None, **parts: Any) -> str:
    """A short hash identifying an evaluation: the model's weight files (path, names, sizes,
    modification times) and ``parts`` (dataset, sampling settings, rewards...).
    """
    files: list[Any] = []
    if model_dir is not None and Path(model_dir).is_dir():
        root = Path(model_dir).resolve()
        files = [str(root)] + [
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.iterdir())
            if p.suffix in (".safetensors", ".bin", ".pt") and p.name != "recipe_state.pt"]
    payload = json.dumps({"model": files, **_plain(parts)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def stored_eval_metrics(directory: str | Path, fingerprint: str) -> dict[str, float] | None:
    """The metrics of the finished evaluation in ``directory`` when its ``eval_results.json``
    carries ``fingerprint``; None otherwise (absent, unreadable, or another evaluation)."""
    try:
        stored = json.loads((Path(directory) / RESULTS_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(stored, dict) or stored.get("fingerprint") != fingerprint:
        return None
    return dict(stored.get("metrics") or {})


def read_partial_rows(directory: str | Path, fingerprint: str) -> dict[int, dict[str, Any]]:
    """The rows of ``directory``'s partial sample files (any number of ranks) whose first line
    carries ``fingerprint``, by dataset position; a line cut short ends its file's rows.
    """
    rows: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(directory).glob(PARTIAL_SAMPLES_FILE.format(rank="*"))):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            head = json.loads(lines[0]) if lines else {}
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if not isinstance(head, dict) or head.get("fingerprint") != fingerprint:
            continue
        for line in lines[1:]:
            try:
                row = json.loads(line)
                rows[int(row["position"])] = row
            except (ValueError, KeyError, TypeError):
                break
    return rows


class PartialSamples:
    """This rank's ``eval_samples.rank{r}.partial.jsonl``: one flushed line per scored problem
    (values JSON cannot hold written as text).

    Args:
        path: the file, created afresh (its folder too); None: rows are not written.
        fingerprint: written as the first line (``{"fingerprint": ...}``), for
            :func:`read_partial_rows`.
        carried: rows of an interrupted run to write first (this rank's share).
    """

    def __init__(self, path: Path | None, fingerprint: str | None = None,
                 carried: Sequence[dict[str, Any]] = ()) -> None:
        self.path = path
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")  # a rerun starts the file afresh
            if fingerprint is not None:
                self._file.write(json.dumps({"fingerprint": fingerprint}) + "\n")
            for row in carried:
                self._file.write(json.dumps(_plain(row)) + "\n")
            self._file.flush()

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one JSON line and flush it (nothing without a path)."""
        if self._file is not None:
            self._file.write(json.dumps(_plain(row)) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (the rows written so far stay on disk)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def where_partial(paths: Sequence[Path]) -> str:
    """The sentence an error ends with: where the completed samples are (or that none are)."""
    if not paths:
        return "no partial samples were kept (pass `partial_dir` to evaluate() to keep them)"
    return "the completed samples are in " + ", ".join(str(p) for p in paths)


@dataclass
class EvalResult:
    """Metrics (``pass@1``, ``pass@k``, ``maj@k``, ``reward/<name>``, ...) and per-problem rows.

    Attributes:
        metrics: metric name to value.
        samples: one row per problem, in dataset order.
        settings: the sampling settings used.
        seconds: wall time of the evaluation.
        partial_files: the per-rank partial files holding the same rows (empty without
            ``partial_dir``); :meth:`write` removes them.
    """

    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    settings: EvalSettings
    seconds: float
    partial_files: list[Path] = field(default_factory=list)

    def summary(self, **info: Any) -> dict[str, Any]:
        """The ``eval_results.json`` payload; ``info`` adds dataset, split, model path..."""
        return {
            **info,
            "num_problems": len(self.samples),
            "metrics": self.metrics,
            "sampling": self.settings.__dict__,
            "seconds": self.seconds,
            "problems_per_second": len(self.samples) / max(self.seconds, 1e-9),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def files(self, **info: Any) -> dict[str, str]:
        """``{eval_results.json: ..., eval_samples.jsonl: ...}`` as text.

        Raises:
            ValueError: a row or the summary holds a value JSON cannot represent; the message
                names the row and where the partial samples are.
        """
        lines = []
        for row in self.samples:
            try:
                lines.append(json.dumps(row) + "\n")
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"eval: the row of problem index={row.get('index')} "
                    f"(position {row.get('position')}) cannot be written as JSON ({exc}); check "
                    f"what the dataset and the rewards return; {where_partial(self.partial_files)}"
                ) from exc
        try:
            results = json.dumps(self.summary(**info), indent=2) + "\n"
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"eval: {RESULTS_FILE} cannot be written as JSON ({exc}); "
                f"{where_partial(self.partial_files)}"
            ) from exc
        return {RESULTS_FILE: results, SAMPLES_FILE: "".join(lines)}

    def write(self, directory: str | Path, **info: Any) -> list[Path]:
        """Write ``eval_results.json`` and ``eval_samples.jsonl`` into ``directory``, atomically.

        Each goes to a temporary file, renamed over its name (samples first); only then are
        :attr:`partial_files` removed. On failure they stay and the error names them.

        Args:
            directory: the folder to write into (created if needed).
            **info: extra fields of ``eval_results.json`` (dataset, split, model path...).

        Returns:
            ``[eval_results.json, eval_samples.jsonl]`` paths.

        Raises:
            ValueError: a value JSON cannot represent (see :meth:`files`).
            OSError: writing failed.
        """
        directory = Path(directory)
        texts = self.files(**info)
        written: dict[str, Path] = {}
        temps: list[Path] = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name in (SAMPLES_FILE, RESULTS_FILE):
                tmp = directory / f".{name}.{os.getpid()}.tmp"
                temps.append(tmp)
                with tmp.open("w", encoding="utf-8") as f:
                    f.write(texts[name])
                    f.flush()
                    os.fsync(f.fileno())
            for name, tmp in zip((SAMPLES_FILE, RESULTS_FILE), temps):
                os.replace(tmp, directory / name)
                written[name] = directory / name
        except OSError as exc:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            raise OSError(
                f"eval: writing {RESULTS_FILE} / {SAMPLES_FILE} into {directory} failed ({exc}); "
                f"{where_partial(self.partial_files)}"
            ) from exc
        self.remove_partial_files()
        return [written[RESULTS_FILE], written[SAMPLES_FILE]]

    def remove_partial_files(self) -> None:
        """Delete the per-rank partial sample files that this process can see."""
        for path in self.partial_files:
            path.unlink(missing_ok=True)
