"""Update and rollout seconds with ``keep_freed_cpu_memory`` on and off, A/B in fresh processes.

The setting changes how glibc ``malloc`` serves the process
(:func:`torchtune_grpo.backends.allocator.keep_freed_memory`), which cannot be undone inside a
process, so each run is a fresh worker process: the recipe is built at ``--shape`` (see
``benchmarks/decode_kernels.py``: ``step`` or ``smollm2``), one rollout is timed, and then
``--updates`` updates on that same trajectory (the same tokens every time: only the allocator
differs). Workers alternate off, on, off, on, ... for ``--pairs`` pairs, so that a drift of the
machine hits both settings. Prints every worker's times, the median of the updates after the
first two (the heap's steady state: the first updates of a process still grow it) per setting,
and each worker's peak resident memory.

Usage::

    python benchmarks/allocator.py --shape smollm2 --pairs 3 --updates 5
    python benchmarks/allocator.py --shape step --pairs 2 --updates 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/allocator.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

#: Updates per worker left out of the steady-state median (the heap still grows in them).
WARM_UPDATES = 2


def worker(shape: str, keep: bool, updates: int, new_tokens: int, threads: int,
           model_dir: Path) -> dict:
    """One process's run: ``{"rollout_s", "update_s": [...], "peak_rss_bytes"}``."""
    import torch

    torch.set_num_threads(threads)
    from benchmarks import decode_kernels
    from torchtune_grpo.backends.memory import peak_rss_bytes

    with tempfile.TemporaryDirectory() as tmp:
        recipe = decode_kernels.build_recipe(shape, Path(tmp), new_tokens, model_dir,
                                             {"keep_freed_cpu_memory": keep})
        batch = recipe.batches.batch(0)
        t0 = time.perf_counter()
        traj = recipe.rollout(batch)
        rollout_s = time.perf_counter() - t0
        adv = recipe.advantages(recipe.score(traj, batch), traj)
        ref = recipe.reference_logprobs(traj) if recipe.loss_fn.needs_reference else None
        args = (traj, adv.advantages.to(recipe.device), ref, recipe.loss_mask(traj, adv))
        times = []
        for _ in range(updates):
            t0 = time.perf_counter()
            recipe.update(*args, old_logprobs=recipe.old_logprobs(traj))
            times.append(time.perf_counter() - t0)
    return {"rollout_s": rollout_s, "update_s": times, "peak_rss_bytes": peak_rss_bytes()}


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the workers, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["step", "smollm2"], default="step")
    parser.add_argument("--pairs", type=int, default=2, help="off/on worker pairs")
    parser.add_argument("--updates", type=int, default=4, help="updates per worker (> 2)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="default: 32 (step), 128 (smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=harness.SMOLLM2_DIR)
    parser.add_argument("--out", type=Path, help="write the times as JSON")
    parser.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens or (128 if args.shape == "smollm2" else 32)
    if args.worker:
        result = worker(args.shape, args.worker == "on", args.updates, new_tokens,
                        args.threads, args.model_dir)
        print("RESULT " + json.dumps(result))
        return 0
    if args.updates <= WARM_UPDATES:
        parser.error(f"--updates must be > {WARM_UPDATES}")
    if args.shape == "smollm2" and harness.smollm2_missing(args.model_dir):
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")
           and k != "GLIBC_TUNABLES"}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.pairs):
        for setting in ("off", "on"):
            cmd = [sys.executable, __file__, "--worker", setting, "--shape", args.shape,
                   "--updates", str(args.updates), "--new-tokens", str(new_tokens),
                   "--threads", str(args.threads), "--model-dir", str(args.model_dir)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            run = json.loads(lines[-1][len("RESULT "):])
            runs[setting].append(run)
            print(f"{setting:>3}: rollout {run['rollout_s']:.2f} s, updates "
                  + " ".join(f"{t:.2f}" for t in run["update_s"])
                  + f" s, peak {run['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
    medians = {s: statistics.median(t for r in rs for t in r["update_s"][WARM_UPDATES:])
               for s, rs in runs.items()}
    first = {s: statistics.median(r["update_s"][0] for r in rs) for s, rs in runs.items()}
    peaks = {s: max(r["peak_rss_bytes"] for r in rs) / 1e9 for s, rs in runs.items()}
    print(f"update, after {WARM_UPDATES} per process: off {medians['off']:.2f} s, on "
          f"{medians['on']:.2f} s, off / on {medians['off'] / medians['on']:.2f}x")
    print(f"first update: off {first['off']:.2f} s, on {first['on']:.2f} s")
    print(f"peak memory: off {peaks['off']:.2f} GB, on {peaks['on']:.2f} GB")
    if args.out:
        harness.write_json(args.out, {
            **harness.run_metadata("allocator", argv),
            "runs": runs, "update_median_s": medians, "peak_gb": peaks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
