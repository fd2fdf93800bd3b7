"""Time to accuracy, side by side: our recipe and TRL's GRPOTrainer on rung (a) of the ladder.

Task (a) of ``docs/smollm2_ladder.md`` (``grpo/smollm2_arithmetic_cpu``): SmolLM2-135M-Instruct
answers "What is 47 + 38? Reply with the result only." in its own chat template; the reward is
correctness of the last number of the reply; held-out: greedy accuracy on the ``test`` split of
:func:`~torchtune_grpo.datasets.arithmetic_problems` (480 problems, or a subset balanced across
the three operations with ``--eval-problems``), up to the config's ``eval.max_generated_tokens``
(96) new tokens.

Both sides train from the same model folder, **one after the other** on this machine, with the
same threads, for the same budget of **training wall seconds** (``--budget-s``; the clock
excludes setup and pauses during every held-out evaluation), and are evaluated on the same
held-out prompts before the first step, at the end of the first step after every
``--eval-every-s`` seconds of training, and after the last step (the one that spent the budget).

1. **Ours** (a worker subprocess): ``GRPORecipe`` on the shipped config, through the
   ``BudgetedRecipe`` of :mod:`benchmarks.ablate` (``--clock wall``), its held-out evaluations
   through the recipe's own evaluation part (``TrainingEvaluation.run``). It
   also writes ``spec.json``, the peer's input, from its config and its recipe: the prompts of
   every step in the order our recipe draws them (token ids, the chat template applied), the
   held-out prompts, the stop ids, and the training shape (prompts and completions per step,
   micro-batch, new tokens, temperature, learning rate, weight decay, clipping, epsilons).
   Checkpoints are not written.
2. **TRL** (``benchmarks/peers/trl_time_to_accuracy.py`` with ``--peer-python``, TRL's venv made
   by ``bash benchmarks/peers/setup_trl.sh``): ``GRPOTrainer`` on the same prompts in the same
   order, the same shape, ``beta=0``, ``loss_type="dapo"`` (token mean, as our
   ``token_mean``), fp32, no gradient checkpointing, AdamW (fused, as ours); its held-out
   evaluation is HF ``generate``, greedy, in batches of the config's ``eval.forward_batch_size``.

**Same weights, same accuracy.** Both sides score with the same code: the spec names our
``torchtune_grpo/rewards/answers.py`` (standard library only), which the peer loads by path (its
``parse_number`` / ``numbers_match`` are what ``NumericCorrectness(answer_tag=None)`` uses).
Both evaluate the base model first; the summary records both accuracies, the problems on which
they disagree and how many completions are identical (``evaluator_check``).

**Outputs** (``--out``): ``spec.json``, ``ours.json`` and ``trl.json`` (the points: step,
training seconds, generated tokens, held-out accuracy; rewritten after every evaluation, so a
killed run keeps its points; ``"complete": true`` at the end), ``time_to_accuracy.png`` (held-out
accuracy against training seconds, both curves, the target as a horizontal line),
``summary.json`` and ``summary.md`` (seconds, steps and generated tokens to reach ``--target``
for each side, and TRL's seconds over ours; "not reached" where a side never does). A side whose
result file is complete and was made with the same settings is not run again (``--fresh``
reruns it).

The summary also gives each side's seconds to 0.2, 0.3, 0.4 and 0.5 (:data:`MILESTONES`), and
``--plots-only --target T`` redoes the plot and summary for another target without training.
(At the end of the budget our recipe logs "stopped after step N on request; saved ...": the
budget stops it the way SIGTERM does; no checkpoint is written here.)

Commands (the machine to itself; ``--threads`` as for the other benchmarks)::

    bash benchmarks/peers/setup_trl.sh                     # once: .venv-trl
    python benchmarks/time_to_accuracy.py --threads 2 --budget-s 1800 --eval-every-s 180 \\
        --eval-problems 480 --out /tmp/tta                 # the comparison: ~85 min on 2 cores
    python benchmarks/time_to_accuracy.py --quick --threads 1 --out /tmp/tta_quick   # ~7 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: python benchmarks/time_to_accuracy.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from benchmarks.harness import REPO, PeerUnavailable  # noqa: E402

#: The shipped config of task (a).
CONFIG = "grpo/smollm2_arithmetic_cpu"
PEER_SCRIPT = REPO / "benchmarks" / "peers" / "trl_time_to_accuracy.py"
PEER_SETUP = "bash benchmarks/peers/setup_trl.sh"
#: The scoring rule both sides use (standard library only; the peer loads it by path).
SCORING_MODULE = REPO / "torchtune_grpo" / "rewards" / "answers.py"
#: Held-out problems of each operation in the ``test`` split.
TEST_PER_OPERATION = 160
#: The sides, in the order they run.
SIDES = ("ours", "trl")
LABELS = {"ours": "torchtune-grpo (ours)", "trl": "TRL GRPOTrainer"}
#: Accuracies the summary also gives the time to (besides ``--target``): where the target is
#: not reached, the curves can still be compared on the way up.
MILESTONES = (0.2, 0.3, 0.4, 0.5)
#: ``--quick``: the smoke run's budget, interval and held-out subset (unless given).
QUICK = {"budget_s": 60.0, "eval_every_s": 20.0, "eval_problems": 30}
DEFAULTS = {"budget_s": 1800.0, "eval_every_s": 180.0, "eval_problems": 480}


# ---------------------------------------------------------------------------- held-out set
def heldout_problems(problems: int | None = None) -> list[tuple[int, str, str]]:
    """The held-out problems as ``(index in the test split, question, answer)``.

    Args:
        problems: how many (``None``: all 480). A subset takes the first problems of each
            operation's block of the ``test`` split (each block is already a fixed random
            draw), as evenly as possible: ``30`` is 10 additions, 10 subtractions and 10
            multiplications; a remainder goes to addition, then subtraction.

    Raises:
        ValueError: ``problems`` is not between 1 and 480.
    """
    from torchtune_grpo.datasets import arithmetic_problems

    test = arithmetic_problems("test")
    blocks = len(test) // TEST_PER_OPERATION
    if problems is None:
        problems = len(test)
    if isinstance(problems, bool) or not isinstance(problems, int) or not (
            1 <= problems <= len(test)):
        raise ValueError(f"eval problems must be an integer from 1 to {len(test)}, "
                         f"got {problems!r}")
    out = []
    for b in range(blocks):
        take = problems // blocks + (1 if b < problems % blocks else 0)
        start = b * TEST_PER_OPERATION
        out.extend((i, *test[i]) for i in range(start, start + take))
    return out


def heldout_dataset(tokenizer: Any, *, problems: int | None = None, template: Any = None):
    """:func:`heldout_problems` as a :class:`~torchtune_grpo.datasets.PromptDataset` (the
    ``eval_dataset`` component of our side; each row's ``index`` is its position in the
    480-problem ``test`` split).

    Args:
        tokenizer: the model's tokenizer.
        problems: as :func:`heldout_problems`.
        template: the prompt template (``None``: ``ARITHMETIC_TEMPLATE``, as the config).
    """
    from torchtune_grpo.datasets import ARITHMETIC_TEMPLATE
    from torchtune_grpo.datasets._prompt import PromptDataset

    samples = [(q, a, i) for i, q, a in heldout_problems(problems)]
    return PromptDataset(samples, tokenizer, ARITHMETIC_TEMPLATE if template is None
                         else template, name="arithmetic[test]")


# ---------------------------------------------------------------------------- config and spec
def our_config(model_dir: Path, output_dir: Path, eval_problems: int,
               overrides: Sequence[str] = ()):
    """The shipped config with this benchmark's changes: no step-count schedule (the budget
    stops the run), no step evaluations or checkpoints, and the held-out subset as
    ``eval_dataset``; then ``overrides`` (smoke tests)."""
    from omegaconf import OmegaConf

    from torchtune_grpo.config.loading import load_config

    cfg = load_config(CONFIG, [
        f"model_dir={model_dir}", f"output_dir={output_dir}", "num_steps=1000000",
        "eval_every_n_steps=null", "eval_at_start=false", "save_every_n_steps=null",
        "progress_bar=false", *overrides,
    ])
    cfg.eval_dataset = OmegaConf.create({
        "_component_": "benchmarks.time_to_accuracy.heldout_dataset",
        "problems": int(eval_problems),
        "template": "torchtune_grpo.datasets.ARITHMETIC_TEMPLATE",
    })
    return cfg


def shape_from_config(cfg) -> dict[str, Any]:
    """The training and evaluation settings the peer must copy, read from our merged config.

    Raises:
        ValueError: the config uses something the peer cannot reproduce (a KL term, another
            aggregation than ``token_mean``, ``ppo_epochs`` other than 1, top-k sampling,
            sampled evaluation, a micro-batch that does not divide the step, a learning-rate
            schedule).
    """
    problems = []
    loss = cfg.loss
    if float(loss.get("kl_coeff", 0.0) or 0.0) != 0.0:
        problems.append(f"loss.kl_coeff={loss.kl_coeff} (the peer runs beta=0)")
    if loss.get("aggregation", "token_mean") != "token_mean":
        problems.append(f"loss.aggregation={loss.aggregation} (the peer runs DAPO's token mean)")
    if int(cfg.get("ppo_epochs", 1)) != 1:
        problems.append(f"ppo_epochs={cfg.ppo_epochs} (the peer runs num_iterations=1)")
    if cfg.get("top_k") is not None:
        problems.append(f"top_k={cfg.top_k}")
    if cfg.get("lr_scheduler") is not None:
        problems.append("an lr_scheduler (the peer runs a constant learning rate)")
    ev = cfg.eval
    if float(ev.get("temperature", 0.0)) != 0.0 or int(ev.get("num_samples", 1)) != 1:
        problems.append("a sampled evaluation (the comparison is greedy pass@1)")
    batch, group = int(cfg.batch_size), int(cfg.group_size)
    micro = int(cfg.forward_batch_size or batch * group)
    if (batch * group) % micro:
        problems.append(f"forward_batch_size={micro} does not divide {batch} x {group}")
    if problems:
        raise ValueError("time_to_accuracy: the peer cannot copy " + "; ".join(problems))
    return {
        "batch_size": batch, "group_size": group, "micro_batch_size": micro,
        "new_tokens": int(cfg.max_generated_tokens), "temperature": float(cfg.temperature),
        "learning_rate": float(cfg.optimizer.lr),
        "weight_decay": float(cfg.optimizer.get("weight_decay", 0.0)),
        "max_grad_norm": float(cfg.clip_grad_norm),
        "epsilon_low": float(loss.epsilon_low), "epsilon_high": float(loss.epsilon_high),
        "eval_new_tokens": int(ev.get("max_generated_tokens") or cfg.max_generated_tokens),
        "eval_batch_size": int(ev.get("forward_batch_size") or micro),
        "seed": int(cfg.seed),
    }


def spec_steps(budget_s: float) -> int:
    """Steps of prompts the spec lists: one per second of budget (at least 64); a step of this
    task takes many seconds, so the peer does not run out (it records ``prompts_exhausted``
    if it does)."""
    return max(64, math.ceil(budget_s))


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a result file must have been made with to be reused."""
    return {"config": CONFIG, "model_dir": str(args.model_dir), "budget_s": args.budget_s,
            "eval_every_s": args.eval_every_s, "eval_problems": args.eval_problems,
            "threads": args.threads, "overrides": list(args.override)}


