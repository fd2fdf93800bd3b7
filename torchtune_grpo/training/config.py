"""Config loading, shipped-config lookup and validation for the GRPO recipes.

* ``--config grpo/<name>`` (or ``<name>``, with or without ``.yaml``) resolves to a YAML shipped
  in the package when no file of that name exists on disk; a real path always wins.
* ``key=value`` overrides work as in torchtune.
* A config may start from another with ``inherit: grpo/<name>`` (or a path): the named config
  is loaded first and this file's keys are merged over it (a node with a different
  ``_component_`` replaces the inherited node whole).
* :func:`validate_config` checks the whole config **before any model is loaded**: unknown keys
  (with the closest known key suggested), missing keys, types, impossible values and every
  ``_component_`` path, so a typo costs seconds, not a model load.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.resources
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.training.settings import (
    AdvantageSettings,
    DynamicSamplingSettings,
    EvalSettings,
    HealthSettings,
    sampling_problems,
    settings_from_config,
)

#: Package holding the shipped configs (``configs/`` in the source tree).
CONFIG_PACKAGE = "torchtune_grpo.configs"


# ---------------------------------------------------------------------------- lookup
def shipped_config_dir() -> Path:
    """Folder of the shipped configs (``<package>/configs``)."""
    return Path(str(importlib.resources.files(CONFIG_PACKAGE)))


def list_shipped_configs() -> list[str]:
    """Names (``grpo/<name>``) of every shipped config, sorted."""
    root = shipped_config_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """Path of the config ``name``: an existing file, else a shipped config.

    Raises:
        FileNotFoundError: neither a file nor a shipped config; lists the shipped ones.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = str(name)[:-5] if str(name).endswith(".yaml") else str(name)
    candidates = [stem, f"grpo/{stem}"]
    for candidate in candidates:
        shipped = shipped_config_dir() / f"{candidate}.yaml"
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(
        f"config {str(name)!r} is neither a file nor a shipped config. Shipped configs: "
        + ", ".join(list_shipped_configs())
    )


def load_config(config: str | Path, overrides: list[str] | None = None) -> DictConfig:
    """Load a config (path or shipped name) and apply ``key=value`` overrides."""
    from torchtune.config._utils import _merge_yaml_and_cli_args

    yaml_cfg = _load_with_inheritance(resolve_config_path(config), seen=())
    for item in overrides or []:
        if "=" not in item and not item.startswith("~"):
            raise ValueError(
                f"override {item!r} is not of the form key=value (use --config for the file)"
            )
    plain, direct = _split_overrides(yaml_cfg, list(overrides or []))
    namespace = argparse.Namespace(**OmegaConf.to_container(yaml_cfg, resolve=False))
    cfg = _merge_yaml_and_cli_args(namespace, plain)
    for key, raw in direct:
        _set_path(cfg, key, raw)
    return cfg


def _split_overrides(cfg: DictConfig, overrides: list[str]) -> tuple[list[str], list[tuple]]:
    """Overrides torchtune's parser handles, and ``(key, value)`` pairs it gets wrong: a key
    with a list index (``rewards.0.weight=0.5``) and ``null`` for a whole node
    (``eval_dataset=null``, which torchtune would read as ``eval_dataset._component_=null``)."""
    plain, direct = [], []
    for item in overrides:
        key, eq, raw = item.partition("=")
        parts = key.split(".")
        is_null = raw.strip() in ("null", "None", "~")
        if eq and not key.startswith("~") and (
                any(p.isdigit() for p in parts)
                or (is_null and isinstance(OmegaConf.select(cfg, key, default=None),
                                           DictConfig))):
            direct.append((key, raw))
        else:
            plain.append(item)
    return plain, direct


def _set_path(cfg: DictConfig, key: str, raw: str) -> None:
    """Set ``key`` (dotted, list indices allowed) to the YAML value ``raw``; a clear error for a
    path that does not exist (an index past the end of a list, a missing parent)."""
    import yaml

    value = yaml.safe_load(raw) if raw.strip() else ""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"override {key}={raw}: {'.'.join(parts[:depth]) or 'config'} "
                                 f"is a list of {len(node)} entries; {part!r} is not an index "
                                 "of it")
            node = node[int(part)]
        elif isinstance(node, DictConfig) and part in node and node[part] is not None:
            node = node[part]
        else:
            raise ValueError(f"override {key}={raw}: {where} is not in the config")
    last = parts[-1]
    if isinstance(node, ListConfig):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"override {key}={raw}: the list has {len(node)} entries; "
                             f"{last!r} is not an index of it")
        node[int(last)] = value
    else:
        node[last] = value


