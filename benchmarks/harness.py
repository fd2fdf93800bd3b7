"""What the benchmarks share: paths, timing, rates measured now, result files, subprocesses.

Every script of ``benchmarks/`` is a module of the ``benchmarks`` package: ``from benchmarks
import step`` (the tests) or ``python -m benchmarks.step`` from the repository root. A script
that uses this harness still runs as a file (``python benchmarks/step.py``, the commands of the
docs): run that way, it first puts the repository root on ``sys.path``::

    if not __package__:  # run as a file: python benchmarks/NAME.py
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import harness  # noqa: E402

This module imports neither ``torch`` nor ``torchtune_grpo`` at import time; the functions that
need them import them when called. The peers (``benchmarks/peers/*.py``) do not use it: they
run with the Python of another environment (TRL's, torchtune's dev checkout) that need not have
this package's dependencies.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The repository root (the folder holding ``benchmarks/`` and ``torchtune_grpo/``).
REPO = Path(__file__).resolve().parents[1]
#: GSM8K's train split when the shared data folder is next to the checkout (else the scripts
#: write synthetic questions).
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
#: The HF folder ``tune-grpo prepare-model smollm2`` writes.
SMOLLM2_DIR = Path("/tmp/tune_grpo_models/SmolLM2-135M-Instruct")


class PeerUnavailable(RuntimeError):
    """A peer's environment cannot run its trainer (the message says how to install it)."""