def _bits(flags: Sequence[bool]) -> str:
    return "".join("1" if f else "0" for f in flags)


# ---------------------------------------------------------------------------- our side
def run_ours_worker(args: argparse.Namespace, spec_only: bool = False) -> None:
    """Our side, in this process: write ``spec.json``, then (unless ``spec_only``) train for
    the budget and write ``ours.json`` after every evaluation."""
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks import ablate

    out: Path = args.out
    result_path = out / "ours.json"
    t_start = time.perf_counter()
    cfg = our_config(args.model_dir, out / "ours_run", args.eval_problems, args.override)
    shape = shape_from_config(cfg)
    result: dict[str, Any] = {"name": "ours", "complete": False, "settings": settings_of(args),
                              "threads": torch.get_num_threads(), "torch_version":
                              torch.__version__, "points": [],
                              "load_average_start": os.getloadavg()}

    class Recipe(ablate._budgeted_recipe_class()):
        """:mod:`benchmarks.ablate`'s ``BudgetedRecipe`` that records every evaluation in
        ``ours.json`` and writes no checkpoints."""

        def run_eval(self):
            """The recipe's evaluation, its result kept for :meth:`evaluate_now`."""
            self.last_eval = super().run_eval()
            return self.last_eval

        def evaluate_now(self):
            """Evaluate (clock paused), then rewrite ``ours.json`` with the new point."""
            point = super().evaluate_now()
            rows = self.last_eval.samples
            row = {"step": point.step, "train_seconds": point.train_seconds,
                   "cpu_seconds": point.cpu_seconds, "generated_tokens": point.generated_tokens,
                   "heldout_accuracy": point.heldout_success,
                   "correct": _bits(r["correct"][0] for r in rows),
                   "reward_mean": point.reward_mean, "eval_seconds": point.eval_seconds}
            if point.step == 0:
                row["completions"] = [r["completions"][0] for r in rows]
                result["heldout_indices"] = [int(r["index"]) for r in rows]
            result["points"].append(row)
            from torchtune_grpo.backends.memory import peak_rss_bytes

            result["peak_memory_bytes"] = peak_rss_bytes()
            harness.write_json(result_path, result)
            print(f"[ours] step {point.step}: {point.train_seconds:.1f} train s, held-out "
                  f"{point.heldout_success:.3f} ({point.eval_seconds:.1f} s to evaluate)",
                  flush=True)
            return point

        def save_checkpoint(self, evaluated=None) -> None:
            """No checkpoints in this benchmark (the budget's stop would write one)."""

    recipe = Recipe(cfg, budget_s=args.budget_s, eval_every_s=args.eval_every_s, clock="wall")
    try:
        recipe.setup()
        heldout = [recipe.eval_dataset[i] for i in range(len(recipe.eval_dataset))]
        spec = {
            **shape, "model_dir": str(args.model_dir), "threads": args.threads,
            "budget_s": args.budget_s, "eval_every_s": args.eval_every_s,
            "output_dir": str(out / "trl_run"), "settings": settings_of(args),
            "stop_token_ids": [int(t) for t in recipe.stop_tokens],
            "pad_id": int(recipe.pad_id),
            "scoring": {"rule": "last_number", "module_file": str(SCORING_MODULE),
                        "rel_tol": 1e-6},
            "heldout": {"tokens": [h["tokens"] for h in heldout],
                        "answers": [str(h["answer"]) for h in heldout],
                        "indices": [int(h["index"]) for h in heldout]},
            "prompts_per_step": [harness.batch_prompts(recipe.batches.batch(s))
                                 for s in range(spec_steps(args.budget_s))],
        }
        harness.write_json(out / "spec.json", spec)
        if spec_only:
            return
        result["setup_seconds"] = time.perf_counter() - t_start
        recipe.run_budget()
    finally:
        recipe.cleanup()
    result.update({"complete": True, "steps": recipe.step,
                   "end_train_seconds": recipe.train_seconds,
                   "total_wall_seconds": time.perf_counter() - t_start,
                   "load_average_end": os.getloadavg()})
    harness.write_json(result_path, result)


