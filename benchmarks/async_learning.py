"""Does asynchronous GRPO still learn? Held-out success of the CPU quickstart, sync vs async.

For each seed, in one invocation:

* ``sync``: ``tune run --nproc_per_node 2 grpo_full_finetune_distributed --config
  grpo/quickstart_cpu`` with a global batch of 16 prompts, ``--steps`` steps (default 8, where
  the synchronous quickstart passes 0.9);
* ``async k=1`` and ``async k=2``: ``tune run --nproc_per_node 3
  async_grpo_full_finetune_distributed --config grpo/quickstart_cpu_async`` (1 rollout rank +
  2 trainer ranks, the same global batch) for 1.5x as many steps, evaluated at ``--steps`` and
  at 1.5x.

Held-out success is greedy pass@1 on the 300 test problems (the recipes' own evaluation,
``eval/pass@1``), before the first step and at the evaluation steps. The starting model is
the quickstart's (``prepare_quickstart``, default warm-up), written once into a temporary
folder.

Usage::

    python benchmarks/async_learning.py                 # seeds 0-2, ~6 min on 2 cores
    python benchmarks/async_learning.py --seeds 0 --out async_learning.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/async_learning.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402


def _run(args: list[str], cwd: Path) -> None:
    harness.tune_run(args, cwd=cwd, threads=1, pythonpath=[harness.REPO])


def _pass_at_1(out: Path) -> dict[int, float]:
    from torchtune_grpo.training.metrics import read_disk_log

    return {int(r["step"]): r["eval/pass@1"] for r in read_disk_log(out / "logs")
            if "eval/pass@1" in r}


def run_seed(base: Path, work: Path, seed: int, steps: int) -> dict[str, dict[int, float]]:
    """Held-out pass@1 by step of the three runs of ``seed``."""
    longer = steps * 3 // 2
    common = [f"model_dir={base}", "progress_bar=false", f"seed={seed}",
              "global_batch_size=16", "batch_size=null", "eval_at_start=true"]
    results = {}
    out = work / f"sync_{seed}"
    _run(["run", "--nproc_per_node", "2", "grpo_full_finetune_distributed", "--config",
          "grpo/quickstart_cpu", *common, f"output_dir={out}", f"num_steps={steps}",
          f"eval_every_n_steps={steps}"], work)
    results["sync"] = _pass_at_1(out)
    for k in (1, 2):
        out = work / f"async_k{k}_{seed}"
        _run(["run", "--nproc_per_node", "3", "async_grpo_full_finetune_distributed",
              "--config", "grpo/quickstart_cpu_async", *common, f"output_dir={out}",
              f"num_steps={longer}", f"eval_every_n_steps={steps}", f"max_staleness={k}"],
             work)
        results[f"async k={k}"] = _pass_at_1(out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = prepare_quickstart(work / "base")
        for seed in args.seeds:
            results[seed] = run_seed(base, work, seed, args.steps)
    longer = args.steps * 3 // 2
    print(f"| seed | run | pass@1 at 0 | at {args.steps} | at {longer} |")
    print("|---|---|---|---|---|")
    for seed, runs in results.items():
        for name, by_step in runs.items():
            cells = [f"{by_step[s]:.3f}" if s in by_step else "-" for s in (0, args.steps, longer)]
            print(f"| {seed} | {name} | " + " | ".join(cells) + " |")
    if args.out:
        harness.write_json(args.out, {str(s): {n: {str(k): v for k, v in r.items()}
                                               for n, r in runs.items()}
                                      for s, runs in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
