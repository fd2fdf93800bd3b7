"""Rollout time on 2 FSDP2 processes with the weights gathered once vs. once per decode step.

Under FSDP2 with ``fsdp_reshard_after_forward: true`` every forward all-gathers each layer and
frees it after, and the rollout runs one forward per decode step. With
``rollout_gather_weights: true`` (the default) the recipe gathers the policy once per rollout
(:func:`torchtune_grpo.distributed.gathered_for_inference`). This script runs the real
recipe, ``tune run --nproc_per_node 2 grpo_full_finetune_distributed`` on CPU (gloo), four
times per model in one invocation, ``rollout_gather_weights`` false (before), true (after),
true, false (so that a drifting load on a shared machine hits both alike), and reads
``time/generation`` (rank 0's rollout seconds, summed over the steps) from the metric log; the
mean of each variant's two runs is reported:

* ``quickstart``: the tiny ``grpo/quickstart_cpu`` model (2 layers, 0.1M parameters), written
  by :func:`torchtune_grpo.quickstart.prepare.prepare_quickstart` into a temporary folder;
* ``smollm2``: SmolLM2-135M-Instruct (30 layers) with ``grpo/smollm2_gsm8k_cpu``, when the
  folder of ``tune-grpo prepare-model smollm2`` exists (``--smollm2-dir``), on a few
  GSM8K-style problems written here (no data set download), evaluation off.

Both runs of a model must sample the same completions (checked: ``reward/mean``,
``response_length/mean`` and ``loss`` are equal), so the ratio ``before / after`` is the cost
of gathering per decode step. Absolute seconds depend on the machine's load (each process
gets ``--threads`` torch threads); only the ratio of one invocation means something.

Usage::

    python benchmarks/rollout_gather.py                       # both models, ~6 min on 2 cores
    python benchmarks/rollout_gather.py --quick               # quickstart model only, ~1 min
    python benchmarks/rollout_gather.py --out rollout_gather.json

Exit status 1 if a pair of runs sampled different completions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/rollout_gather.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

#: GSM8K-style problems (question, answer) so that the SmolLM2 run needs no data set.
PROBLEMS = [
    ("Tom has 3 apples and buys 5 more. How many apples does he have now?", "8"),
    ("A box holds 12 pens. How many pens are in 4 boxes?", "48"),
    ("Sara had 20 dollars and spent 7 dollars on lunch. How much money is left?", "13"),
    ("A train travels 60 km each hour. How far does it go in 3 hours?", "180"),
]
#: Metrics that must agree between the two runs of a model (same samples, same update).
SAME = ("reward/mean", "response_length/mean", "loss")


def _run(config: str, overrides: list[str], out: Path, threads: int) -> dict[str, float]:
    """One ``tune run --nproc_per_node 2`` of ``config``; returns its last training row and
    the wall seconds of the whole command (``wall``)."""
    args = ["run", "--nproc_per_node", "2", "grpo_full_finetune_distributed", "--config", config,
            f"output_dir={out}", "progress_bar=false", "eval_every_n_steps=null",
            "eval_at_start=false", *overrides]
    wall = harness.timed(lambda: harness.tune_run(args, cwd=out.parent, threads=threads,
                                                  timeout=900))
    rows = harness.training_rows(out)
    total = {k: sum(r[k] for r in rows) for k in ("time/generation", "time/update")}
    return {**rows[-1], **total, "wall": wall}


def compare(name: str, config: str, overrides: list[str], work: Path,
            threads: int) -> dict[str, float | str | bool]:
    """Run ``config`` with the gather off, on, on, off; returns the mean times of each
    variant, the ratio and whether all runs agree."""
    runs: dict[str, list[dict[str, float]]] = {"false": [], "true": []}
    for i, gather in enumerate(("false", "true", "true", "false")):
        out = work / f"{name}_{i}_gather_{gather}"
        row = _run(config, [*overrides, f"rollout_gather_weights={gather}"], out, threads)
        runs[gather].append(row)
        print(f"  {name} rollout_gather_weights={gather}: time/generation "
              f"{row['time/generation']:.2f} s, time/update {row['time/update']:.2f} s, "
              f"command {row['wall']:.0f} s", flush=True)

    def mean(gather: str, key: str) -> float:
        return sum(r[key] for r in runs[gather]) / len(runs[gather])

    first = runs["true"][0]
    same = all(r[k] == first[k] for rs in runs.values() for r in rs for k in SAME)
    return {
        "model": name,
        "generation_s_before": mean("false", "time/generation"),
        "generation_s_after": mean("true", "time/generation"),
        "ratio": mean("false", "time/generation") / max(mean("true", "time/generation"), 1e-9),
        "update_s_before": mean("false", "time/update"),
        "update_s_after": mean("true", "time/update"),
        "runs": {g: [r["time/generation"] for r in rs] for g, rs in runs.items()},
        "same_samples": same,
        **{k: first[k] for k in SAME},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparisons, print a table with the ratios, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="quickstart model only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--smollm2-dir", default=str(harness.SMOLLM2_DIR))
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = prepare_quickstart(work / "base", warmup_steps=20)
        print("quickstart: 2 processes, 2 prompts x 8 completions x 24 tokens per rank, "
              "2 steps", flush=True)
        rows.append(compare("quickstart", "grpo/quickstart_cpu", [
            f"model_dir={base}", "num_steps=2", "batch_size=4", "group_size=8",
            "max_generated_tokens=24", "temperature=1.0"], work, args.threads))
        smol = Path(args.smollm2_dir)
        if not args.quick and (smol / "model.safetensors").is_file():
            data = work / "problems.jsonl"
            data.write_text("".join(json.dumps({"question": q, "answer": f"Work.\n#### {a}"})
                                    + "\n" for q, a in PROBLEMS))
            print("smollm2: 2 processes, 1 prompt x 4 completions x 32 tokens per rank, 1 step",
                  flush=True)
            rows.append(compare("smollm2", "grpo/smollm2_gsm8k_cpu", [
                f"model_dir={smol}", f"dataset.source={data}", "dataset.split=train",
                f"eval_dataset.source={data}", "eval_dataset.split=train", "num_steps=1",
                "batch_size=2", "group_size=4", "max_generated_tokens=32"], work, args.threads))
        elif not args.quick:
            print(f"smollm2: skipped, no model in {smol} (tune-grpo prepare-model smollm2)")

    print("\n| model | time/generation, gathered per step (s) | gathered once (s) | ratio | "
          "time/update before / after (s) | same samples |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['generation_s_before']:.2f} | {r['generation_s_after']:.2f} "
              f"| **{r['ratio']:.2f}x** | {r['update_s_before']:.2f} / {r['update_s_after']:.2f} "
              f"| {r['same_samples']} |")
    if args.out:
        harness.write_json(args.out, rows, indent=1)
    return 0 if all(r["same_samples"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