def _worker_cmd(args: argparse.Namespace, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.time_to_accuracy", "--worker", mode,
           "--out", str(args.out), "--model-dir", str(args.model_dir),
           "--budget-s", str(args.budget_s), "--eval-every-s", str(args.eval_every_s),
           "--eval-problems", str(args.eval_problems), "--threads", str(args.threads)]
    for item in args.override:
        cmd += ["--override", item]
    return cmd


def _run(cmd: Sequence[str | Path], threads: int, what: str) -> None:
    """Run a side's subprocess (this checkout importable, ``threads`` OpenMP threads)."""
    env = harness.subprocess_env(REPO, OMP_NUM_THREADS=threads, PYTHONUNBUFFERED=1,
                                 TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}: {' '.join(map(str, cmd))}")


def probe_peer(python: Path) -> str:
    """TRL's version in ``python``'s environment, or raise :class:`PeerUnavailable`."""
    from benchmarks.real_step import probe_peer as probe

    return probe(python)


def load_result(path: Path) -> dict[str, Any] | None:
    """A side's result file, or ``None`` when it does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


def reusable(result: dict[str, Any] | None, settings: dict[str, Any]) -> bool:
    """Whether a side's result is complete and was made with ``settings``."""
    return bool(result and result.get("complete") and result.get("settings") == settings)


