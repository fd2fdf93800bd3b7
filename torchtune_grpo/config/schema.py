"""The config schema of the GRPO recipes: every key they read, with its type, default and meaning.

:data:`RECIPE_KEYS` (the training recipes), :data:`ASYNC_KEYS` (the asynchronous recipe's keys
beyond it) and :data:`EVAL_KEYS` (``grpo_eval``) are tables of :class:`Key`; the config
reference in ``docs/`` is generated from them, :mod:`torchtune_grpo.config.validation` checks
a config against them, and :func:`with_defaults` fills in what a config omits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from torchtune_grpo.config.settings import (
    AdvantageSettings,
    DynamicSamplingSettings,
    HealthSettings,
)
from torchtune_grpo.evaluation.settings import EvalSettings


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
            (:mod:`torchtune_grpo.config.settings`); its fields are the block's keys.
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


def _tool_syntax_problem(value) -> str | None:
    """What is wrong with a ``tool_syntax:`` mapping (format, unknown keys, bad templates)."""
    from torchtune_grpo.rollout.tools.build import make_tool_syntax

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
                ":class:`torchtune_grpo.evaluation.settings.EvalSettings`; unknown keys are "
                "errors).",
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
        "...}`` entries, e.g. ``torchtune_grpo.rollout.tools.calculator.Calculator``. A row "
        "pauses when it closes a call (``<calculator>12*7</calculator>``), the tool's result "
        "is appended as tokens that are context, never actions (``tool_mask``: no log-prob, "
        "no loss, in no normaliser), and the row continues. null or an empty list: "
        "single-turn rollouts. Built at validation, so a bad entry fails before any model "
        "loads. Not supported with ``VLLMGenerator``."),
    "max_tool_calls": Key("int", 4,
                          "Most tool results per completion (``tools`` only; 0: no tool runs).",
                          _at_least(0)),
    "tool_syntax": Key(
        "dict|null", None,
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
        "(``torchtune_grpo.models.hf_tokenizer``).", _tool_syntax_problem),
    "optimizer": Key("component", REQUIRED, "Optimizer (``params`` is filled in)."),
    "lr_scheduler": Key("component|null", None, "LR scheduler (``optimizer`` is filled in)."),
    "metric_logger": Key("component|null", None, "torchtune metric logger."),
    "advantages": Key("dict|null", None,
                      "``estimator`` (grpo/rloo/reinforce_pp), ``scale`` "
                      "(grpo: group/batch/none) and "
                      "``eps`` of the group advantages (the "
                      "fields of :class:`torchtune_grpo.config.settings.AdvantageSettings`; "
                      "unknown keys are errors).", settings=AdvantageSettings),
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
        ":class:`torchtune_grpo.config.settings.DynamicSamplingSettings`; null: off.",
        settings=DynamicSamplingSettings),
    "run_health": Key(
        "dict|null", {},
        "When to warn that a run is not learning (no signal, length collapse, reward hacking), "
        "in the log, as ``health/...`` metrics and in a summary at the end: the fields of "
        ":class:`torchtune_grpo.config.settings.HealthSettings` (``{}``: the defaults); "
        "null: off.",
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
        "response only. Conflicts with ``compile: true`` (the per-row attention would "
        "recompile for every set of lengths): a config error names both keys."),
    "compile": Key(
        "bool", False,
        "torch.compile each transformer layer of the policy (torchtune's compile_model): faster "
        "steps after a compile delay at start and on new shapes."),
    "keep_freed_cpu_memory": Key(
        "bool", True,
        "``device: cpu`` on Linux/glibc: memory the process frees stays in it for reuse "
        "(:func:`torchtune_grpo.backends.allocator.keep_freed_memory`: no mmap-served blocks, "
        "no heap trimming below 2 GiB) instead of going back to the kernel and being "
        "page-faulted in again for the next tensor of that size; the update runs faster, and the "
        "process's resident memory stays near its peak. Skipped when the environment sets a "
        "glibc malloc variable (``MALLOC_*_``, ``GLIBC_TUNABLES``). No effect on GPU devices."),
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


def with_defaults(cfg: DictConfig, schema: dict[str, Key] | None = None) -> DictConfig:
    """A copy of ``cfg`` with every key of ``schema`` that it omits set to the key's default.

    The recipes call this after :func:`~torchtune_grpo.config.validation.validate_config` and
    then read ``cfg.key`` directly: a key's default lives only in its :class:`Key`.

    Args:
        cfg: a validated config.
        schema: the recipe's keys (default :data:`RECIPE_KEYS`).

    Returns:
        A deep copy of ``cfg`` with the defaults filled in.
    """
    import copy

    filled = copy.deepcopy(cfg)
    for key, spec in (schema if schema is not None else RECIPE_KEYS).items():
        if key not in filled and spec.default is not REQUIRED:
            filled[key] = copy.deepcopy(spec.default)
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