#: Top-level key naming a config this one starts from (merged first, this file on top).
INHERIT_KEY = "inherit"


def _load_with_inheritance(path: Path, seen: tuple[Path, ...]) -> DictConfig:
    """Load ``path``; when it has ``inherit: NAME``, merge it over that config."""
    if path.resolve() in seen:
        raise ValueError(f"config {path}: circular '{INHERIT_KEY}' chain")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"config {path} must be a mapping of keys to values")
    parent = cfg.pop(INHERIT_KEY, None)
    if parent is None:
        return cfg
    base = _load_with_inheritance(resolve_config_path(str(parent)), (*seen, path.resolve()))
    # a node given with a new _component_ replaces the inherited node instead of merging into it
    for key in list(cfg.keys()):
        node = cfg[key]
        if (isinstance(node, DictConfig) and "_component_" in node and key in base
                and isinstance(base[key], DictConfig)
                and base[key].get("_component_") != node["_component_"]):
            base.pop(key)
    return OmegaConf.merge(base, cfg)


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Decorator for a recipe's ``main``: ``--config NAME [key=value ...]`` from ``sys.argv``."""

    @functools.wraps(recipe_main)
    def wrapper() -> Any:
        parser = argparse.ArgumentParser(description=recipe_main.__doc__)
        parser.add_argument("--config", required=True, help="config path or shipped name")
        args, overrides = parser.parse_known_args()
        flags = [o for o in overrides if o.startswith("--")]
        if flags:
            parser.error(f"unsupported flags {flags}: use --config and key=value overrides")
        try:
            sys.exit(recipe_main(load_config(args.config, overrides)))
        except (ConfigError, FileNotFoundError, FileExistsError, PermissionError) as e:
            # a user mistake: one line, no traceback
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


# ---------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class Key:
    """One top-level config key: its type, default (``REQUIRED`` if none) and meaning.

    Attributes:
        type: accepted types, ``|``-separated (``int|null``, ``component``, ...).
        default: the value a config that omits the key gets (:func:`with_defaults`), or
            ``REQUIRED``.
        doc: what the key means (the config reference in ``docs/`` lists it).
        check: returns what is wrong with a (non-null) value, or None.
        settings: for a nested block, the settings dataclass it is read into
            (:mod:`torchtune_grpo.training.settings`); its fields are the block's keys.
    """

    type: str
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None
    settings: type | None = None


REQUIRED = object()
#: Sanity limits: a value above them is a typo, not a plan (they allocate at once).
MAX_GROUP_SIZE = 4096
MAX_SEQ_LEN = 2**22


def _positive(v) -> str | None:
    return None if v > 0 else "must be > 0"


def _at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"must be >= {n}"


def _optional_positive(v) -> str | None:
    return None if v is None or v > 0 else "must be > 0 or null"


def _tools_errors(value: Any, component_errors: list[str]) -> list[str]:
    """What is wrong with a ``tools:`` list: :func:`~torchtune_grpo.rollout.tools.build_tools`
    builds every entry (its error names ``tools[i]`` and the key at fault); nothing more is
    said about an entry whose component check already failed."""
    from torchtune_grpo.rollout.tools import build_tools

    if value is None or any(e.startswith("tools[") or "key tools[" in e
                            for e in component_errors):
        return []
    try:
        build_tools(value)
    except ValueError as e:
        return [str(e)]
    return []


def _tool_syntax_problem(value) -> str | None:
    """What is wrong with a ``tool_syntax:`` mapping (format, unknown keys, bad templates)."""
    from torchtune_grpo.rollout.tools import make_tool_syntax

    try:
        make_tool_syntax(value)
    except (ValueError, TypeError) as e:
        return str(e).replace("config key 'tool_syntax' ", "")
    return None


