"""Run recipes the way a user does: the stock ``tune`` command, from outside the repo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from torchtune_grpo.metrics import read_disk_log

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchtune._cli.tune", *args]


def run_tune(args: list[str], cwd: Path, timeout: float = 600, threads: int = 1):
    """Run ``tune ARGS`` in ``cwd``; raise with the output tail if it fails."""
    proc = subprocess.run(tune_cmd(*args), cwd=cwd, env=recipe_env(threads), timeout=timeout,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(
            f"tune {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    return proc


def quickstart_overrides(base: Path, out: Path, *extra: str) -> list[str]:
    """``--config grpo/quickstart_cpu`` for a test run: evaluation off unless ``extra`` turns
    it back on (later overrides win)."""
    return ["--config", "grpo/quickstart_cpu", f"model_dir={base}", f"output_dir={out}",
            "progress_bar=false", "eval_every_n_steps=null", "eval_at_start=false", *extra]


def metrics(out: Path) -> list[dict[str, float]]:
    return read_disk_log(out / "logs")