# ---------------------------------------------------------------------------- summary
def time_to_target(points: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation at or above ``target``: its training seconds, step and generated
    tokens (``None``: never reached). Evaluations are discrete, so the seconds are an upper
    bound on when the policy first got there (at most one interval late)."""
    for p in points:
        if p["heldout_accuracy"] >= target:
            return {"seconds": p["train_seconds"], "step": p["step"],
                    "generated_tokens": p["generated_tokens"],
                    "accuracy": p["heldout_accuracy"]}
    return None


def milestones(ours: Sequence[dict[str, Any]], trl: Sequence[dict[str, Any]],
               levels: Sequence[float]) -> list[dict[str, Any]]:
    """For each accuracy in ``levels``: each side's training seconds and steps to reach it
    (``None``: not reached) and TRL's seconds over ours where both did."""
    rows = []
    for level in levels:
        o, t = time_to_target(ours, level), time_to_target(trl, level)
        rows.append({"accuracy": level, "ours_seconds": o and o["seconds"],
                     "trl_seconds": t and t["seconds"], "ours_step": o and o["step"],
                     "trl_step": t and t["step"],
                     "trl_over_ours": t["seconds"] / max(o["seconds"], 1e-9) if o and t
                     else None})
    return rows


def evaluator_check(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Both sides' evaluation of the base model (the same weights): accuracies, problems
    scored differently, identical completions."""
    a, b = ours["points"][0], trl["points"][0]
    differ = [i for i, (x, y) in enumerate(zip(a["correct"], b["correct"], strict=True))
              if x != y]
    same_text = sum(x == y for x, y in zip(a.get("completions", []), b.get("completions", [])))
    return {"ours_base_accuracy": a["heldout_accuracy"],
            "trl_base_accuracy": b["heldout_accuracy"],
            "same_accuracy": a["heldout_accuracy"] == b["heldout_accuracy"],
            "problems": len(a["correct"]), "problems_scored_differently": len(differ),
            "identical_completions": same_text,
            "same_prompts": ours.get("heldout_indices") == trl.get("heldout_indices")}


def side_summary(result: dict[str, Any], target: float) -> dict[str, Any]:
    """One side's row of the summary."""
    points = result["points"]
    last = points[-1]
    steps = max(last["step"], 1)
    return {"complete": bool(result.get("complete")), "steps": last["step"],
            "train_seconds": last["train_seconds"],
            "seconds_per_step": last["train_seconds"] / steps,
            "generated_tokens": last["generated_tokens"],
            "base_accuracy": points[0]["heldout_accuracy"],
            "final_accuracy": last["heldout_accuracy"],
            "best_accuracy": max(p["heldout_accuracy"] for p in points),
            "evaluations": len(points), "peak_memory_bytes": result.get("peak_memory_bytes"),
            "to_target": time_to_target(points, target)}


def summarize(results: dict[str, dict[str, Any]], target: float, args_settings: dict[str, Any],
              command: str) -> dict[str, Any]:
    """The comparison: per side (:func:`side_summary`), the ratio of TRL's seconds to the
    target over ours, whether ours is at least 2x sooner, and the evaluator check."""
    sides = {k: side_summary(v, target) for k, v in results.items() if v and v.get("points")}
    out: dict[str, Any] = {"command": command, "date": harness.utc_now(), "target": target,
                           "settings": args_settings, "sides": sides}
    ours, trl = sides.get("ours"), sides.get("trl")
    if ours and trl:
        o, t = ours["to_target"], trl["to_target"]
        if o and t:
            out["trl_over_ours"] = t["seconds"] / max(o["seconds"], 1e-9)
            out["verdict"] = (f"ours reached {target:g} {out['trl_over_ours']:.2f}x sooner"
                              if out["trl_over_ours"] >= 1 else
                              f"TRL reached {target:g} {1 / out['trl_over_ours']:.2f}x sooner")
        elif o:
            out["trl_over_ours"] = None
            out["verdict"] = (f"only ours reached {target:g} (TRL not within "
                              f"{trl['train_seconds']:.0f} s)")
        elif t:
            out["trl_over_ours"] = None
            out["verdict"] = (f"only TRL reached {target:g} (ours not within "
                              f"{ours['train_seconds']:.0f} s)")
        else:
            out["trl_over_ours"] = None
            out["verdict"] = f"neither side reached {target:g}"
        out["goal_2x_met"] = bool(o and (not t or t["seconds"] >= 2 * o["seconds"]))
        out["milestones"] = milestones(results["ours"]["points"], results["trl"]["points"],
                                       sorted({*MILESTONES, target}))
        out["evaluator_check"] = evaluator_check(results["ours"], results["trl"])
        out["trl"] = {k: results["trl"].get(k) for k in (
            "trl_version", "transformers_version", "prompt_ids_match", "prompt_order_match",
            "prompts_exhausted")}
    return out


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table with the verdict and the evaluator check."""
    target = summary["target"]
    lines = [f"Held-out greedy accuracy, target {target:g} "
             f"({summary['settings']['eval_problems']} held-out problems, "
             f"{summary['settings']['threads']} thread(s), budget "
             f"{summary['settings']['budget_s']:g} training s per side), {summary['date']}",
             "",
             f"| side | steps | training s | s / step | base | final | best | s to {target:g} "
             f"| steps to {target:g} | tokens to {target:g} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in summary["sides"].items():
        hit = row["to_target"]
        reach = ((f"{hit['seconds']:.0f}", str(hit["step"]), f"{hit['generated_tokens']:.0f}")
                 if hit else ("not reached",) * 3)
        flag = "" if row["complete"] else " (incomplete)"
        lines.append(f"| {LABELS.get(key, key)}{flag} | {row['steps']} | "
                     f"{row['train_seconds']:.0f} | {row['seconds_per_step']:.1f} | "
                     f"{row['base_accuracy']:.3f} | {row['final_accuracy']:.3f} | "
                     f"{row['best_accuracy']:.3f} | " + " | ".join(reach) + " |")
    if "verdict" in summary:
        ratio = summary.get("trl_over_ours")
        lines += ["", f"**{summary['verdict']}**"
                  + (f" (TRL's seconds / ours = {ratio:.2f}; goal: >= 2)" if ratio else "")
                  + f"; goal met: {'yes' if summary['goal_2x_met'] else 'no'}."]
        lines += ["", "| held-out accuracy | ours: training s (step) | TRL: training s (step) "
                  "| TRL / ours |", "|---|---|---|---|"]
        for m in summary["milestones"]:
            cells = [f"{m[k]:.0f} ({m.get(k.replace('seconds', 'step'))})" if m[k] is not None
                     else "not reached" for k in ("ours_seconds", "trl_seconds")]
            ratio = f"{m['trl_over_ours']:.2f}" if m["trl_over_ours"] is not None else "-"
            lines.append(f"| {m['accuracy']:g} | {cells[0]} | {cells[1]} | {ratio} |")
        c = summary["evaluator_check"]
        lines += ["", f"Evaluator check on the base model (same weights): ours "
                  f"{c['ours_base_accuracy']:.3f}, TRL's {c['trl_base_accuracy']:.3f}; "
                  f"{c['problems_scored_differently']} of {c['problems']} problems scored "
                  f"differently, {c['identical_completions']} identical completions."]
    lines += ["", f"Command: `{summary['command']}`"]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, Any]], target: float, path: Path,
         title: str) -> Path:
    """Held-out accuracy against training seconds for each side, the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in SIDES:
        res = results.get(key)
        if not res or not res.get("points"):
            continue
        xs = [p["train_seconds"] for p in res["points"]]
        ys = [p["heldout_accuracy"] for p in res["points"]]
        label = LABELS[key] + ("" if res.get("complete") else " (incomplete)")
        line, = ax.plot(xs, ys, marker="o", label=label)
        hit = time_to_target(res["points"], target)
        if hit:
            ax.axvline(hit["seconds"], color=line.get_color(), linestyle=":", alpha=0.7)
            ax.annotate(f"{hit['seconds']:.0f} s", (hit["seconds"], target),
                        textcoords="offset points", xytext=(4, 6), color=line.get_color())
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target:g}")
    ax.set_xlabel("training wall seconds (evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def run_sides(args: argparse.Namespace, todo: Sequence[str], paths: dict[str, Path],
              settings: dict[str, Any], trl_version: str | None) -> None:
    """Run the sides in ``todo``, one after the other (a stale result is removed first).

    Raises:
        RuntimeError: a side's subprocess failed.
    """
    for side in todo:
        if paths[side].exists():
            paths[side].unlink()  # a stale or partial result is not mixed with the new one
        t0 = time.perf_counter()
        if side == "ours":
            print(f"ours: GRPORecipe, {args.budget_s:g} training s ...", flush=True)
            _run(_worker_cmd(args, "ours"), args.threads, "our side")
        else:
            spec = load_result(args.out / "spec.json")
            if not spec or spec.get("settings") != settings:
                print("writing spec.json from our config ...", flush=True)
                _run(_worker_cmd(args, "spec"), args.threads, "the spec")
            print(f"trl: GRPOTrainer (TRL {trl_version}), {args.budget_s:g} training s ...",
                  flush=True)
            _run([args.peer_python, PEER_SCRIPT, "--spec", args.out / "spec.json",
                  "--out", paths[side]], args.threads, "the TRL peer")
        print(f"{side}: done in {time.perf_counter() - t0:.0f} s wall", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); fills the ``--quick`` / default values."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"training wall seconds per side (default {DEFAULTS['budget_s']:g}; "
                        f"--quick: {QUICK['budget_s']:g})")
    parser.add_argument("--eval-every-s", type=float, default=None,
                        help="training seconds between held-out evaluations (default "
                        f"{DEFAULTS['eval_every_s']:g}; --quick: {QUICK['eval_every_s']:g})")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help="held-out problems, balanced across the three operations (default "
                        f"all {DEFAULTS['eval_problems']}; --quick: {QUICK['eval_problems']})")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads, "
                        "both sides")
    parser.add_argument("--target", type=float, default=0.6, help="held-out accuracy to reach")
    parser.add_argument("--out", type=Path, default=Path("/tmp/tune_grpo_time_to_accuracy"))
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("SMOLLM2_DIR", harness.SMOLLM2_DIR)),
                        help="HF folder of SmolLM2-135M-Instruct (env SMOLLM2_DIR)")
    parser.add_argument("--peer-python", type=Path,
                        default=Path(os.environ.get("TRL_PYTHON", REPO / ".venv-trl/bin/python")),
                        help="Python of the TRL venv (env TRL_PYTHON)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                        help="which sides to run (the summary uses every result present)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 60 s per side, an evaluation every 20 s, 30 problems")
    parser.add_argument("--fresh", action="store_true",
                        help="rerun a side even when its complete result is in --out")
    parser.add_argument("--plots-only", action="store_true",
                        help="only redo the plot and summary from the result files in --out")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both sides (smoke tests; the comparison "
                        "uses the shipped config)")
    parser.add_argument("--worker", choices=("ours", "spec"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key in ("budget_s", "eval_every_s", "eval_problems"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if not args.budget_s > 0 or not args.eval_every_s > 0:
        parser.error("--budget-s and --eval-every-s must be positive")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if not 0 < args.target <= 1:
        parser.error(f"--target must be an accuracy in (0, 1], got {args.target}")
    try:
        heldout_problems(args.eval_problems)
    except ValueError as e:
        parser.error(str(e))
    args.out = args.out.resolve()
    args.model_dir = args.model_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sides that are not done yet, one after the other; plot and summarize."""
    args = parse_args(argv)
    if args.worker:
        run_ours_worker(args, spec_only=args.worker == "spec")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    settings = settings_of(args)
    paths = {side: args.out / f"{side}.json" for side in SIDES}
    command = harness.run_metadata("time_to_accuracy", argv)["command"]
    if not args.plots_only:
        if harness.smollm2_missing(args.model_dir):
            return 2
        todo = [s for s in args.sides
                if args.fresh or not reusable(load_result(paths[s]), settings)]
        for side in set(args.sides) - set(todo):
            print(f"{side}: complete result with these settings in {paths[side]}; not rerun "
                  "(--fresh reruns it)")
        trl_version = None
        if "trl" in todo:
            try:
                trl_version = probe_peer(args.peer_python)
            except PeerUnavailable as e:
                print(f"error: {e}\n(or run only our side: --sides ours)", file=sys.stderr)
                return 2
        try:
            run_sides(args, todo, paths, settings, trl_version)
        except RuntimeError as e:
            print(f"error: {e}\n(the finished sides' results are kept in {args.out}; the same "
                  "command resumes)", file=sys.stderr)
            return 1
    results = {s: load_result(p) for s, p in paths.items()}
    results = {s: r for s, r in results.items() if r and r.get("points")}
    if not results:
        print(f"error: no result in {args.out}", file=sys.stderr)
        return 2
    if args.plots_only:  # the settings and command the results were made with
        settings = next((r["settings"] for r in results.values() if r.get("settings")),
                        settings)
        command = (load_result(args.out / "summary.json") or {}).get("command", command)
    summary = summarize(results, args.target, settings, command)
    harness.write_json(args.out / "summary.json", summary)
    table = summary_markdown(summary)
    (args.out / "summary.md").write_text(table)
    title = (f"SmolLM2-135M-Instruct, arithmetic (rung a): {settings['eval_problems']} "
             f"held-out problems, {settings['threads']} thread(s)")
    png = plot(results, args.target, args.out / "time_to_accuracy.png", title)
    print(table)
    print(f"wrote {args.out / 'summary.json'}, {args.out / 'summary.md'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