# ---------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Fewest wall seconds of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls.

    The minimum, not the mean: on a shared machine the other processes only ever add time, so
    the fastest call is the closest to what the code itself costs.
    """
    for _ in range(warmup):
        fn()
    return min(timed(fn) for _ in range(repeats))


class Phases:
    """Wall seconds of the named phases of one step: ``with phases("update"): ...``.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called at both edges of every phase, so that
    queued device work is counted in the phase that queued it. :attr:`seconds` maps the phase
    names to their seconds in the order they ran (a phase run again replaces its time).
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        """Start with no phases; ``sync`` as above (None: nothing to wait for)."""
        self.seconds: dict[str, float] = {}
        self._sync = sync or (lambda: None)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as phase ``name``."""
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = time.perf_counter() - t0


def mean_of(rows: Sequence[Mapping[str, float]], keys: Iterable[str] | None = None
            ) -> dict[str, float]:
    """Mean over ``rows`` of each of ``keys`` (default: the first row's keys)."""
    keys = list(rows[0]) if keys is None else list(keys)
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


# ---------------------------------------------------------------------------- rates
def matmul_flops_per_second(size: int = 1024, repeats: int = 8) -> float:
    """Best fp32 matmul rate of ``[size, size] @ [size, size]`` over ``repeats`` runs."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats, warmup=2)


def decode_matmul_flops_per_second(model, rows: int, repeats: int = 5,
                                   kernel: str = "linear") -> float:
    """Best rate of one decode step's matmuls: every weight of ``model`` applied to ``rows``.

    The weights are used in model order, so (as in a real decode step) each is read from
    memory rather than cache once the model outgrows the cache; ``rows`` is the decode batch.
    This is the rate a decode step's linear layers can reach here, which for small ``rows`` is
    well below the square-matmul rate. ``kernel``: ``"linear"`` times ``F.linear`` (MKL on
    CPU); ``"onednn"`` times oneDNN on weights reordered beforehand, as the native engine's
    ``packed_weights`` decodes on CPU.
    """
    import torch

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not isinstance(getattr(model, "output", None), torch.nn.Linear):
        weights.append(model.tok_embeddings.weight.detach())  # tied output projection
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    work = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    if kernel == "onednn":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]

        def step():
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
    elif kernel == "linear":
        def step():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)
    else:
        raise ValueError(f"kernel must be 'linear' or 'onednn', got {kernel!r}")

    return work / best_seconds(step, repeats)


def memory_read_bytes_per_second(mib: int = 512, repeats: int = 5) -> float:
    """Best memory read bandwidth: ``sum`` over a ``mib`` MiB fp32 tensor (bigger than caches)."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / best_seconds(x.sum, repeats)


def peak_memory_bytes(device) -> int:
    """Peak memory of this process: ``torch.cuda.max_memory_allocated`` on CUDA, the peak
    resident set size (``VmHWM``) on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from torchtune_grpo.backends.memory import peak_rss_bytes

    return peak_rss_bytes()


# ---------------------------------------------------------------------------- models and data
def write_tiny_model(directory: Path, dims: dict, seed: int = 0):
    """A random ``tiny_llama(**dims)`` (``torch.manual_seed(seed)`` first) written with the tiny
    tokenizer as an HF folder into ``directory``; returns the model."""
    import torch

    from torchtune_grpo.quickstart.tiny import tiny_llama, write_hf_checkpoint

    torch.manual_seed(seed)
    model = tiny_llama(**dims)
    write_hf_checkpoint(model, directory, dims)
    return model


def smollm2_missing(model_dir: Path) -> bool:
    """True (and the error on stderr) when ``model_dir`` holds no prepared model."""
    if (Path(model_dir) / "config.json").exists():
        return False
    print(f"error: no model at {model_dir}; run `tune-grpo prepare-model smollm2`",
          file=sys.stderr)
    return True


def batch_prompts(batch: Mapping[str, Any]) -> dict[str, list]:
    """The prompt token ids (left padding removed) and gold answers of a recipe batch: what a
    peer is given to replay the same step."""
    lengths = batch["prompt_lengths"].tolist()
    return {"tokens": [row[len(row) - n:] for row, n in zip(batch["tokens"].tolist(), lengths)],
            "answers": list(batch["answers"])}


# ---------------------------------------------------------------------------- results
def utc_now() -> str:
    """The time as the result files record it (``2026-12-04 18:07 UTC``)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def run_metadata(script: str, argv: Sequence[str] | None) -> dict[str, str]:
    """``{"command", "date"}`` of this invocation of ``benchmarks/<script>.py``."""
    args = list(argv) if argv is not None else sys.argv[1:]
    return {"command": " ".join(["python", f"benchmarks/{script}.py", *args]),
            "date": utc_now()}


def write_json(path: str | Path, data: Any, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file, then a rename; its
    folder made when missing), so that a killed run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted with ``spec`` and ``suffix`` for a table, or ``-`` when it is missing."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


# ---------------------------------------------------------------------------- subprocesses
def subprocess_env(*pythonpath: str | Path, **variables: Any) -> dict[str, str]:
    """This process's environment with ``pythonpath`` put in front of ``PYTHONPATH`` and the
    ``variables`` set (as strings)."""
    env = dict(os.environ, **{k: str(v) for k, v in variables.items()})
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [*map(str, pythonpath), os.environ.get("PYTHONPATH")]))
    return env


def run_json(cmd: Sequence[str | Path], out: Path, env: Mapping[str, str] | None = None) -> Any:
    """Run ``cmd`` (it must exit 0) and return the JSON it wrote to ``out``."""
    subprocess.run([str(c) for c in cmd], check=True, env=env)
    return json.loads(Path(out).read_text())


def tune_run(args: Sequence[str], *, cwd: Path, threads: int,
             pythonpath: Sequence[str | Path] = (), timeout: float | None = None
             ) -> subprocess.CompletedProcess:
    """``tune ARGS`` (e.g. ``run --nproc_per_node 2 RECIPE --config ...``) in ``cwd``, each
    process with ``OMP_NUM_THREADS=threads``; raises ``RuntimeError`` with the end of its
    stderr when it fails."""
    env = subprocess_env(*pythonpath, OMP_NUM_THREADS=threads, PYTHONUNBUFFERED=1)
    cmd = [sys.executable, "-m", "torchtune._cli.tune", *args]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def training_rows(output_dir: Path) -> list[dict[str, Any]]:
    """The training steps' rows (those with ``grad_norm``) of a run's metric log."""
    from torchtune_grpo.training.metrics import read_disk_log

    return [r for r in read_disk_log(Path(output_dir) / "logs") if "grad_norm" in r]
