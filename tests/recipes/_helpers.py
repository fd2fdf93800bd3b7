"""Run recipes the way a user does (the stock ``tune`` command, from outside the repo) or in
this process, and compare runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from torchtune_grpo.training.metrics import read_disk_log

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
QUICKSTART = "grpo/quickstart_cpu"
# measurements of the machine, not of the run: they differ between any two runs
TIMING = ("time/", "tokens_per_second", "peak_memory_gb", "async/", "weight_sync/seconds",
          "eval/problems_per_second")

#: Reward = completion length (tests/recipes/components.py). The under-trained ``base_model``
#: almost never answers right: rewarded by correctness alone, every group's rewards are equal,
#: every advantage is 0 and the weights never move, so two runs agree whatever the code does.
#: The length varies within the groups, so the update is never empty.
LENGTH_REWARD = [{"_component_": "tests.recipes.components.length_reward", "success": True,
                  "success_threshold": 3.0}]
#: :data:`LENGTH_REWARD` as a ``key=value`` override (``tune run`` or :func:`train_in_process`).
LENGTH_REWARD_OVERRIDE = "rewards=" + json.dumps(LENGTH_REWARD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(threads: int = 1) -> dict[str, str]:
    """Environment of a recipe subprocess: the test components importable (as ``components``,
    ``crash_helpers``, ... and as ``tests.recipes.*``), and this checkout's ``torchtune_grpo``
    ahead of any installed one."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchtune._cli.tune", *args]


def launch(nproc: int, recipe: str = "grpo_full_finetune_distributed") -> list[str]:
    """``run [--nproc_per_node N] RECIPE``: the ``tune`` arguments before the config."""
    return ["run"] + (["--nproc_per_node", str(nproc)] if nproc > 1 else []) + [recipe]


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


def expect_killed(args: list[str], cwd: Path, threads: int = 1) -> None:
    """Run ``tune ARGS``, which a test component kills: it must not exit 0."""
    proc = subprocess.run(tune_cmd(*args), cwd=cwd, env=recipe_env(threads), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0, "the run was supposed to be killed"


def run_overrides(base: Path, out: Path, *extra: str) -> list[str]:
    """``key=value`` overrides of a test run: the model in ``base``, the outputs in ``out``, no
    progress bar, evaluation off unless ``extra`` turns it back on (later overrides win)."""
    return [f"model_dir={base}", f"output_dir={out}", "progress_bar=false",
            "eval_every_n_steps=null", "eval_at_start=false", *extra]


def quickstart_overrides(base: Path, out: Path, *extra: str) -> list[str]:
    """The ``tune run`` arguments after the recipe: ``--config grpo/quickstart_cpu`` and
    :func:`run_overrides`."""
    return ["--config", QUICKSTART, *run_overrides(base, out, *extra)]


def quickstart_config(base: Path, out: Path, *extra: str, config: str = QUICKSTART):
    """``config`` (default ``grpo/quickstart_cpu``) with :func:`run_overrides`, loaded here."""
    from torchtune_grpo.config.loading import load_config

    return load_config(config, run_overrides(base, out, *extra))


def train_in_process(base: Path, out: Path, *overrides: str, rewards=None, config=QUICKSTART):
    """Run the recipe in this process (no torchrun, no FSDP) and return it; its metrics are
    in ``metrics(out)``."""
    from torchtune_grpo.training.recipe import GRPORecipe

    cfg = quickstart_config(base, out, *overrides, config=config)
    if rewards is not None:
        cfg.rewards = rewards
    return run_in_process(GRPORecipe(cfg))


def run_in_process(recipe):
    """Set up and train ``recipe``; clean up (lock, loggers, process group) even on failure."""
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    return recipe


def metrics(out: Path) -> list[dict[str, float]]:
    """Every logged step of the run in ``out`` (its DiskLogger files), in order."""
    return read_disk_log(out / "logs")


def train_metrics(out: Path) -> list[dict[str, float]]:
    """The training steps' rows of :func:`metrics` (those of an evaluation-only step left out)."""
    return [row for row in metrics(out) if "grad_norm" in row]


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights (HF names) of a model folder, a step folder or a safetensors file;
    adapter files are left out (a LoRA step folder also holds the merged model)."""
    files = sorted(path.glob("model*.safetensors")) if path.is_dir() else [path]
    assert files, f"no model*.safetensors in {path}"
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def assert_same_weights(step_a: Path, step_b: Path) -> None:
    """Every safetensors file (model, adapters) of two step folders is bitwise the same."""
    names = sorted(p.name for p in step_a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in step_b.glob("*.safetensors"))
    for name in names:
        a, b = load_file(str(step_a / name)), load_file(str(step_b / name))
        assert a.keys() == b.keys(), name
        for key in a:
            assert a[key].equal(b[key]), (name, key)


def assert_same_metrics(out_a: Path, out_b: Path, steps: list[int]) -> None:
    """Two runs logged the same value of every metric at ``steps`` (timings left out)."""
    a = {int(r["step"]): r for r in metrics(out_a)}
    b = {int(r["step"]): r for r in metrics(out_b)}
    for step in steps:
        keys = {k for k in a[step] if not k.startswith(TIMING)}
        assert keys == {k for k in b[step] if not k.startswith(TIMING)}
        for key in keys:
            assert a[step][key] == b[step][key], (step, key)


def assert_not_degenerate(*runs: Path | list[dict[str, float]], steps: list[int] | None = None,
                          weights: tuple[Path, ...] = ()) -> list[list[str]]:
    """Check that runs a test compares could have come out different.

    Two runs whose rewards are equal within every group have all advantages 0, no gradient and
    unchanged weights: they agree whether or not the code under test works. So at each of
    ``steps`` of each run, the rewards must vary within some group (``reward/std > 0``,
    ``zero_std_group_fraction < 1``) and the gradient must be non-zero; and the model weights
    must change from each of ``weights`` to the next.

    Args:
        runs: output folders (their metric logs are read) or rows of :func:`metrics`.
        steps: training steps to check; default every logged training step.
        weights: model or step folders (or safetensors files) in training order, e.g. the base
            model, ``step_2``, ``step_4``.

    Returns:
        For each consecutive pair of ``weights``, the names of the weights that changed.
    """
    assert runs or weights, "nothing to check"
    for run in runs:
        rows = metrics(run) if isinstance(run, Path) else run
        logged = {int(r["step"]): r for r in rows if "grad_norm" in r}
        for step in sorted(logged) if steps is None else steps:
            row = logged[step]
            assert row["reward/std"] > 0 and row["zero_std_group_fraction"] < 1, (
                f"step {step}: equal rewards in every group, nothing to learn: {row}")
            assert row["grad_norm"] > 0, f"step {step}: zero gradient: {row}"
    moved = []
    for before, after in zip(weights, weights[1:]):
        a, b = model_weights(before), model_weights(after)
        assert a.keys() == b.keys(), (before, after)
        moved.append([k for k in a if not torch.equal(a[k], b[k])])
        assert moved[-1], f"no weight changed from {before} to {after}"
    return moved
