"""How much of the update's work GRPO can skip: an A/B of ``skip_zero_advantage_sequences`` and
``share_prompt_forward`` in one process, on one rollout.

    python benchmarks/update_work.py [--config grpo/smollm2_arithmetic_cpu] [--repeats 3]
        [--threads 2] [--out update_work.json] [key=value ...]

One step's rollout of the config (its model, prompts, group size, temperature) is sampled and
scored once. Then the update of that rollout is run ``--repeats`` times for each variant, the
variants alternating:

- ``baseline``: every rollout through the forward and backward passes, each with its own copy
  of the prompt (``skip_zero_advantage_sequences=false share_prompt_forward=false``);
- ``skip``: rollouts whose advantage is exactly 0 (tied groups) left out;
- ``skip+share``: and each group's prompt run once.

The learning rate is set to 0, so every update starts from the same weights and does the same
work; each variant's gradient norm is checked against the baseline's (relative 1e-4) before any
time is reported, and the rollout must hold both tied and untied groups. Prints and writes the
median seconds per variant and the ratio to the baseline, measured in this invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = {
    "baseline": {"skip_zero_advantage_sequences": False, "share_prompt_forward": False},
    "skip": {"skip_zero_advantage_sequences": True, "share_prompt_forward": False},
    "skip+share": {"skip_zero_advantage_sequences": True, "share_prompt_forward": True},
}


def run(config: str, overrides: list[str], repeats: int, threads: int) -> dict:
    """Sample one rollout of ``config`` and time its update per variant (see the docstring)."""
    import torch

    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.training.metrics import PhaseTimer
    from torchtune_grpo.training.recipe import GRPORecipe

    torch.set_num_threads(threads)
    import tempfile

    cfg = load_config(config, ["optimizer.lr=0.0", "progress_bar=false", "metric_logger=null",
                               "eval_dataset=null", f"output_dir={tempfile.mkdtemp()}",
                               *overrides])
    recipe = GRPORecipe(cfg)
    recipe.setup()
    try:
        traj, rewards = recipe.rollout_and_score(recipe.batches.batch(0), PhaseTimer())
        adv = recipe.advantages(rewards, traj)
        zero = float((adv.advantages == 0).float().mean())
        tied = float(adv.zero_std_groups.float().mean())
        if not 0 < tied < 1:
            raise SystemExit(f"the rollout has {tied:.0%} tied groups: nothing to compare; "
                             "try another seed=")
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        norms: dict[str, float] = {}
        for _ in range(repeats):
            for name, keys in VARIANTS.items():
                for key, value in keys.items():
                    recipe.cfg[key] = value
                start = time.perf_counter()
                metrics = recipe.update(traj, adv.advantages, None, recipe.loss_mask(traj, adv))
                seconds[name].append(time.perf_counter() - start)
                norms[name] = metrics["grad_norm"]
        for name, norm in norms.items():
            if abs(norm - norms["baseline"]) > 1e-4 * abs(norms["baseline"]):
                raise SystemExit(f"{name}: grad_norm {norm} differs from the baseline's "
                                 f"{norms['baseline']}")
        median = {name: statistics.median(v) for name, v in seconds.items()}
        prompt_tokens = int(traj.prompt_mask.sum())
        return {
            "config": config, "overrides": overrides, "threads": threads, "repeats": repeats,
            "rollouts": traj.num_sequences, "group_size": recipe.group_size,
            "tied_group_fraction": tied, "zero_advantage_fraction": zero,
            "prompt_tokens": prompt_tokens, "response_tokens": int(traj.response_mask.sum()),
            "grad_norm": norms, "seconds": seconds, "median_seconds": median,
            "speedup_vs_baseline": {n: median["baseline"] / m for n, m in median.items()},
        }
    finally:
        recipe.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="grpo/smollm2_arithmetic_cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    result = run(args.config, args.overrides, args.repeats, args.threads)
    print(f"{result['rollouts']} rollouts, {result['tied_group_fraction']:.0%} of groups tied "
          f"({result['zero_advantage_fraction']:.0%} of rollouts with advantage 0), "
          f"{result['prompt_tokens']} prompt + {result['response_tokens']} response tokens")
    for name, med in result["median_seconds"].items():
        print(f"  {name:11s} update {med:7.2f} s  ({result['speedup_vs_baseline'][name]:.2f}x "
              f"the baseline)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
