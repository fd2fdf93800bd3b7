"""``tune-grpo prepare-quickstart``: write a quickstart's starting model, or evaluate one.

Commands::

    tune-grpo prepare-quickstart [--output-dir DIR] [--seed S] [--warmup-steps N]
                                 [--correct-fraction F]
    tune-grpo prepare-quickstart --evaluate CHECKPOINT_DIR [CHECKPOINT_DIR ...]
    tune-grpo prepare-quickstart --tools [--output-dir DIR] [--seed S] [--warmup-steps N]
                                 [--tool-fraction F] [--tool-weight W]
    tune-grpo prepare-quickstart --tools --evaluate [--no-tool-results] CHECKPOINT_DIR ...

Without ``--tools``: the addition quickstart (:mod:`torchtune_grpo.quickstart.prepare`); with
it: the tool quickstart (:mod:`torchtune_grpo.quickstart.tools`). The ``--evaluate`` forms print
the held-out greedy success of saved checkpoints (for example ``<output_dir>/step_<N>`` of a
run; with ``--tools`` also the tool calls per completion) and write nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchtune_grpo.quickstart.prepare import (
    CORRECT_FRACTION,
    DEFAULT_QUICKSTART_DIR,
    WARMUP_STEPS,
    heldout_success,
    prepare_quickstart,
)
from torchtune_grpo.quickstart.tools import (
    DEFAULT_TOOLS_QUICKSTART_DIR,
    TOOL_FRACTION,
    TOOL_WARMUP_STEPS,
    TOOL_WEIGHT,
    prepare_tools_quickstart,
    tool_heldout_success,
)


def main(argv: list[str] | None = None) -> None:
    """``tune-grpo prepare-quickstart``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="tune-grpo prepare-quickstart",
                                     description=prepare_quickstart.__doc__)
    parser.add_argument("--tools", action="store_true",
                        help="the tool quickstart (grpo/quickstart_cpu_tools): multiplication, "
                             "a warm-up that calls the calculator in a minority of "
                             "demonstrations; with --evaluate: evaluate on that task")
    parser.add_argument("--output-dir", default=None,
                        help=f"default {DEFAULT_QUICKSTART_DIR} "
                             f"(with --tools: {DEFAULT_TOOLS_QUICKSTART_DIR})")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help=f"default {WARMUP_STEPS} (with --tools: {TOOL_WARMUP_STEPS})")
    parser.add_argument("--correct-fraction", type=float, default=CORRECT_FRACTION)
    parser.add_argument("--tool-fraction", type=float, default=TOOL_FRACTION,
                        help="with --tools: share of warm-up demonstrations that call the tool")
    parser.add_argument("--tool-weight", type=float, default=TOOL_WEIGHT,
                        help="with --tools: loss weight of a tool demonstration's tokens after "
                             "its first one")
    parser.add_argument("--no-tool-results", action="store_true",
                        help="with --tools --evaluate: the calculator disabled (calls get no "
                             "result), as in the negative control")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite an existing model folder (default: keep it)")
    parser.add_argument("--evaluate", nargs="+", metavar="CHECKPOINT_DIR",
                        help="print the held-out greedy success of these checkpoints and exit")
    args = parser.parse_args(argv)
    if args.evaluate:
        for directory in args.evaluate:
            if args.tools:
                success, calls = tool_heldout_success(directory, tools=not args.no_tool_results)
                print(f"{directory}: held-out greedy success {success:.3f}, "
                      f"tool calls per completion {calls:.3f}")
            else:
                print(f"{directory}: held-out greedy success {heldout_success(directory):.3f}")
        return
    if args.tools:
        target = Path(args.output_dir or DEFAULT_TOOLS_QUICKSTART_DIR)
        if (target / "model.safetensors").is_file() and not args.overwrite:
            print(f"{target} already holds a tool quickstart model: kept (pass --overwrite to "
                  "write a new one)")
            return
        path = prepare_tools_quickstart(
            args.output_dir or DEFAULT_TOOLS_QUICKSTART_DIR,
            warmup_steps=TOOL_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps,
            seed=args.seed, tool_fraction=args.tool_fraction, tool_weight=args.tool_weight)
        success, calls = tool_heldout_success(path)
        print(f"tool quickstart model and tokenizer written to {path}")
        print(f"held-out greedy success of this starting model: {success:.3f} "
              f"(tool calls per completion {calls:.3f})")
        return
    target = Path(args.output_dir or DEFAULT_QUICKSTART_DIR)
    if (target / "model.safetensors").is_file() and not args.overwrite:
        print(f"{target} already holds a quickstart model: kept (pass --overwrite to write a "
              "new one)")
        return
    path = prepare_quickstart(target,
                              warmup_steps=WARMUP_STEPS if args.warmup_steps is None
                              else args.warmup_steps,
                              seed=args.seed, correct_fraction=args.correct_fraction,
                              report_every_s=10.0)
    print(f"quickstart model and tokenizer written to {path}")
    print(f"held-out greedy success of this starting model: {heldout_success(path):.3f}")


if __name__ == "__main__":
    main()
