"""The config tree of the GRPO recipes: every key they read, as a typed dataclass field.

:class:`RecipeConfig`, :class:`AsyncConfig` and :class:`EvalConfig` declare each top-level
key with :func:`~torchtune_grpo.config.settings.key` (a nested block is a field typed by its
settings dataclass). :data:`RECIPE_KEYS`, :data:`ASYNC_KEYS`, :data:`EVAL_KEYS`,
:func:`with_defaults`, validation, ``tune-grpo validate`` and the docs' config reference
are read from them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from torchtune_grpo.config.settings import (
    REQUIRED,
    AdvantageSettings,
    Component,
    DynamicSamplingSettings,
    HealthSettings,
    Key,
    key,
    keys_of,
)
from torchtune_grpo.evaluation.settings import EvalSettings

__all__ = ["ASYNC_KEYS", "ASYNC_RECIPE", "EVAL_KEYS", "EVAL_RECIPE", "MAX_GROUP_SIZE",
           "MAX_SEQ_LEN", "RECIPE_KEYS", "REQUIRED", "TRAINING_RECIPES", "AsyncConfig",
           "EvalConfig", "Key", "RecipeConfig", "keys_for", "per_rank_batch_size",
           "recipes_for", "with_defaults"]

#: Sanity limits: a value above them is a typo, not a plan (they allocate at once).
MAX_GROUP_SIZE = 4096
MAX_SEQ_LEN = 2**22


def _positive(v) -> str | None:
    return None if v > 0 else "must be > 0"


def _at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"must be >= {n}"


def _optional_positive(v) -> str | None:
    return None if v is None or v > 0 else "must be > 0 or null"


def _tool_syntax_problem(value) -> str | None:
    """What is wrong with a ``tool_syntax:`` mapping (format, unknown keys, bad templates)."""
    from torchtune_grpo.rollout.tools.build import make_tool_syntax

    try:
        make_tool_syntax(value)
    except (ValueError, TypeError) as e:
        return str(e).replace("config key 'tool_syntax' ", "")
    return None


@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """Every top-level key of ``grpo_full_finetune_distributed`` and
    ``grpo_full_finetune_single_device``; ``docs/config_reference.md`` lists them."""

    output_dir: str = key(REQUIRED, "Folder for checkpoints (``step_{N}/``) and logs.")
    model_dir: str | None = key(
        None,
        "Folder of the input model; the shipped configs point ``checkpointer`` and "
        "``tokenizer`` at it by interpolation (``${model_dir}``).")
    seed: int = key(0, "Seed of every random generator (sampling, shuffling, init).",
                    lambda v: None if 0 <= v < 2**32 else "must be in [0, 2**32)")
    device: str = key("cuda", "``cuda`` or ``cpu``.")
    dtype: str = key("bf16", "Parameter dtype: ``fp32`` or ``bf16``.",
                     lambda v: None if v in ("fp32", "bf16") else "must be fp32 or bf16")
    batch_size: int | None = key(None,
                                 "Prompts per rank per step (or set ``global_batch_size``).",
                                 _optional_positive)
    global_batch_size: int | None = key(
        None,
        "Prompts per step over all ranks; when set, ``batch_size`` is derived from it and it "
        "must divide evenly across ranks.", _optional_positive)
    group_size: int = key(REQUIRED, "Completions sampled per prompt (>= 2).",
                          lambda v: None if 2 <= v <= MAX_GROUP_SIZE
                          else f"must be in [2, {MAX_GROUP_SIZE}]")
    forward_batch_size: int | None = key(
        None,
        "Sequences per generation / forward micro-batch; must divide ``batch_size * "
        "group_size``. Null: the whole rank batch at once.", _optional_positive)
    rollout_batch_size: int | None = key(
        None,
        "Rows the native engine decodes at once (one KV cache of this many rows, counted by "
        "``tune-grpo estimate-memory``); must divide the rows of one rollout call, ``batch_size "
        "* group_size / gradient_accumulation_steps`` per rank. Null: all of them on CUDA (one "
        "decode batch for the whole rollout: every decode step a large matmul); "
        "``forward_batch_size`` on CPU (where smaller batches that shed stopped rows are "
        "faster).", _optional_positive)
    stop_check_interval: int | None = key(
        None,
        "Decode steps between the native engine's checks of whether every row has stopped: "
        "the loop's only host reads and, with several ranks, its only collective; stopped rows "
        "decode padding in between, and the trajectory is the same for any value. Null: 1 on "
        "CPU (a check costs nothing there and lets the batch shed stopped rows early), 16 on "
        "CUDA (a sync per token would stall the GPU's queue; 16 wastes at most 15 padding "
        "steps per rollout).", _optional_positive)
    max_generated_tokens: int = key(REQUIRED, "Most tokens generated per completion.",
                                    _at_least(1))
    temperature: float = key(1.0, "Sampling temperature (> 0).", _positive)
    top_k: int | None = key(None, "Top-k sampling; null samples from the full vocabulary.",
                            _optional_positive)
    ppo_epochs: int = key(1, "Optimizer steps taken on each rollout batch.", _at_least(1))
    gradient_accumulation_steps: int = key(
        1,
        "Not torchtune's meaning: this does NOT enlarge the effective batch. Each step's "
        "``batch_size`` prompts are rolled out and scored in this many sequential chunks "
        "(``batch_size / N`` prompts each), which bounds generation memory; the update then "
        "uses the whole batch, so the result equals one chunk of ``batch_size``. For a larger "
        "effective batch raise ``batch_size`` (or ``global_batch_size``) and raise this key "
        "with it to keep generation memory flat.",
        _at_least(1))
    num_steps: int = key(REQUIRED, "GRPO steps (rollout + update) to run.", _at_least(1))
    save_every_n_steps: int | None = key(
        None,
        "Write ``output_dir/step_{N}`` every N steps (and at the end).",
        _optional_positive)
    keep_last_n_checkpoints: int | None = key(None,
                                              "Delete older step checkpoints beyond this many.",
                                              _optional_positive)
    eval_every_n_steps: int | None = key(
        None,
        "Evaluate on ``eval_dataset`` every N steps and at the end; the "
        "results go into that step's checkpoint (null: never).",
        _optional_positive)
    eval_dataset: Component | None = key(
        None,
        "Held-out prompt dataset (takes ``tokenizer``); null (also "
        "``eval_dataset=null`` on the command line): no evaluation at all, "
        "whatever ``eval_every_n_steps`` and ``eval_at_start`` say.")
    eval: EvalSettings | None = key(
        None,
        "Evaluation sampling: ``num_samples``, ``temperature`` (0: greedy), ``top_k``, "
        "``k`` (list), ``max_generated_tokens``, ``forward_batch_size`` (the fields of "
        ":class:`torchtune_grpo.evaluation.settings.EvalSettings`; unknown keys are "
        "errors).")
    eval_at_start: bool = key(True, "Also evaluate before the first step (logged as step 0).")
    overwrite_output_dir: bool = key(
        False,
        "A fresh run (no ``resume_from_checkpoint``) into an ``output_dir`` that holds step "
        "checkpoints deletes them first; false (default): it refuses to start, naming them.")
    resume_from_checkpoint: bool | str = key(
        False,
        "Continue from the newest complete ``step_{N}`` (or a path). Every key that differs "
        "from the step's saved config is listed at start; it takes effect, over the restored "
        "optimizer and scheduler state too.")
    resume_allow_changes: bool = key(
        False,
        "A resume whose config changes what the run means (``seed``, the global batch, "
        "``group_size``, ``dataset``, ``shuffle``, ``model``, ``model_dir``, ``tokenizer``, "
        "the checkpointer's ``checkpoint_dir``/``checkpoint_files``/``model_type``) "
        "continues anyway, and records the change in the recipe state; "
        "false (default): it stops, naming the key.")
    model: Component = key(REQUIRED, "torchtune model builder.")
    tokenizer: Component = key(REQUIRED, "torchtune tokenizer builder.")
    checkpointer: Component = key(REQUIRED, "torchtune checkpointer that loads the model.")
    dataset: Component = key(REQUIRED, "Prompt dataset builder (takes ``tokenizer``).")
    rewards: list[Component] = key(REQUIRED, "Reward components, each with a ``weight``.")
    loss: Component = key(REQUIRED, "GRPO loss (``torchtune_grpo.algorithm.loss.GRPOLoss``).")
    generator: Component | None = key(
        None,
        "Rollout engine. null: ``torchtune_grpo.rollout.native.NativeGenerator`` (KV-cache "
        "sampling on the policy itself); ``torchtune_grpo.rollout.vllm_engine.VLLMGenerator``: "
        "a colocated vLLM engine per rank that receives the policy's weights after every "
        "update (``pip install \"torchtune-grpo[vllm]\"``).")
    tools: list[Component] | None = key(
        None,
        "Tools the policy may call inside a rollout (multi-turn): a list of ``{_component_: "
        "...}`` entries, e.g. ``torchtune_grpo.rollout.tools.calculator.Calculator``. A row "
        "pauses when it closes a call (``<calculator>12*7</calculator>``), the tool's result "
        "is appended as tokens that are context, never actions (``tool_mask``: no log-prob, "
        "no loss, in no normaliser), and the row continues. null or an empty list: "
        "single-turn rollouts. Built at validation, so a bad entry fails before any model "
        "loads. Not supported with ``VLLMGenerator``.")
    max_tool_calls: int = key(4,
                              "Most tool results per completion (``tools`` only; 0: no tool runs).",
                              _at_least(0))
    tool_syntax: dict[str, str] | None = key(
        None,
        "How calls and results are written (``tools`` only). ``format: tags`` (the default): "
        "``call_open`` (default ``<{name}>``), ``call_close`` (``</{name}>``), "
        "``result_open`` (``<result>``), ``result_close`` (``</result>``); ``{name}`` is the "
        "tool's name (the fields of "
        ":class:`torchtune_grpo.rollout.tools.syntax.ToolCallSyntax`). "
        "``format: chat_template``: the tokenizer's chat-template format, a JSON call "
        "``<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>`` answered by the "
        "template's rendering of a ``{\"role\": \"tool\"}`` message; optional ``call_open`` "
        "(``<tool_call>``) and ``call_close`` (``</tool_call>``) (the fields of "
        ":class:`torchtune_grpo.rollout.tools.chat_template.ChatTemplateToolSyntax`). Needs a "
        "tokenizer whose chat template renders tool calls and tool messages "
        "(``torchtune_grpo.models.hf_tokenizer``).", _tool_syntax_problem)
    optimizer: Component = key(REQUIRED, "Optimizer (``params`` is filled in).")
    lr_scheduler: Component | None = key(None, "LR scheduler (``optimizer`` is filled in).")
    metric_logger: Component | None = key(None, "torchtune metric logger.")
    advantages: AdvantageSettings | None = key(
        None,
        "``estimator`` (grpo/rloo/reinforce_pp), ``scale`` "
        "(grpo: group/batch/none) and "
        "``eps`` of the group advantages (the "
        "fields of :class:`torchtune_grpo.config.settings.AdvantageSettings`; "
        "unknown keys are errors).")
    mask_truncated_completions: bool = key(
        False,
        "Completions that hit max_generated_tokens without a stop token add nothing to the "
        "loss or its normaliser (DAPO's overlong filtering).")
    exclude_zero_std_groups: bool = key(
        False,
        "Groups whose rewards are all equal (zero advantage) add nothing to the loss or its "
        "normaliser; they are always counted in zero_std_group_fraction.")
    share_prompt_forward: bool = key(
        True,
        "With ``packed_forward``: the rollouts of a group run their common prompt once in the "
        "update's (and the reference's) forward passes, each response attending to it "
        "(``SharedPrefixSegments``); the update's micro-batches keep groups together. Same "
        "log-probs and gradients up to float rounding, ``G - 1`` prompts fewer per group.")
    skip_zero_advantage_sequences: bool = key(
        True,
        "Leave rollouts whose advantage is exactly 0 (groups whose rewards all tie) out of the "
        "update's forward and backward passes: they add nothing to the gradient unless the loss "
        "has a KL or entropy term (then nothing is skipped); they still count in the loss "
        "normaliser. The step's ``entropy``, ``clip_fraction`` and ``ratio`` metrics then cover "
        "the rollouts that were run.")
    dynamic_sampling: DynamicSamplingSettings | None = key(
        None,
        "DAPO's dynamic sampling: groups whose rewards all tie are dropped and up to "
        "``max_batches`` extra batches of prompts are drawn (a pure function of seed, step and "
        "draw) and rolled out until every rank has ``batch_size`` groups with a signal; "
        "short of that, tied groups complete the batch. The field of "
        ":class:`torchtune_grpo.config.settings.DynamicSamplingSettings`; null: off.")
    run_health: HealthSettings | None = key(
        {},
        "When to warn that a run is not learning (no signal, length collapse, reward hacking), "
        "in the log, as ``health/...`` metrics and in a summary at the end: the fields of "
        ":class:`torchtune_grpo.config.settings.HealthSettings` (``{}``: the defaults); "
        "null: off.")
    clip_grad_norm: float | None = key(None, "Clip the gradient norm (null: no clipping).",
                                       _optional_positive)
    log_every_n_steps: int = key(1, "Log metrics every N steps.", _at_least(1))
    log_peak_memory_stats: bool = key(True, "Log ``peak_memory_gb`` where measurable.")
    enable_activation_checkpointing: bool = key(False,
                                                "Recompute activations in the backward pass.")
    enable_activation_offloading: bool = key(
        False,
        "Move checkpointed activations to CPU during the update (CUDA only, needs "
        "enable_activation_checkpointing): less GPU memory for some PCIe traffic.")
    packed_forward: bool | None = key(
        None,
        "The update's forward/backward and the reference and old log-prob passes run on each "
        "micro-batch's real tokens laid end to end in one row (attention per row), not on its "
        "padded rectangle: the same log-probs and gradients to float rounding, at the cost of "
        "the real tokens. false: each micro-batch is trimmed to its longest prompt and "
        "response only. null (the default): packed, unless ``compile: true`` (the per-row "
        "attention would recompile for every set of lengths); true with ``compile: true`` is "
        "a config error naming both keys.")
    compile: bool = key(
        False,
        "torch.compile each transformer layer of the policy (torchtune's compile_model): faster "
        "steps after a compile delay at start and on new shapes.")
    keep_freed_cpu_memory: bool = key(
        True,
        "``device: cpu`` on Linux/glibc: memory the process frees stays in it for reuse "
        "(:func:`torchtune_grpo.backends.allocator.keep_freed_memory`: no mmap-served blocks, "
        "no heap trimming below 2 GiB) instead of going back to the kernel and being "
        "page-faulted in again for the next tensor of that size; the update runs faster, and the "
        "process's resident memory stays near its peak. Skipped when the environment sets a "
        "glibc malloc variable (``MALLOC_*_``, ``GLIBC_TUNABLES``). No effect on GPU devices.")
    fsdp_cpu_offload: bool = key(False, "Keep FSDP parameters and optimizer state on CPU.")
    fsdp_reshard_after_forward: bool = key(True, "FSDP2 ``reshard_after_forward``.")
    fsdp_reduce_dtype: str = key(
        "fp32",
        "Several ranks (FSDP2): the dtype in which each backward reduce-scatters (sums and "
        "averages) the ranks' gradients, FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype, "
        "reduce_dtype=...)``. ``fp32``: a bf16 model's gradients are upcast, summed over the "
        "ranks in float32 and rounded to bf16 once (a reduce-scatter buffer twice as big, one "
        "layer at a time); ``bf16``: summed in bf16, rounded at every step of the reduction. "
        "The reduced shard is stored in the parameters' dtype and the update reduces at every "
        "micro-batch, so gradients accumulate over micro-batches in ``dtype``. No effect with "
        "``dtype: fp32`` or on one device.",
        lambda v: None if v in ("fp32", "bf16") else "must be fp32 or bf16")
    rollout_gather_weights: bool = key(
        True,
        "Several ranks (FSDP2): all-gather the policy's weights once for the whole rollout "
        "(and for the no-grad reference/old log-prob passes and the evaluation) and free them "
        "before the update, instead of once per forward, i.e. per decode step. Costs one "
        "unsharded copy of the weights during those phases; false: FSDP's per-forward "
        "gathering. No effect on one device.")
    save_adapter_weights_only: bool = key(
        False,
        "LoRA: save only the adapters (PEFT format), not the merged weights as well.")
    max_consecutive_skipped_steps: int = key(
        5,
        "Stop (after saving a checkpoint) when this many optimizer steps in a row had a "
        "non-finite loss or gradient.", _at_least(1))
    distributed_timeout_s: float = key(
        600.0,
        "Collective timeout: a rank waiting longer on a dead peer raises instead of hanging.",
        _positive)
    logprob_chunk_size: int | None = key(
        None,
        "Response positions per chunk of the output projection and log-softmax; peak memory "
        "holds a few ``[chunk, V]`` float32 blocks. null: ``2**25 // V`` rounded down to a "
        "multiple of 16 (256 for a 128k vocabulary).", _optional_positive)
    logprob_keep_probs_mib: int = key(
        512,
        "MiB of float32 softmax blocks that the update's log-prob forward keeps for its "
        "backward (whole chunks, first ones first); the backward reuses them instead of "
        "recomputing those chunks' logits and softmax (one output-projection matmul and one "
        "softmax pass fewer each). It costs up to this much memory per micro-batch while the "
        "update runs; 0 recomputes every chunk, the least memory.", _at_least(0))
    shuffle: bool = key(True, "Shuffle the prompt dataset each epoch.")
    progress_bar: bool = key(True, "Show a tqdm progress bar on rank 0.")


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Keys of ``async_grpo_full_finetune_distributed`` beyond :class:`RecipeConfig`
    (``docs/async.md``)."""

    rollout_ranks: int = key(
        1,
        "Ranks of the torchrun world that only generate (one engine each, holding the whole "
        "policy); the others train it with FSDP2. Must be below the world size and divide "
        "the number of trainer ranks.", _at_least(1))
    max_staleness: int = key(
        1,
        "k: the batch of step t is sampled by the policy after max(0, t - k) updates, whatever "
        "the timing, so a run is reproducible. 0 is the synchronous algorithm; 1 is "
        "one-step-off: generation of step t+1 overlaps the update of step t.", _at_least(0))