#: Every top-level key the GRPO recipes read. ``docs/`` lists this table.
RECIPE_KEYS: dict[str, Key] = {
    "output_dir": Key("str", REQUIRED, "Folder for checkpoints (``step_{N}/``) and logs."),
    "model_dir": Key("str|null", None,
                     "Folder of the input model; the shipped configs point ``checkpointer`` and "
                     "``tokenizer`` at it by interpolation (``${model_dir}``)."),
    "seed": Key("int", 0, "Seed of every random generator (sampling, shuffling, init).",
                lambda v: None if 0 <= v < 2**32 else "must be in [0, 2**32)"),
    "device": Key("str", "cuda", "``cuda`` or ``cpu``."),
    "dtype": Key("str", "bf16", "Parameter dtype: ``fp32`` or ``bf16``.",
                 lambda v: None if v in ("fp32", "bf16") else "must be fp32 or bf16"),
    "batch_size": Key("int|null", None,
                      "Prompts per rank per step (or set ``global_batch_size``).",
                      _optional_positive),
    "global_batch_size": Key(
        "int|null", None,
        "Prompts per step over all ranks; when set, ``batch_size`` is derived from it and it "
        "must divide evenly across ranks.", _optional_positive),
    "group_size": Key("int", REQUIRED, "Completions sampled per prompt (>= 2).",
                      lambda v: None if 2 <= v <= MAX_GROUP_SIZE
                      else f"must be in [2, {MAX_GROUP_SIZE}]"),
    "forward_batch_size": Key(
        "int|null", None,
        "Sequences per generation / forward micro-batch; must divide ``batch_size * "
        "group_size``. Null: the whole rank batch at once.", _optional_positive),
    "max_generated_tokens": Key("int", REQUIRED, "Most tokens generated per completion.",
                                _at_least(1)),
    "temperature": Key("float", 1.0, "Sampling temperature (> 0).", _positive),
    "top_k": Key("int|null", None, "Top-k sampling; null samples from the full vocabulary.",
                 _optional_positive),
    "ppo_epochs": Key("int", 1, "Optimizer steps taken on each rollout batch.", _at_least(1)),
    "gradient_accumulation_steps": Key(
        "int", 1,
        "Not torchtune's meaning: this does NOT enlarge the effective batch. Each step's "
        "``batch_size`` prompts are rolled out and scored in this many sequential chunks "
        "(``batch_size / N`` prompts each), which bounds generation memory; the update then "
        "uses the whole batch, so the result equals one chunk of ``batch_size``. For a larger "
        "effective batch raise ``batch_size`` (or ``global_batch_size``) and raise this key "
        "with it to keep generation memory flat.",
        _at_least(1)),
    "num_steps": Key("int", REQUIRED, "GRPO steps (rollout + update) to run.", _at_least(1)),
    "save_every_n_steps": Key("int|null", None,
                              "Write ``output_dir/step_{N}`` every N steps (and at the end).",
                              _optional_positive),
    "keep_last_n_checkpoints": Key("int|null", None,
                                   "Delete older step checkpoints beyond this many.",
                                   _optional_positive),
    "eval_every_n_steps": Key("int|null", None,
                              "Evaluate on ``eval_dataset`` every N steps and at the end; the "
                              "results go into that step's checkpoint (null: never).",
                              _optional_positive),
    "eval_dataset": Key("component|null", None,
                        "Held-out prompt dataset (takes ``tokenizer``); null (also "
                        "``eval_dataset=null`` on the command line): no evaluation at all, "
                        "whatever ``eval_every_n_steps`` and ``eval_at_start`` say."),
    "eval": Key("dict|null", None,
                "Evaluation sampling: ``num_samples``, ``temperature`` (0: greedy), ``top_k``, "
                "``k`` (list), ``max_generated_tokens``, ``forward_batch_size`` (the fields of "
                ":class:`torchtune_grpo.training.settings.EvalSettings`; unknown keys are errors).",
                settings=EvalSettings),
    "eval_at_start": Key("bool", True, "Also evaluate before the first step (logged as step 0)."),
    "overwrite_output_dir": Key(
        "bool", False,
        "A fresh run (no ``resume_from_checkpoint``) into an ``output_dir`` that holds step "
        "checkpoints deletes them first; false (default): it refuses to start, naming them."),
    "resume_from_checkpoint": Key("bool|str", False,
                                  "Continue from the newest complete ``step_{N}`` (or a path)."),
    "model": Key("component", REQUIRED, "torchtune model builder."),
    "tokenizer": Key("component", REQUIRED, "torchtune tokenizer builder."),
    "checkpointer": Key("component", REQUIRED, "torchtune checkpointer that loads the model."),
    "dataset": Key("component", REQUIRED, "Prompt dataset builder (takes ``tokenizer``)."),
    "rewards": Key("list", REQUIRED, "Reward components, each with a ``weight``."),
    "loss": Key("component", REQUIRED, "GRPO loss (``torchtune_grpo.algorithm.loss.GRPOLoss``)."),
    "generator": Key(
        "component|null", None,
        "Rollout engine. null: ``torchtune_grpo.rollout.native.NativeGenerator`` (KV-cache "
        "sampling on the policy itself); ``torchtune_grpo.rollout.vllm_engine.VLLMGenerator``: "
        "a colocated vLLM engine per rank that receives the policy's weights after every "
        "update (``pip install \"torchtune-grpo[vllm]\"``)."),
    "tools": Key(
        "list|null", None,
        "Tools the policy may call inside a rollout (multi-turn): a list of ``{_component_: "
        "...}`` entries, e.g. ``torchtune_grpo.rollout.tools.Calculator``. A row pauses when it "
        "closes a call (``<calculator>12*7</calculator>``), the tool's result is appended as "
        "tokens that are context, never actions (``tool_mask``: no log-prob, no loss, in no "
        "normaliser), and the row continues. null or an empty list: single-turn rollouts. "
        "Built at validation, so a bad entry fails before any model loads. Not supported with "
        "``VLLMGenerator``."),
    "max_tool_calls": Key("int", 4,
                          "Most tool results per completion (``tools`` only; 0: no tool runs).",
                          _at_least(0)),
    "tool_syntax": Key(
        "dict|null", None,
        "How calls and results are written (``tools`` only). ``format: tags`` (the default): "
        "``call_open`` (default ``<{name}>``), ``call_close`` (``</{name}>``), "
        "``result_open`` (``<result>``), ``result_close`` (``</result>``); ``{name}`` is the "
        "tool's name (the fields of :class:`torchtune_grpo.rollout.tools.ToolCallSyntax`). "
        "``format: chat_template``: the tokenizer's chat-template format, a JSON call "
        "``<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>`` answered by the "
        "template's rendering of a ``{\"role\": \"tool\"}`` message; optional ``call_open`` "
        "(``<tool_call>``) and ``call_close`` (``</tool_call>``) (the fields of "
        ":class:`torchtune_grpo.rollout.tools.ChatTemplateToolSyntax`). Needs a tokenizer whose "
        "chat template renders tool calls and tool messages "
        "(``torchtune_grpo.models.hf_tokenizer``).", _tool_syntax_problem),
    "optimizer": Key("component", REQUIRED, "Optimizer (``params`` is filled in)."),
    "lr_scheduler": Key("component|null", None, "LR scheduler (``optimizer`` is filled in)."),
    "metric_logger": Key("component|null", None, "torchtune metric logger."),
    "advantages": Key("dict|null", None,
                      "``scale`` (group/batch/none) and ``eps`` of the group advantages (the "
                      "fields of :class:`torchtune_grpo.training.settings.AdvantageSettings`; unknown "
                      "keys are errors).", settings=AdvantageSettings),
    "mask_truncated_completions": Key(
        "bool", False,
        "Completions that hit max_generated_tokens without a stop token add nothing to the "
        "loss or its normaliser (DAPO's overlong filtering)."),
    "exclude_zero_std_groups": Key(
        "bool", False,
        "Groups whose rewards are all equal (zero advantage) add nothing to the loss or its "
        "normaliser; they are always counted in zero_std_group_fraction."),
    "share_prompt_forward": Key(
        "bool", True,
        "With ``packed_forward``: the rollouts of a group run their common prompt once in the "
        "update's (and the reference's) forward passes, each response attending to it "
        "(``SharedPrefixSegments``); the update's micro-batches keep groups together. Same "
        "log-probs and gradients up to float rounding, ``G - 1`` prompts fewer per group."),
    "skip_zero_advantage_sequences": Key(
        "bool", True,
        "Leave rollouts whose advantage is exactly 0 (groups whose rewards all tie) out of the "
        "update's forward and backward passes: they add nothing to the gradient unless the loss "
        "has a KL or entropy term (then nothing is skipped); they still count in the loss "
        "normaliser. The step's ``entropy``, ``clip_fraction`` and ``ratio`` metrics then cover "
        "the rollouts that were run."),
    "dynamic_sampling": Key(
        "dict|null", None,
        "DAPO's dynamic sampling: groups whose rewards all tie are dropped and up to "
        "``max_batches`` extra batches of prompts are drawn (a pure function of seed, step and "
        "draw) and rolled out until every rank has ``batch_size`` groups with a signal; "
        "short of that, tied groups complete the batch. The field of "
        ":class:`torchtune_grpo.training.settings.DynamicSamplingSettings`; null: off.",
        settings=DynamicSamplingSettings),
    "run_health": Key(
        "dict|null", {},
        "When to warn that a run is not learning (no signal, length collapse, reward hacking), "
        "in the log, as ``health/...`` metrics and in a summary at the end: the fields of "
        ":class:`torchtune_grpo.training.settings.HealthSettings` (``{}``: the defaults); null: off.",
        settings=HealthSettings),
    "clip_grad_norm": Key("float|null", None, "Clip the gradient norm (null: no clipping).",
                          _optional_positive),
    "log_every_n_steps": Key("int", 1, "Log metrics every N steps.", _at_least(1)),
    "log_peak_memory_stats": Key("bool", True, "Log ``peak_memory_gb`` where measurable."),
    "enable_activation_checkpointing": Key("bool", False,
                                           "Recompute activations in the backward pass."),
    "enable_activation_offloading": Key(
        "bool", False,
        "Move checkpointed activations to CPU during the update (CUDA only, needs "
        "enable_activation_checkpointing): less GPU memory for some PCIe traffic."),
    "packed_forward": Key(
        "bool", True,
        "The update's forward/backward and the reference and old log-prob passes run on each "
        "micro-batch's real tokens laid end to end in one row (attention per row), not on its "
        "padded rectangle: the same log-probs and gradients to float rounding, at the cost of "
        "the real tokens. false: each micro-batch is trimmed to its longest prompt and "
        "response only. Not used with ``compile`` (the per-row attention would recompile for "
        "every set of lengths)."),
    "compile": Key(
        "bool", False,
        "torch.compile each transformer layer of the policy (torchtune's compile_model): faster "
        "steps after a compile delay at start and on new shapes."),
    "keep_freed_cpu_memory": Key(
        "bool", True,
        "``device: cpu`` on Linux/glibc: memory the process frees stays in it for reuse "
        "(:func:`torchtune_grpo.backends.allocator.keep_freed_memory`: no mmap-served blocks, no heap "
        "trimming below 2 GiB) instead of going back to the kernel and being page-faulted in "
        "again for the next tensor of that size; the update runs faster, and the process's "
        "resident memory stays near its peak. Skipped when the environment sets a glibc malloc "
        "variable (``MALLOC_*_``, ``GLIBC_TUNABLES``). No effect on GPU devices."),
    "fsdp_cpu_offload": Key("bool", False, "Keep FSDP parameters and optimizer state on CPU."),
    "fsdp_reshard_after_forward": Key("bool", True, "FSDP2 ``reshard_after_forward``."),
    "rollout_gather_weights": Key(
        "bool", True,
        "Several ranks (FSDP2): all-gather the policy's weights once for the whole rollout "
        "(and for the no-grad reference/old log-prob passes and the evaluation) and free them "
        "before the update, instead of once per forward, i.e. per decode step. Costs one "
        "unsharded copy of the weights during those phases; false: FSDP's per-forward "
        "gathering. No effect on one device."),
    "save_adapter_weights_only": Key(
        "bool", False,
        "LoRA: save only the adapters (PEFT format), not the merged weights as well."),
    "max_consecutive_skipped_steps": Key(
        "int", 5,
        "Stop (after saving a checkpoint) when this many optimizer steps in a row had a "
        "non-finite loss or gradient.", _at_least(1)),
    "distributed_timeout_s": Key(
        "float", 600.0,
        "Collective timeout: a rank waiting longer on a dead peer raises instead of hanging.",
        _positive),
    "logprob_chunk_size": Key(
        "int|null", None,
        "Response positions per chunk of the output projection and log-softmax; peak memory "
        "holds a few ``[chunk, V]`` float32 blocks. null: ``2**25 // V`` rounded down to a "
        "multiple of 16 (256 for a 128k vocabulary).", _optional_positive),
    "logprob_keep_probs_mib": Key(
        "int", 512,
        "MiB of float32 softmax blocks that the update's log-prob forward keeps for its "
        "backward (whole chunks, first ones first); the backward reuses them instead of "
        "recomputing those chunks' logits and softmax (one output-projection matmul and one "
        "softmax pass fewer each). It costs up to this much memory per micro-batch while the "
        "update runs; 0 recomputes every chunk, the least memory.", _at_least(0)),
    "shuffle": Key("bool", True, "Shuffle the prompt dataset each epoch."),
    "progress_bar": Key("bool", True, "Show a tqdm progress bar on rank 0."),
}

