"""Config fuzz: random mutations of the shipped configs, each either accepted (and, where this
machine has the model, trained for one step) or rejected in one line that names the key,
before any model is loaded.

A mutation changes one key of one shipped config (after ``inherit:``), chosen uniformly among
all its keys and list entries, in one of four ways:

- ``drop``: the key is removed;
- ``rename``: the key is misspelt (a letter dropped, doubled or swapped);
- ``retype``: the value becomes one of another type (a string, a number, a list, a mapping);
- ``range``: a number becomes negative, zero, non-finite or enormous.

Each mutant runs in a child forked from this process (the libraries imported once), under a
memory limit and a time limit, as far as it gets:

1. ``load``: the mutated YAML, read as the recipe reads a config file;
2. ``validate``: the recipe's own check (``GRPORecipe.validate``, the eval recipe's schema or
   the async recipe's check); configs whose model is not on this machine stop here;
3. ``run``: set-up and one training step (the recipe's ``train``, ``num_steps=1`` unless the
   mutation is of ``num_steps``; the eval recipe's evaluation of two problems), with the
   output in a fresh folder.

Outcomes: ``accepted`` (validated; ``ran`` when the step ran too); ``rejected`` (an error of a
kind the recipe's entry point prints as one line, ``error: ...``, naming the key, and raised
before any model was built or loaded); and the failures: ``late`` (a clear error, but after
a model was loaded), ``unclear`` (the error does not name the key, or is of a kind that ends in
a traceback), ``timeout`` and ``died`` (killed by a signal, e.g. out of memory).

Run it as a script::

    python tests/recipes/config_fuzz.py --mutations 500 --seed 0 --out fuzz.json

which prints the tally and every failure (``docs/reliability.md`` records a run);
``test_config_fuzz.py`` runs a smaller sample in the slow tier.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

#: Configs whose model the fuzz can provide (the quickstart's tiny model); the rest are
#: validated only. The async quickstart needs three processes, so it is validated only.
RUNNABLE = ("quickstart_cpu", "quickstart_cpu_cispo", "quickstart_cpu_dapo",
            "quickstart_cpu_dr_grpo", "quickstart_cpu_gspo", "quickstart_cpu_kl",
            "quickstart_cpu_tools", "eval_quickstart")
#: Exceptions that the recipes' entry point (``torchtune_grpo.config.loading.parse``) prints as one
#: line, without a traceback.
ONE_LINE = ("ConfigError", "FileNotFoundError", "FileExistsError", "PermissionError")
MEMORY_LIMIT = 8 * 2**30
TIME_LIMIT = 240.0


# ---------------------------------------------------------------- mutations
def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(root: Any, path: tuple) -> Any:
    node = root
    for part in path[:-1]:
        node = node[part]
    return node


def _misspell(name: str, rng: random.Random) -> str:
    if len(name) < 2:
        return name + name
    i = rng.randrange(len(name) - 1)
    way = rng.choice(("drop", "double", "swap"))
    if way == "drop":
        out = name[:i] + name[i + 1:]
    elif way == "double":
        out = name[:i] + name[i] + name[i:]
    else:
        out = name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return out if out != name else name + "x"


def _other_type(value: Any, rng: random.Random) -> Any:
    choices: list[Any] = ["oops", 3, 2.5, [1, 2], {"bogus": 1}, True]
    if isinstance(value, bool):
        choices = ["oops", 2, [1]]
    elif isinstance(value, int):
        choices = ["oops", 2.5, [1, 2], {"bogus": 1}]
    elif isinstance(value, float):
        choices = ["oops", [0.1], {"bogus": 1}, True]
    elif isinstance(value, str):
        choices = [3, [value], {"bogus": 1}, True]
    elif isinstance(value, list):
        choices = [5, "oops", {"bogus": 1}]
    elif isinstance(value, dict):
        choices = [7, "oops", [1, 2]]
    return rng.choice(choices)


def _out_of_range(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return rng.choice([-1, 0, -100, 2**31])
    if isinstance(value, float):
        return rng.choice([-1.0, 0.0, -1e-3, 1e12, math.inf, math.nan])
    return None


def mutate(cfg: dict, rng: random.Random) -> dict:
    """Apply one random mutation to the plain config ``cfg`` (in place); describe it."""
    paths = _paths(cfg)
    while True:
        path = rng.choice(paths)
        kind = rng.choice(("drop", "rename", "retype", "range"))
        parent, key = _parent(cfg, path), path[-1]
        value = parent[key]
        if kind == "range":
            new = _out_of_range(value, rng)
            if new is None or repr(new) == repr(value):
                continue  # not a number, or already that value: draw again
            parent[key] = new
            return {"kind": kind, "path": list(path), "value": _jsonable(new)}
        if kind == "retype":
            new = _other_type(value, rng)
            parent[key] = new
            return {"kind": kind, "path": list(path), "value": _jsonable(new)}
        if kind == "drop":
            if isinstance(parent, list):
                del parent[key]
            else:
                del parent[key]
            return {"kind": kind, "path": list(path)}
        if isinstance(parent, list):
            continue  # a list entry has no name to misspell
        new_name = _misspell(str(key), rng)
        parent[new_name] = parent.pop(key)
        return {"kind": kind, "path": list(path), "new_name": new_name}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def names(mutation: dict) -> set[str]:
    """What an error about ``mutation`` may name: the key, its dotted path, its new name, the
    block it sits in (for a ``_component_`` or a list entry)."""
    path = [str(p) for p in mutation["path"]]
    out = {".".join(path)}
    if not path[-1].isdigit() and path[-1] != "_component_":
        out.add(path[-1])
    if len(path) > 1 and (path[-1].isdigit() or path[-1] == "_component_"):
        out.add(".".join(p for p in path[:-1]))
        out.add(next((p for p in reversed(path[:-1]) if not p.isdigit()), path[0]))
    if "new_name" in mutation:
        out.add(mutation["new_name"])
    return out


# ---------------------------------------------------------------- one mutant
def _child(config_name: str, mutated: dict, mutation: dict, base: str | None, work: Path,
           report: Path) -> None:
    """Runs in the forked child: load, validate, maybe run; write ``report``."""
    state: dict[str, Any] = {"stage": "load", "model_loaded": False}

    def save(**extra):
        state.update(extra)
        report.write_text(json.dumps(state))

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    try:
        import yaml

        from torchtune_grpo.config.loading import load_config
        from torchtune_grpo.training import recipe as recipe_module

        runnable = base is not None and config_name in RUNNABLE
        if runnable and "checkpoint_dir" in mutated:  # the eval recipe writes its results there
            import shutil

            shutil.copytree(base, work / "checkpoint")
        path = work / "mutant.yaml"
        path.write_text(yaml.safe_dump(mutated, sort_keys=False))
        top = mutation["path"][0]
        fast = {"output_dir": str(work / "out"), "model_dir": base,
                "checkpoint_dir": str(work / "checkpoint"),
                "num_steps": 1, "eval_at_start": False, "progress_bar": False,
                "eval_every_n_steps": None, "save_every_n_steps": None} if runnable else {
                    "checkpoint_dir": str(work / "checkpoint")}  # an eval config's ``???``
        overrides = [f"{k}={'null' if v is None else v}" for k, v in fast.items()
                     if k != top and k in mutated]
        save()
        cfg = load_config(path, overrides)
        save(stage="validate")
        is_eval = config_name.startswith("eval_")  # the grpo_eval recipe's configs
        if any(k in cfg for k in ("rollout_ranks", "max_staleness")):
            from torchtune_grpo.config.validation import validate_async_config

            validate_async_config(cfg, world_size=3)
            save(stage="accepted")
            return
        from torchtune_grpo.config.schema import EVAL_KEYS
        from torchtune_grpo.config.validation import validate_config

        validate_config(cfg, schema=EVAL_KEYS if is_eval else None)  # what __init__ runs
        if not runnable:
            save(stage="accepted")
            return
        save(stage="run")
        _watch_model_loading(state, save)
        if is_eval:
            import grpo_eval

            grpo_eval.recipe_main.__wrapped__(cfg)
        else:
            recipe = recipe_module.GRPORecipe(cfg)
            try:
                recipe.setup()
                if top == "num_steps":  # a mutated num_steps: one step, whatever it says
                    metrics = recipe.train_step(recipe.batches.batch(recipe.step))
                    recipe.after_step(metrics)
                else:
                    recipe.train()
            finally:
                recipe.cleanup()
        save(stage="ran")
    except BaseException as exc:  # noqa: BLE001 (every way out is an outcome)
        save(error_type=type(exc).__name__, error=str(exc)[:2000],
             traceback=traceback.format_exc()[-3000:])


def _watch_model_loading(state: dict, save) -> None:
    """Mark ``model_loaded`` when the recipe builds a model or a checkpointer reads one."""
    import torchtune.training as tt

    from torchtune_grpo.policy import model as modeling
    from torchtune_grpo.training import parts

    def flag(fn):
        def wrapper(*args, **kwargs):
            if not state["model_loaded"]:
                save(model_loaded=True)
            return fn(*args, **kwargs)
        return wrapper

    parts.build_model = flag(parts.build_model)
    modeling.build_model = flag(modeling.build_model)
    for name in ("FullModelHFCheckpointer", "FullModelMetaCheckpointer",
                 "FullModelTorchTuneCheckpointer"):
        cls = getattr(tt, name, None)
        if cls is not None:
            cls.load_checkpoint = flag(cls.load_checkpoint)


def classify(report: dict, mutation: dict) -> str:
    stage = report.get("stage")
    if "error_type" not in report:
        return {"ran": "ran", "accepted": "accepted"}.get(stage, "died")
    message = report.get("error", "")
    named = any(n in message for n in names(mutation))
    if not named or report["error_type"] not in ONE_LINE:
        return "unclear"
    return "late" if report.get("model_loaded") else "rejected"


def run_mutant(config_name: str, mutation_seed: int, base: str | None) -> dict:
    """Mutate ``config_name`` with ``mutation_seed``, run the mutant in a child; its record."""
    from omegaconf import OmegaConf

    from torchtune_grpo.config.loading import _load_with_inheritance, resolve_config_path

    plain = OmegaConf.to_container(
        _load_with_inheritance(resolve_config_path(f"grpo/{config_name}"), seen=()),
        resolve=False)
    mutated = copy.deepcopy(plain)
    mutation = mutate(mutated, random.Random(mutation_seed))
    with tempfile.TemporaryDirectory(prefix="fuzz_") as tmp:
        work = Path(tmp)
        report = work / "report.json"
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(config_name, mutated, mutation, base, work, report)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        status = None
        while time.monotonic() - start < TIME_LIMIT:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"config": config_name, "seed": mutation_seed, **mutation,
                    "outcome": "timeout", "seconds": round(time.monotonic() - start, 1)}
        data = json.loads(report.read_text()) if report.is_file() else {}
        if os.WIFSIGNALED(status):
            outcome = "died"
            data["signal"] = os.WTERMSIG(status)
        else:
            outcome = classify(data, mutation)
        return {"config": config_name, "seed": mutation_seed, **mutation, "outcome": outcome,
                "seconds": round(time.monotonic() - start, 1),
                **{k: data[k] for k in ("stage", "error_type", "error", "model_loaded",
                                         "traceback", "signal") if k in data}}


def fuzz(n: int, seed: int, base: str | None, out: Path | None = None,
         configs: list[str] | None = None, runnable_share: float = 0.0) -> list[dict]:
    """``n`` mutants, configs drawn uniformly (a run of ``seed`` is reproducible); with
    ``runnable_share``, that share of the draws is from :data:`RUNNABLE` (mutants that run a
    step), whatever the number of other shipped configs."""
    from torchtune_grpo.config.loading import list_shipped_configs

    names_ = configs or [c.removeprefix("grpo/") for c in list_shipped_configs()]
    rng = random.Random(seed)
    records = []
    for i in range(n):
        from_runnable = rng.random() < runnable_share
        config_name = rng.choice(RUNNABLE if from_runnable else names_)
        records.append(run_mutant(config_name, rng.randrange(2**31), base))
        if out is not None:
            out.write_text(json.dumps(records, indent=1))
        print(f"[{i + 1}/{n}] {config_name} {records[-1]['kind']} "
              f"{'.'.join(map(str, records[-1]['path']))}: {records[-1]['outcome']}",
              file=sys.stderr, flush=True)
    return records


FAILURES = ("late", "unclear", "timeout", "died")


def tally(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", help="the quickstart model folder (default: prepared in a "
                                       "temporary folder)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--runnable-share", type=float, default=0.0,
                        help="share of the mutants drawn from the configs that run a step")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # no OpenMP pool in the parent: the forks stay safe
    import torch

    torch.set_num_threads(1)
    base = args.base
    if base is None:
        from torchtune_grpo.quickstart.prepare import prepare_quickstart

        base = str(prepare_quickstart(Path(tempfile.mkdtemp(prefix="fuzz_base_")),
                                      warmup_steps=0))
    records = fuzz(args.mutations, args.seed, base, args.out,
                   runnable_share=args.runnable_share)
    print(json.dumps(tally(records)))
    for r in records:
        if r["outcome"] in FAILURES:
            print(json.dumps({k: r.get(k) for k in ("config", "kind", "path", "value",
                                                    "new_name", "outcome", "error_type",
                                                    "error")}))


if __name__ == "__main__":
    main()
