"""``tune-grpo difficulty``: write each prompt's pass rate under a model to a difficulty file
(:func:`torchtune_grpo.evaluation.difficulty.score_difficulty`)."""

from __future__ import annotations

import argparse

from torchtune_grpo.config.loading import load_config
from torchtune_grpo.evaluation.difficulty import score_difficulty


def main(argv: list[str] | None = None) -> int:
    """``tune-grpo difficulty --config CFG --out FILE [--num-samples N] [key=value ...]``."""
    parser = argparse.ArgumentParser(
        prog="tune-grpo difficulty",
        description="Write each prompt's pass rate under a model "
                    "(see torchtune_grpo.evaluation.difficulty)")
    parser.add_argument("--config", required=True, help="a training or eval config")
    parser.add_argument("--out", required=True, help="JSONL file to write or complete")
    parser.add_argument("--num-samples", "--num_samples", type=int, default=8,
                        dest="num_samples", help="completions per prompt (default 8)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the config's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    for key in ("model", "tokenizer", "checkpointer", "dataset", "rewards",
                "max_generated_tokens"):
        if key not in cfg or cfg[key] is None:
            parser.error(f"the config has no {key!r}: give a training or eval config")
    score_difficulty(cfg, args.out, num_samples=args.num_samples,
                     temperature=args.temperature, progress=not args.no_progress)
    return 0