#: Keys of ``async_grpo_full_finetune_distributed`` beyond :data:`RECIPE_KEYS`
#: (``docs/async.md``).
ASYNC_KEYS: dict[str, Key] = {
    "rollout_ranks": Key(
        "int", 1,
        "Ranks of the torchrun world that only generate (one engine each, holding the whole "
        "policy); the others train it with FSDP2. Must be below the world size and divide "
        "the number of trainer ranks.", _at_least(1)),
    "max_staleness": Key(
        "int", 1,
        "k: the batch of step t is sampled by the policy after max(0, t - k) updates, whatever "
        "the timing, so a run is reproducible. 0 is the synchronous algorithm; 1 is "
        "one-step-off: generation of step t+1 overlaps the update of step t.", _at_least(0)),
}


def async_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """What stops ``cfg`` from running asynchronously on ``world_size`` ranks (roles, and the
    features the asynchronous recipe does not run); [] when it can."""
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
    """:func:`validate_config` for ``async_grpo_full_finetune_distributed`` on ``world_size``
    processes: the batch checks for the trainer ranks' share, then :func:`async_errors`.

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


#: Keys of ``grpo_eval`` (shared ones keep their meaning from :data:`RECIPE_KEYS`).
EVAL_KEYS: dict[str, Key] = {
    "checkpoint_dir": Key("str", REQUIRED,
                          "The checkpoint to evaluate; results are written into it."),
    **{k: RECIPE_KEYS[k] for k in ("seed", "device", "dtype", "model", "tokenizer",
                                   "checkpointer", "dataset", "rewards", "top_k",
                                   "progress_bar", "model_dir")},
    "num_samples": Key("int", EvalSettings.num_samples, "Completions per problem.",
                       _at_least(1)),
    "temperature": Key("float", EvalSettings.temperature, "Sampling temperature; 0 is greedy.",
                       lambda v: None if v >= 0 else "must be >= 0"),
    "k": Key("list", EvalSettings().k,
             "Budgets reported as pass@k and maj@k (each <= num_samples)."),
    "max_generated_tokens": Key("int", REQUIRED, "Most tokens generated per completion.",
                                _at_least(1)),
    "forward_batch_size": Key("int", EvalSettings.forward_batch_size,
                              "Sequences per generation micro-batch.", _at_least(1)),
    "tools": Key(
        "list|null", None,
        "Tools of a multi-turn evaluation (as in training). Omitted: the ``tools``, "
        "``max_tool_calls`` and ``tool_syntax`` the checkpoint was trained with (read from "
        "its ``recipe_state.pt``); null: single-turn."),
    **{k: RECIPE_KEYS[k] for k in ("max_tool_calls", "tool_syntax")},
}

_TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, (list, ListConfig)),
    "dict": lambda v: isinstance(v, (dict, DictConfig)),
    "null": lambda v: v is None,
    "component": lambda v: isinstance(v, (dict, DictConfig)) and "_component_" in v,
}


def _type_ok(type_spec: str, value: Any) -> bool:
    return any(_TYPES[t](value) for t in type_spec.split("|"))


def import_component(path: str, where: str) -> Any:
    """Import the object at dotted ``path``; errors name the config key ``where``."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{where}._component_ must be a dotted import path, got {path!r}")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        # the path may name a nested attribute (module.Class.method)
        if "." in module_name:
            try:
                return getattr(import_component(module_name, where), attr)
            except (ValueError, AttributeError):
                pass
        raise ValueError(f"{where}._component_: cannot import {path!r} ({e})") from e
    if not hasattr(module, attr):
        raise ValueError(f"{where}._component_: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _consumed_keys(node: Any, where: str, errors: list[str]) -> frozenset[str]:
    """Keys of a component node that are not arguments of the component.

    ``_component_``; on a ``rewards`` entry also the reward-set keys (``weight``, ``success``,
    ...), whose values :func:`~torchtune_grpo.rewards.reward_set.check_reward_entry` checks here
    (problems are appended to ``errors``; values still holding ``${...}`` are left alone).
    """
    head, _, index = where.partition("[")
    if head != "rewards" or not index.endswith("]") or not index[:-1].isdigit():
        return frozenset({"_component_"})
    from torchtune_grpo.rewards.reward_set import REWARD_ENTRY_KEYS, check_reward_entry

    resolved = {k: v for k, v in node.items() if not (isinstance(v, str) and "${" in v)}
    try:
        check_reward_entry(resolved, f"{where} ({node['_component_']})")
    except ValueError as e:
        errors.append(str(e))
    return REWARD_ENTRY_KEYS


#: Arguments the recipes pass to a top-level block's component themselves (so the config does
#: not give them): the datasets get the tokenizer, the scheduler the optimizer and the number
#: of steps; the optimizer's first (positional) argument, the parameters, is left out too.
_SUPPLIED_ARGUMENTS = {"dataset": {"tokenizer"}, "eval_dataset": {"tokenizer"},
                       "lr_scheduler": {"optimizer", "num_training_steps"}}


def _component_params(obj: Any) -> tuple[set[str], bool, list[str]] | None:
    """Parameter names of a component, whether it takes ``**kwargs``, and its parameters
    without a default in order (None: unknown)."""
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = {p.name for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    required = [p.name for p in sig.parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, takes_kwargs, required


#: Component arguments that count something (layers, heads, tokens): an integer below 1 is
#: an error whatever the component.
_COUNT_ARGUMENTS = frozenset({"vocab_size", "num_layers", "num_heads", "num_kv_heads",
                              "embed_dim", "intermediate_dim", "head_dim", "max_seq_len"})


def _argument_errors(where: str, node: Any, obj: Any) -> list[str]:
    """Component arguments whose value cannot fit the component's annotation (a list for a
    ``str``, a string for an ``int``), and counts below 1."""
    import inspect
    import typing

    from torchtune_grpo.training.settings import hint_name, value_fits

    errors = []
    for key, value in node.items():
        if (key in _COUNT_ARGUMENTS and isinstance(value, int) and not isinstance(value, bool)
                and value < 1):
            errors.append(f"config key {where}.{key} must be >= 1 (got {value!r})")
        if key == "max_seq_len" and isinstance(value, int) and value > MAX_SEQ_LEN:
            errors.append(f"config key {where}.{key} must be <= {MAX_SEQ_LEN} (got {value!r})")
    try:
        target = obj.__init__ if inspect.isclass(obj) else obj
        hints = typing.get_type_hints(target)
        defaults = {p.name: p.default for p in inspect.signature(obj).parameters.values()}
    except Exception:  # noqa: BLE001 (annotations that do not resolve are not checked)
        return errors
    for key, value in node.items():
        if key not in hints or key == "_component_" or key not in defaults:
            continue
        if value is None and defaults[key] is None:
            continue  # ``x: int = None`` without Optional
        if not value_fits(hints[key], value):
            errors.append(f"config key {where}.{key}: {node['_component_']} takes "
                          f"{hint_name(hints[key])}, got {value!r}")
    return errors


def _missing_arguments(where: str, node: Any, required: list[str], obj: Any) -> list[str]:
    """Required arguments of the component at ``where`` that neither the config nor the
    recipe gives."""
    import inspect

    if where.startswith(("rewards[", "tools[")) and not inspect.isclass(obj):
        return []  # a function reward or tool: its parameters are what it is called with
    supplied = set(_SUPPLIED_ARGUMENTS.get(where, ()))
    if where == "optimizer" and required:
        supplied.add(required[0])  # the parameters, passed positionally
    return [name for name in required if name not in node and name not in supplied]


def _check_components(node: Any, where: str, errors: list[str],
                      params_out: dict[str, set[str]] | None = None) -> None:
    if isinstance(node, (dict, DictConfig)):
        if "_component_" in node:
            try:
                obj = import_component(node["_component_"], where)
            except ValueError as e:
                errors.append(str(e))
                obj = None
            consumed = _consumed_keys(node, where, errors)
            info = _component_params(obj) if obj is not None else None
            if info is not None:
                names, takes_kwargs, required = info
                if params_out is not None:
                    params_out[where] = names
                errors.extend(_argument_errors(where, node, obj))
                errors.extend(
                    f"config key {where}.{name}: {node['_component_']} needs argument "
                    f"{name!r}, and the config does not give it"
                    for name in _missing_arguments(where, node, required, obj))
                if not takes_kwargs:
                    for key in node:
                        if key in consumed or key in names:
                            continue
                        close = difflib.get_close_matches(str(key), sorted(names), n=1)
                        hint = f" Did you mean {where}.{close[0]}?" if close else ""
                        errors.append(
                            f"config key {where}.{key}: {node['_component_']} takes no "
                            f"argument {key!r}.{hint}"
                        )
        for key, value in node.items():
            _check_components(value, f"{where}.{key}" if where else str(key), errors, params_out)
    elif isinstance(node, (list, ListConfig)):
        for i, value in enumerate(node):
            _check_components(value, f"{where}[{i}]", errors, params_out)


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem found."""


def _optimizer_range_errors(node: Any) -> list[str]:
    """Values of the ``optimizer:`` component whose meaning is known and out of range: ``lr``
    and ``weight_decay`` (finite, ``>= 0``; an lr of 0 is a control run), ``betas`` (each in
    ``[0, 1)``), ``eps`` (``> 0``), ``momentum`` (``>= 0``)."""
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


def validate_config(cfg: DictConfig, *, world_size: int = 1,
                    extra_keys: dict[str, Key] | None = None,
                    schema: dict[str, Key] | None = None) -> None:
    """Check ``cfg`` against :data:`RECIPE_KEYS` without building anything expensive.

    Args:
        cfg: the merged config.
        world_size: number of ranks the run will use (for batch divisibility).
        extra_keys: recipe-specific keys beyond the schema.
        schema: the recipe's keys (default :data:`RECIPE_KEYS`; ``grpo_eval``:
            :data:`EVAL_KEYS`).

    Raises:
        ConfigError: listing every problem, each naming its key.
    """
    known = {**(schema if schema is not None else RECIPE_KEYS), **(extra_keys or {})}
    errors: list[str] = []
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    component_params: dict[str, set[str]] = {}
    component_errors: list[str] = []
    _check_components(raw, "", component_errors, component_params)
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
        if not _type_ok(spec.type, value):
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
                settings_from_config(spec.settings, value, key, fixed=_FIXED.get(key))
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
    if not errors and schema is None:
        errors.extend(_batch_errors(cfg, world_size) or _build_errors(cfg, "loss"))
    if not errors and schema is EVAL_KEYS:
        errors.extend(_eval_errors(cfg))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


#: Fields of a nested block's settings that the recipe sets, not the block.
_FIXED: dict[str, dict[str, Any]] = {"eval": {"seed": 0}}


def with_defaults(cfg: DictConfig, schema: dict[str, Key] | None = None) -> DictConfig:
    """A copy of ``cfg`` with every key of ``schema`` that it omits set to the key's default.

    The recipes call this after :func:`validate_config` and then read ``cfg.key`` directly:
    a key's default lives only in its :class:`Key`.

    Args:
        cfg: a validated config.
        schema: the recipe's keys (default :data:`RECIPE_KEYS`).
    """
    import copy

    filled = copy.deepcopy(cfg)
    for key, spec in (schema if schema is not None else RECIPE_KEYS).items():
        if key not in filled and spec.default is not REQUIRED:
            filled[key] = copy.deepcopy(spec.default)
    return filled


def per_rank_batch_size(cfg: DictConfig, world_size: int) -> int:
    """Prompts per rank: ``global_batch_size / world_size`` when set, else ``batch_size``."""
    global_batch = cfg.get("global_batch_size")
    if global_batch is None:
        return int(cfg.batch_size)
    return int(global_batch) // world_size


def _build_errors(cfg: DictConfig, key: str) -> list[str]:
    """Build the cheap, pure component at ``key`` (the loss: its arguments' ranges are checked
    by its constructor) and report what it rejects as a config error naming the key."""
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
    tool calls and tool messages. Checked here when the tokenizer is an HF folder that exists
    (cheap to read); any other tokenizer is checked when the recipe builds it."""
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

    from torchtune_grpo.rollout.tools import build_tools, make_tool_syntax, tool_schema

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
    return errors


#: Keys of the ``model``, ``tokenizer`` and ``checkpointer`` nodes that name files or folders.
_PATH_KEYS = {
    "model": ("model_dir",),
    "tokenizer": ("path", "merges_file", "special_tokens_path"),
    "checkpointer": ("checkpoint_dir",),
}


def check_input_files(cfg: DictConfig) -> None:
    """Check that the tokenizer and checkpoint files a config names exist (before loading).

    Raises:
        FileNotFoundError: naming the config key and the missing path.
    """
    missing = []
    for node_name, keys in _PATH_KEYS.items():
        node = cfg.get(node_name)
        if node is None:
            continue
        for key in keys:
            value = node.get(key)
            if value is not None and not Path(str(value)).expanduser().exists():
                missing.append(f"{node_name}.{key}: {value} does not exist")
    ckpt = cfg.get("checkpointer")
    if ckpt is not None and ckpt.get("checkpoint_dir") and Path(ckpt.checkpoint_dir).exists():
        files = ckpt.get("checkpoint_files")
        if isinstance(files, (list, ListConfig)):
            for name in files:
                if not (Path(ckpt.checkpoint_dir) / str(name)).exists():
                    missing.append(
                        f"checkpointer.checkpoint_files: {Path(ckpt.checkpoint_dir) / str(name)} "
                        "does not exist"
                    )
    if missing:
        raise FileNotFoundError(
            "input files not found (download the model, or fix the paths):\n  - "
            + "\n  - ".join(missing)
        )