def _same_as(name: str) -> Any:
    """A field declared like :class:`RecipeConfig`'s ``name``: same default, meaning and
    check."""
    f = RecipeConfig.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, default_factory=f.default_factory,
                             metadata=f.metadata)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Every top-level key of ``grpo_eval``; a key it shares with :class:`RecipeConfig` keeps
    that key's type, default, meaning and check, and the sampling keys take their defaults from
    :class:`~torchtune_grpo.evaluation.settings.EvalSettings`."""

    checkpoint_dir: str = key(
        REQUIRED,
        "The checkpoint to evaluate; results are written into it unless ``eval_output_dir`` is "
        "set.")
    eval_output_dir: str | None = key(
        None,
        "Folder for the results (``eval_results.json``, ``eval_samples.jsonl``, and while it "
        "runs the per-rank partial files that a rerun of a stopped evaluation continues from), "
        "created if absent; use it when ``checkpoint_dir`` is read-only or shared, or to keep "
        "several evaluations of one checkpoint apart. An earlier evaluation's files there are "
        "replaced, as in the checkpoint folder, and the log names them at start. null: "
        "``checkpoint_dir``.")
    seed: int = _same_as("seed")
    device: str = _same_as("device")
    dtype: str = _same_as("dtype")
    model: Component = _same_as("model")
    tokenizer: Component = _same_as("tokenizer")
    checkpointer: Component = _same_as("checkpointer")
    dataset: Component = _same_as("dataset")
    rewards: list[Component] = _same_as("rewards")
    top_k: int | None = _same_as("top_k")
    progress_bar: bool = _same_as("progress_bar")
    model_dir: str | None = _same_as("model_dir")
    num_samples: int = key(EvalSettings.num_samples, "Completions per problem.", _at_least(1))
    temperature: float = key(EvalSettings.temperature, "Sampling temperature; 0 is greedy.",
                             lambda v: None if v >= 0 else "must be >= 0")
    k: list[int] = key(EvalSettings().k,
                       "Budgets reported as pass@k and maj@k (each <= num_samples).")
    max_generated_tokens: int = key(REQUIRED, "Most tokens generated per completion.",
                                    _at_least(1))
    forward_batch_size: int = key(EvalSettings.forward_batch_size,
                                  "Sequences per generation micro-batch.", _at_least(1))
    tools: list[Component] | None = key(
        None,
        "Tools of a multi-turn evaluation (as in training). Omitted: the ``tools``, "
        "``max_tool_calls`` and ``tool_syntax`` the checkpoint was trained with (read from "
        "its ``recipe_state.pt``); null: single-turn.")
    max_tool_calls: int = _same_as("max_tool_calls")
    tool_syntax: dict[str, str] | None = _same_as("tool_syntax")


#: The keys of :class:`RecipeConfig`, by name (``docs/`` lists them).
RECIPE_KEYS: dict[str, Key] = keys_of(RecipeConfig)
#: The keys of :class:`AsyncConfig`, by name.
ASYNC_KEYS: dict[str, Key] = keys_of(AsyncConfig)
#: The keys of :class:`EvalConfig`, by name.
EVAL_KEYS: dict[str, Key] = keys_of(EvalConfig)


#: The recipes that run a config of :class:`RecipeConfig` (either one: same keys, same step).
TRAINING_RECIPES = ("grpo_full_finetune_distributed", "grpo_full_finetune_single_device")
#: The recipe of a config that sets a key of :class:`AsyncConfig`.
ASYNC_RECIPE = "async_grpo_full_finetune_distributed"
#: The recipe of a config of :class:`EvalConfig`.
EVAL_RECIPE = "grpo_eval"


def _is_eval_config(names: set[str]) -> bool:
    """Whether top-level keys ``names`` are a ``grpo_eval`` config's: it names
    ``checkpoint_dir``, or it has other keys only :class:`EvalConfig` has (``num_samples``,
    ``k``) and none that only the training trees have."""
    eval_only = set(EVAL_KEYS) - set(RECIPE_KEYS)
    training_only = (set(RECIPE_KEYS) | set(ASYNC_KEYS)) - set(EVAL_KEYS)
    return "checkpoint_dir" in names or bool(names & eval_only and not names & training_only)


def keys_for(cfg: DictConfig) -> tuple[dict[str, Key], dict[str, Key] | None]:
    """Which recipe a config is for, read from the keys only that recipe has.

    A key left to fill in (``checkpoint_dir: ???``) counts as present.

    Args:
        cfg: a loaded config.

    Returns:
        ``(schema, extra_keys)``: ``(EVAL_KEYS, None)`` for a ``grpo_eval`` config (it names
        ``checkpoint_dir``, or ``num_samples``/``k`` and no training key), ``(RECIPE_KEYS,
        ASYNC_KEYS)`` for the asynchronous recipe (it sets a key of :class:`AsyncConfig`), else
        ``(RECIPE_KEYS, None)``.
    """
    names = {str(name) for name in cfg}  # iterating, unlike ``in``, sees ``???`` keys
    if _is_eval_config(names):
        return EVAL_KEYS, None
    if names & set(ASYNC_KEYS):
        return RECIPE_KEYS, ASYNC_KEYS
    return RECIPE_KEYS, None


def recipes_for(cfg: DictConfig) -> tuple[str, ...]:
    """The recipes that run ``cfg`` (:func:`keys_for`): :data:`EVAL_RECIPE`,
    :data:`ASYNC_RECIPE`, or both :data:`TRAINING_RECIPES`."""
    schema, extra_keys = keys_for(cfg)
    if schema is EVAL_KEYS:
        return (EVAL_RECIPE,)
    return (ASYNC_RECIPE,) if extra_keys is not None else TRAINING_RECIPES


def with_defaults(cfg: DictConfig, schema: dict[str, Key] | None = None) -> DictConfig:
    """A copy of ``cfg`` with every key of ``schema`` that it omits set to the key's default (a
    nested block's: ``{}`` or null); the recipes then read ``cfg.key`` directly.

    Args:
        cfg: a validated config.
        schema: the recipe's keys (default :data:`RECIPE_KEYS`).

    Returns:
        A deep copy of ``cfg`` with the defaults filled in.
    """
    filled = copy.deepcopy(cfg)
    for name, spec in (schema if schema is not None else RECIPE_KEYS).items():
        if name not in filled and spec.default is not REQUIRED:
            filled[name] = copy.deepcopy(spec.default)
    return filled


def per_rank_batch_size(cfg: DictConfig, world_size: int) -> int:
    """Prompts per rank: ``global_batch_size / world_size`` when set, else ``batch_size``.

    Args:
        cfg: a config with ``batch_size`` or ``global_batch_size`` set.
        world_size: number of ranks sharing the global batch.

    Returns:
        The number of prompts each rank rolls out per step.
    """
    global_batch = cfg.get("global_batch_size")
    if global_batch is None:
        return int(cfg.batch_size)
    return int(global_batch) // world_size
