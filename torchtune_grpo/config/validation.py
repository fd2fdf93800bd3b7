"""Validation of a whole GRPO config before any model is loaded: :func:`validate_config`
(keys, types, ranges, components, batch arithmetic, incompatible features; every problem
in one :class:`ConfigError`), :func:`validate_async_config`, :func:`check_input_files` and
:func:`check_device`.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.config.components import check_components, import_component
from torchtune_grpo.config.schema import (
    ASYNC_KEYS,
    EVAL_KEYS,
    RECIPE_KEYS,
    REQUIRED,
    Key,
    per_rank_batch_size,
    with_defaults,
)
from torchtune_grpo.config.settings import settings_from_config, value_fits
from torchtune_grpo.errors import CheckpointError, UserError
from torchtune_grpo.evaluation.settings import sampling_problems


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem found."""


def _type_ok(hint: Any, value: Any) -> bool:
    """Whether a top-level value fits its field's annotation; a float must also be finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value_fits(hint, value)


def validate_config(cfg: DictConfig, *, world_size: int = 1,
                    extra_keys: dict[str, Key] | None = None,
                    schema: dict[str, Key] | None = None) -> None:
    """Check ``cfg`` against the keys of a config tree without building anything expensive.

    A key's annotation gives its type check, its ``check`` the range check, and a nested block
    is read into its settings dataclass; an unknown key gets the closest key (or component
    argument) suggested.

    Args:
        cfg: the merged config.
        world_size: number of ranks the run will use (for batch divisibility).
        extra_keys: recipe-specific keys beyond the schema
            (:data:`~torchtune_grpo.config.schema.ASYNC_KEYS`).
        schema: the recipe's keys (default :data:`~torchtune_grpo.config.schema.RECIPE_KEYS`;
            ``grpo_eval``: :data:`~torchtune_grpo.config.schema.EVAL_KEYS`).

    Raises:
        ConfigError: listing every problem, each naming its key.
    """
    schema = RECIPE_KEYS if schema is None else schema
    known = {**schema, **(extra_keys or {})}
    errors: list[str] = []
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    component_params: dict[str, set[str]] = {}
    component_errors: list[str] = []
    check_components(raw, "", component_errors, component_params)
    # candidates for a misplaced key: top-level keys and every component's arguments
    nested = {f"{where}.{name}": name for where, names in component_params.items()
              for name in names if "." not in where and "[" not in where}
    for key in cfg:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            if not close:
                match = difflib.get_close_matches(str(key), list(nested.values()), n=1)
                close = [k for k, v in nested.items() if match and v == match[0]][:1]
            hint = f" Did you mean {close[0]!r}?" if close else ""
            errors.append(f"unknown config key {key!r}.{hint}")
    for key, spec in known.items():
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            if spec.default is REQUIRED:
                errors.append(f"missing required config key {key!r}: {spec.doc}")
            continue
        value = OmegaConf.select(cfg, key) if isinstance(cfg, DictConfig) else cfg[key]
        if not _type_ok(spec.hint, value):
            errors.append(f"config key {key!r} must be {spec.type}, got {value!r}")
            continue
        if key == "tools":
            errors.extend(_tools_errors(value, component_errors))
        if spec.check is not None and value is not None and not isinstance(value, bool):
            problem = spec.check(value)
            if problem:
                errors.append(f"config key {key!r} {problem} (got {value!r})")
        if spec.settings is not None and value is not None:
            try:
                settings_from_config(spec.settings, value, key)
            except ValueError as e:
                errors.append(str(e))
    errors.extend(component_errors)
    errors.extend(_optimizer_range_errors(raw.get("optimizer")))
    rewards = cfg.get("rewards")
    if isinstance(rewards, (list, ListConfig)) and len(rewards) == 0:
        errors.append("config key 'rewards' must list at least one reward component")
    for i, entry in enumerate(raw.get("rewards") or [] if isinstance(rewards, (list, ListConfig))
                              else []):
        if not isinstance(entry, dict) or not entry.get("_component_"):
            errors.append(f"config key rewards[{i}] must be a mapping with `_component_` (the "
                          "dotted path of a reward component, e.g. "
                          f"torchtune_grpo.rewards.components.NumericCorrectness), got {entry!r}")
    if not errors and schema is RECIPE_KEYS:
        errors.extend(_batch_errors(cfg, world_size) or _build_errors(cfg, "loss"))
    if not errors and schema is EVAL_KEYS:
        errors.extend(_eval_errors(cfg))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _optimizer_range_errors(node: Any) -> list[str]:
    """Out-of-range ``optimizer:`` values: ``lr``, ``weight_decay``, ``momentum`` (finite,
    ``>= 0``), ``eps`` (``> 0``), ``betas`` (each in ``[0, 1)``).
    """
    if not isinstance(node, dict):
        return []
    errors = []

    def number(name: str) -> float | None:
        value = node.get(name)
        if value is None or isinstance(value, bool) or isinstance(value, str):
            return None  # an interpolation or a type the component check reports
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    for name in ("lr", "weight_decay", "momentum", "eps"):
        if isinstance(node.get(name), (dict, list, tuple)):
            errors.append(f"config key 'optimizer.{name}' must be a number, got "
                          f"{type(node.get(name)).__name__} {node.get(name)!r}")
    if errors:
        return errors
    for name in ("lr", "weight_decay", "momentum"):
        value = number(name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            errors.append(f"config key 'optimizer.{name}' must be a finite number >= 0 "
                          f"(got {node.get(name)!r})")
    eps = number("eps")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        errors.append(f"config key 'optimizer.eps' must be > 0 (got {node.get('eps')!r})")
    betas = node.get("betas")
    if isinstance(betas, (list, tuple)):
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                      and 0 <= b < 1 for b in betas):
            errors.append(f"config key 'optimizer.betas' must be two numbers in [0, 1) "
                          f"(got {betas!r})")
    return errors


def _tools_errors(value: Any, component_errors: list[str]) -> list[str]:
    """What :func:`~torchtune_grpo.rollout.tools.build.build_tools` rejects in a ``tools:`` list
    (nothing when the component check already failed on an entry).
    """
    from torchtune_grpo.rollout.tools.build import build_tools

    if value is None or any(e.startswith("tools[") or "key tools[" in e
                            for e in component_errors):
        return []
    try:
        build_tools(value)
    except ValueError as e:
        return [str(e)]
    return []


def _build_errors(cfg: DictConfig, key: str) -> list[str]:
    """Build the cheap, pure component at ``key`` (the loss) and report what it rejects as a
    config error naming the key.
    """
    from torchtune import config as tt_config

    node = cfg.get(key)
    if node is None:
        return []
    try:
        tt_config.instantiate(node)
    except (ValueError, TypeError) as e:
        return [f"config key {key!r} ({node.get('_component_')}): {e}"]
    return []


def _eval_errors(cfg: DictConfig) -> list[str]:
    cfg = with_defaults(cfg, EVAL_KEYS)
    bad = [v for v in cfg.k if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        return [f"config key 'k' must list integers, got {OmegaConf.to_container(cfg.k)!r}"]
    problems = sampling_problems(int(cfg.num_samples), float(cfg.temperature), list(cfg.k))
    return [f"config key {key!r}: {text}" for key, text in problems.items()]


def _batch_errors(cfg: DictConfig, world_size: int) -> list[str]:
    cfg = with_defaults(cfg)
    errors = []
    if cfg.enable_activation_offloading and (
        not cfg.enable_activation_checkpointing or cfg.device != "cuda"
    ):
        errors.append(
            "config key 'enable_activation_offloading' needs device: cuda and "
            "enable_activation_checkpointing: true"
        )
    if cfg.packed_forward is True and cfg.compile:
        errors.append(
            "config keys 'packed_forward' and 'compile' conflict: packed rows attend per row, "
            "which would recompile for every set of lengths; set packed_forward: false (or "
            "leave it unset) to compile, or compile: false to pack"
        )
    errors.extend(_tool_errors(cfg))
    errors.extend(_chat_tool_errors(cfg))
    global_batch = cfg.get("global_batch_size")
    if global_batch is None and cfg.get("batch_size") is None:
        return ["set config key 'batch_size' (prompts per rank) or 'global_batch_size'"]
    if global_batch is not None and global_batch % world_size:
        errors.append(
            f"config key 'global_batch_size' ({global_batch}) does not divide across "
            f"{world_size} ranks: use a multiple of {world_size}"
        )
        return errors
    accum = int(cfg.gradient_accumulation_steps)
    if per_rank_batch_size(cfg, world_size) % accum:
        errors.append(
            f"config key 'gradient_accumulation_steps' ({accum}) must divide the per-rank "
            f"batch of {per_rank_batch_size(cfg, world_size)} prompts"
        )
    rows = per_rank_batch_size(cfg, world_size) * int(cfg.group_size)
    fbs = cfg.forward_batch_size
    if fbs is not None and rows % fbs:
        errors.append(
            f"config key 'forward_batch_size' ({fbs}) must divide batch_size * group_size "
            f"({rows}) per rank"
        )
    rbs = cfg.get("rollout_batch_size")
    if rbs is not None and (rows // accum) % rbs:
        errors.append(
            f"config key 'rollout_batch_size' ({rbs}) must divide the {rows // accum} rows of "
            f"one rollout call per rank (batch_size * group_size / gradient_accumulation_steps)"
        )
    return errors


#: The generator that cannot run tool turns (yet): ``tools:`` with it is a config error.
VLLM_GENERATOR = "torchtune_grpo.rollout.vllm_engine.VLLMGenerator"


def _tool_errors(cfg: DictConfig) -> list[str]:
    """``tools:`` with a generator that cannot run tool turns (vLLM, or a subclass of it)."""
    generator = cfg.get("generator")
    if not cfg.get("tools") or generator is None:
        return []
    path = str(generator.get("_component_"))
    is_vllm = path == VLLM_GENERATOR
    if not is_vllm:
        try:
            from torchtune_grpo.rollout.vllm_engine import VLLMGenerator

            obj = import_component(path, "generator")
            is_vllm = isinstance(obj, type) and issubclass(obj, VLLMGenerator)
        except ValueError:
            return []  # reported by the component check
    if not is_vllm:
        return []
    return [f"config key 'tools' is not supported with generator {path} (vLLM runs no tool "
            "turns yet): use the native generator (generator: null) or remove 'tools' "
            "(docs/howto_tools.md)"]


#: Tokenizer builders whose chat template :func:`_chat_tool_errors` checks at validation.
_HF_TOKENIZERS = ("torchtune_grpo.models.hf_tokenizer", "torchtune_grpo.models.HFTokenizer",
                  "torchtune_grpo.models.tokenizer.hf_tokenizer",
                  "torchtune_grpo.models.tokenizer.HFTokenizer")


def _chat_tool_errors(cfg: DictConfig) -> list[str]:
    """``tool_syntax.format: chat_template`` with a tokenizer whose chat template cannot render
    tool calls; checked here only for an existing HF tokenizer folder.
    """
    syntax = cfg.get("tool_syntax")
    if not cfg.get("tools") or syntax is None or syntax.get("format") != "chat_template":
        return []
    node = cfg.get("tokenizer")
    try:
        component = str(node.get("_component_"))
        path = node.get("path")
    except Exception:  # noqa: BLE001 - an unresolvable node: checked when built
        return []
    if component not in _HF_TOKENIZERS or path is None or not Path(str(path)).exists():
        return []
    from torchtune import config as tt_config

    from torchtune_grpo.rollout.tools.build import build_tools, make_tool_syntax
    from torchtune_grpo.rollout.tools.chat_template import tool_schema

    try:
        tokenizer = tt_config.instantiate(node)
        schemas = [tool_schema(t) for t in build_tools(cfg.tools)]
    except Exception:  # noqa: BLE001 - reported by the tools check or when the recipe builds it
        return []
    try:
        make_tool_syntax(syntax).check_tokenizer(tokenizer, schemas)
    except ValueError as e:
        return [str(e)]
    return []


def async_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """What stops ``cfg`` from running asynchronously on ``world_size`` ranks.

    Args:
        cfg: the merged config.
        world_size: processes of the torchrun world (rollout and trainer ranks together).

    Returns:
        One message per problem, each naming its key; ``[]`` when it can run.
    """
    rollout = cfg.get("rollout_ranks", ASYNC_KEYS["rollout_ranks"].default)
    if not isinstance(rollout, int) or isinstance(rollout, bool) or rollout < 1:
        return []  # reported by validate_config
    errors = []
    trainers = world_size - rollout
    if trainers < 1:
        return [f"config key 'rollout_ranks' ({rollout}) must be below the number of processes "
                f"({world_size}): at least one rank trains (e.g. tune run --nproc_per_node "
                f"{rollout + 1})"]
    if trainers % rollout:
        errors.append(
            f"config key 'rollout_ranks' ({rollout}) must divide the {trainers} trainer ranks "
            f"({world_size} processes - {rollout}): each rollout rank generates the batches of "
            "the same number of trainer ranks")
    model = str((cfg.get("model") or {}).get("_component_", ""))
    if "lora" in model.rsplit(".", 1)[-1]:
        errors.append(f"config key 'model' ({model}): LoRA is not supported by the asynchronous "
                      "recipe yet; use grpo_full_finetune_distributed")
    if cfg.get("tools"):
        errors.append("config key 'tools' is not supported by the asynchronous recipe yet; use "
                      "grpo_full_finetune_distributed")
    generator = str((cfg.get("generator") or {}).get("_component_", ""))
    if "vllm" in generator.lower():
        errors.append(f"config key 'generator' ({generator}): the vLLM engine joins "
                      "torch.distributed's whole world when it starts, which the trainer ranks "
                      "of the asynchronous recipe never do; use the native engine (generator: "
                      "null) or grpo_full_finetune_distributed")
    if cfg.get("dynamic_sampling") is not None:
        errors.append("config key 'dynamic_sampling' is not supported by the asynchronous "
                      "recipe (its extra draws would wait on the rollout ranks); set it to null")
    return errors


def validate_async_config(cfg: DictConfig, *, world_size: int) -> None:
    """:func:`validate_config` for ``async_grpo_full_finetune_distributed``: the batch checks for
    the trainer ranks' share, then :func:`async_errors`.

    Args:
        cfg: the merged config.
        world_size: processes of the torchrun world (rollout and trainer ranks together).

    Raises:
        ConfigError: listing every problem, each naming its key.
    """
    rollout = cfg.get("rollout_ranks", ASYNC_KEYS["rollout_ranks"].default)
    trainers = (world_size - rollout if isinstance(rollout, int) and world_size > rollout
                else 1)
    validate_config(cfg, world_size=trainers, extra_keys=ASYNC_KEYS)
    errors = async_errors(cfg, world_size)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


#: Keys of the ``model``, ``tokenizer`` and ``checkpointer`` nodes that name files or folders.
_PATH_KEYS = {
    "model": ("model_dir",),
    "tokenizer": ("path", "merges_file", "special_tokens_path"),
    "checkpointer": ("checkpoint_dir",),
}


def check_input_files(cfg: DictConfig) -> None:
    """Check that the tokenizer and checkpoint files a config names exist and are whole, with
    the checks of ``tune-grpo check-step``: each JSON file (``config.json``, the tokenizer's)
    parses, each weight file the folder's index names is there, each safetensors file is whole.

    Args:
        cfg: the merged config.

    Raises:
        FileNotFoundError: naming the config key and the missing path.
        CheckpointError: a file that is truncated or damaged (a weight, tokenizer or config
            file), or a weight file an index names that is missing, naming the key and the file.
    """
    from torchtune_grpo.checkpoints.saving import COMPLETE_MARKER
    from torchtune_grpo.checkpoints.step_folder import (
        damaged_json_files,
        index_problems,
        json_problem,
    )

    missing: list[str] = []
    damaged: dict[Path, str] = {}  # file -> "key: file is why", under the first key naming it
    parsed: set[Path] = set()
    for node_name, keys in _PATH_KEYS.items():
        node = cfg.get(node_name)
        for key in keys if node is not None else ():
            if (value := node.get(key)) is None:
                continue
            path = Path(str(value)).expanduser()
            if not path.exists():
                missing.append(f"{node_name}.{key}: {value} does not exist")
                continue
            if path.resolve() in parsed:  # a folder or file several keys name: parsed once
                continue
            parsed.add(path.resolve())
            # a folder: its config.json and tokenizer files; a file: itself; each parsed
            bad = (damaged_json_files(path) if path.is_dir() else
                   {path.name: json_problem(path)} if path.suffix == ".json" else {})
            for name, why in bad.items():
                file = path / name if path.is_dir() else path
                if why is not None:
                    damaged.setdefault(file.resolve(), f"{node_name}.{key}: {file} is {why}")
    ckpt, weights = cfg.get("checkpointer"), []
    if ckpt is not None and ckpt.get("checkpoint_dir") and Path(ckpt.checkpoint_dir).exists():
        folder = Path(ckpt.checkpoint_dir)
        files = ckpt.get("checkpoint_files")
        if isinstance(files, (list, ListConfig)):
            for name in files:
                if not (folder / str(name)).exists():
                    missing.append(
                        f"checkpointer.checkpoint_files: {folder / str(name)} does not exist"
                    )
        weights = [f"checkpointer.checkpoint_dir: {folder}/{why}"  # each why names a file
                   for why in index_problems(folder) + _damaged_weights(folder, files)]
    if damaged or weights:
        in_step = ckpt is not None and (Path(str(ckpt.get("checkpoint_dir"))).expanduser()
                                        / COMPLETE_MARKER).is_file()
        raise CheckpointError("; ".join([*damaged.values(), *weights]) + (
            " (use another step_N folder, or copy the damaged model files from the run's base "
            "model folder)" if in_step else " (download the model again, or copy the files "
            "from an intact copy of it)"))
    if missing:
        raise FileNotFoundError(_missing_message(cfg, missing))


def _missing_message(cfg: DictConfig, missing: list[str]) -> str:
    """What to do about ``missing`` input files: download the model only when its folder is
    absent; in a folder that exists, set the keys (or read the folder whatever its layout)."""
    ckpt = cfg.get("checkpointer")
    folder = Path(str(ckpt.get("checkpoint_dir") or "")).expanduser() if ckpt else Path("")
    listing = "; ".join(missing)
    if not str(folder) or str(folder) == "." or not folder.is_dir():
        where = f"the model folder {folder} does not exist" if str(folder) not in ("", ".") \
            else "the model is not there"
        return (f"input files not found: {where} (download the model, e.g. `tune download "
                f"ORG/NAME --output-dir {folder}`, or set model_dir): {listing}")
    return (f"input files not found in the model folder {folder}: {listing}. Set these keys to "
            "the folder's files, or use a config that reads any Hugging Face folder whatever "
            "its layout (torchtune_grpo.models.hf_model, hf_tokenizer, hf_checkpointer): "
            f"`tune-grpo init {folder}` writes one")


def _damaged_weights(folder: Path, files: Any) -> list[str]:
    """The safetensors files of ``folder`` (``files``, else every one) that are truncated or not
    safetensors, each with why.
    """
    from torchtune_grpo.checkpoints.step_folder import safetensors_problem

    if isinstance(files, (list, ListConfig)):
        paths = [folder / str(name) for name in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    return [f"{path.name} is {why}" for path in paths
            if path.suffix == ".safetensors" and path.is_file()
            and (why := safetensors_problem(path)) is not None]


def check_device(name: str) -> None:
    """The config's ``device`` exists on this machine (torchtune would silently fall back to CPU).

    Raises:
        ConfigError: naming the key, the device and what this machine has.
    """
    import torch

    kind = str(name).split(":")[0]
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
                 "mps": torch.backends.mps.is_available()}
    if kind in available and not available[kind]:
        build = torch.__version__
        have = "; ".join(k for k, ok in available.items() if ok)
        raise ConfigError(f"config key 'device' is {name!r} but this machine has no {kind} "
                          f"device (torch {build}; available: {have}); set device=cpu, or run "
                          "where the device is")
