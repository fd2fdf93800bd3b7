"""The GRPO training loop shared by the single-device and distributed recipes.

One GRPO step (``docs/design.md``), each part a named method of :class:`GRPORecipe`:

1. **Prompts** (``self.batches.batch(step)``): each rank takes ``batch_size`` prompts from its
   shard of the dataset; a prompt's whole group stays on the rank that drew it.
2. **Rollout** (:meth:`~GRPORecipe.rollout`): ``group_size`` completions per prompt,
   KV-cached, padded to uniform shapes, with the generation-time log-probs
   (a :class:`~torchtune_grpo.rollout.protocol.Generator`).
3. **Score** (:meth:`~GRPORecipe.score`): the weighted sum of the reward components
   (:mod:`torchtune_grpo.rewards.scoring`).
4. **Advantages** (:meth:`~GRPORecipe.advantages`): group-relative
   (:mod:`torchtune_grpo.algorithm.advantages`).
5. **Reference and old log-probs** (:meth:`~GRPORecipe.reference_logprobs`, only when the
   loss has a KL term; :meth:`~GRPORecipe.old_logprobs`, only when the generator's own
   log-probs cannot serve as the sampling policy's).
6. **Update** (:meth:`~GRPORecipe.update`): ``ppo_epochs`` optimizer steps over shuffled
   micro-batches; every micro-batch loss is divided by the *global* normaliser, so
   micro-batching and the number of ranks do not change the update
   (:mod:`torchtune_grpo.algorithm.loss`).
7. **After the step** (:meth:`~GRPORecipe.after_step`): metrics, evaluation, step
   checkpoint, preemption and divergence.

:meth:`GRPORecipe.train_step` is steps 2-6 as a list of those calls. Single process (no
torchrun) runs the same code with no process group and no FSDP. Config defaults live in
:data:`torchtune_grpo.training.schema.RECIPE_KEYS`: the recipe reads ``cfg.key`` after
:func:`~torchtune_grpo.training.schema.with_defaults`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import disable_adapter

from torchtune_grpo.training import distributed as D
from torchtune_grpo.backends import backend_for
from torchtune_grpo.training.batching import (
    SampledGroups,
    StepBatches,
    dynamic_sample,
    split_batch,
)
from torchtune_grpo.training.checkpointing import (
    check_finite,
    check_writable,
    claim_output_dir,
    load_recipe_state,
    lora_checkpoint,
    non_finite_tensors,
    resolve_resume,
    save_step_checkpoint,
    weight_files,
)
from torchtune_grpo.training.rollouts import (
    RolloutRuntime,
    check_context_length,
    generation_context,
)
from torchtune_grpo.training.schema import RECIPE_KEYS, Key, per_rank_batch_size, with_defaults
from torchtune_grpo.training.validation import ConfigError, check_input_files, validate_config
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.evaluation.evaluate import evaluate
from torchtune_grpo.evaluation.results import EvalResult
from torchtune_grpo.training.health import RunHealth
from torchtune_grpo.training.metrics import PhaseTimer, peak_memory_gb
from torchtune_grpo.policy.model import DTYPES, build_model, has_adapters, meta_model, token_rules
from torchtune_grpo.algorithm.advantages import AdvantageOutput, group_advantages, loss_token_mask
from torchtune_grpo.policy.forward import micro_batch_logprobs
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import GenerationContext, Generator
from torchtune_grpo.policy.logprobs import auto_chunk_size
from torchtune_grpo.algorithm.loss import summarize_loss_stats
from torchtune_grpo.rollout.multiturn import ToolUseGenerator
from torchtune_grpo.rollout.tool_trajectory import ToolStats
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.rewards.reward_set import RewardOutput
from torchtune_grpo.rewards.scoring import concat_reward_outputs, score_rollout
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories
from torchtune_grpo.training.settings import (
    AdvantageSettings,
    DynamicSamplingSettings,
    EvalSettings,
    HealthSettings,
    settings_from_config,
)

log = utils.get_logger("INFO")


def _world_size_from_env() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def run_recipe(cfg: DictConfig) -> None:
    """Set up, train and clean up a :class:`GRPORecipe`; cleanup runs on failure too.

    The entry point of both training recipes: whether training ends, stops on a divergence
    or raises, the generator (e.g. a vLLM engine), the metric logger and the process group
    are closed.
    """
    recipe = GRPORecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()


class GRPORecipe:
    """GRPO full fine-tuning on one or many ranks (see the module docstring for the step).

    Args:
        cfg: the merged config; validated before anything is built.
    """

    #: config keys of this recipe beyond :data:`~torchtune_grpo.training.schema.RECIPE_KEYS`
    EXTRA_KEYS: dict[str, Key] = {}

    def __init__(self, cfg: DictConfig) -> None:
        self.validate(cfg)
        self.cfg = cfg = with_defaults(cfg, {**RECIPE_KEYS, **self.EXTRA_KEYS})
        self.device = utils.get_device(cfg.device)
        # process-wide settings of the device (CPU: the allocator keeps freed memory), before
        # the model and the step's tensors are allocated
        backend_for(self.device).configure_process(keep_freed_memory=cfg.keep_freed_cpu_memory)
        self.dtype = DTYPES[cfg.dtype]
        self.ranks = self.init_process_group()  # every collective of the step goes here
        self.world_size, self.rank = self.ranks.size(), self.ranks.rank()
        self.dp_mesh = None  # FSDP2 shards over the whole world (the async trainers: theirs)
        self.is_rank_zero = self.rank == 0
        self.seed = training.set_seed(cfg.seed)
        self.batch_size = per_rank_batch_size(cfg, self.world_size)
        self.group_size = int(cfg.group_size)
        self.forward_batch_size = int(cfg.forward_batch_size or self.batch_size * self.group_size)
        self.advantage_settings = settings_from_config(AdvantageSettings, cfg.advantages,
                                                       "advantages")
        self.dynamic_sampling = (None if cfg.dynamic_sampling is None else settings_from_config(
            DynamicSamplingSettings, cfg.dynamic_sampling, "dynamic_sampling"))
        self.eval_settings = settings_from_config(
            EvalSettings, cfg.eval, "eval", fixed={"seed": self.seed},
            fallbacks={"max_generated_tokens": cfg.max_generated_tokens,
                       "forward_batch_size": self.forward_batch_size})
        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.metric_logger = None
        self._progress = None
        self._line_progress = False
        self._stop_requested = False
        self._adapter_state = None

    def validate(self, cfg: DictConfig) -> None:
        """Check the config before anything is built
        (:func:`~torchtune_grpo.training.validation.validate_config` with the world size torchrun
        set)."""
        validate_config(cfg, world_size=_world_size_from_env(), extra_keys=self.EXTRA_KEYS)

    def init_process_group(self) -> D.Ranks:
        """The ranks that train together: the default process group under torchrun (this
        process alone without)."""
        D.init_distributed(self.device, timeout_s=float(self.cfg.distributed_timeout_s))
        return D.WORLD

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build data, rewards and loss first (cheap, validating), then the models."""
        cfg = self.cfg
        check_input_files(cfg)  # the base model is read even when resuming
        if self.is_rank_zero:
            check_writable(cfg.output_dir)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.rewards = build_reward_set(cfg.rewards)
        self.health = None if cfg.run_health is None else RunHealth(
            settings_from_config(HealthSettings, cfg.run_health, "run_health"),
            success_component=self.rewards.success_name)
        self.loss_fn = config.instantiate(cfg.loss)
        self.generator: Generator = self.build_generator()
        self.tools_on = bool(cfg.tools)
        # multi-turn: the engine samples each turn, tools run in between; the recipe reads the
        # tool counts from it (pop_stats) outside the Generator protocol
        self.tool_generator: ToolUseGenerator | None = None
        if self.tools_on:
            self.tool_generator = self.generator = ToolUseGenerator(
                cfg.tools, tokenizer=self.tokenizer, inner=self.generator,
                syntax=cfg.tool_syntax, max_tool_calls=int(cfg.max_tool_calls))
        # evaluation runs the same tools on the native engine (its own counts)
        self.eval_tool_generator = None if not self.tools_on else ToolUseGenerator(
            list(self.tool_generator.tools.values()), tokenizer=self.tokenizer,
            syntax=self.tool_generator.syntax, max_tool_calls=int(cfg.max_tool_calls))
        self._tool_stats = ToolStats()
        # after the tool engine: the chat-template tool format gives the tokenizer the tools'
        # schemas, which the prompts are rendered with
        self.dataset = config.instantiate(cfg.dataset, tokenizer=self.tokenizer)
        try:  # dims and adapters before any weight is loaded
            shape = meta_model(cfg.model)
        except (ValueError, TypeError, AssertionError) as e:  # the builder rejects its arguments
            raise ConfigError(f"config key 'model' ({cfg.model.get('_component_')}): "
                              f"{e}") from e
        self.max_seq_len = getattr(shape, "max_seq_len", None)
        self.is_lora = has_adapters(shape)
        del shape
        check_context_length(self.dataset, self.cfg.max_generated_tokens, self.max_seq_len)
        self.batches = StepBatches(
            self.dataset, batch_size=self.batch_size, world_size=self.world_size,
            rank=self.rank, seed=self.seed, shuffle=cfg.shuffle,
            collate=partial(collate_prompts, pad_id=int(getattr(self.tokenizer, "pad_id", 0))),
        )
        # built only when an evaluation is scheduled (eval_dataset=null: none at all)
        self.eval_dataset = (config.instantiate(cfg.eval_dataset, tokenizer=self.tokenizer)
                             if cfg.eval_dataset is not None and self.evaluates() else None)
        self.resume_dir = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
        if self.resume_dir is None and self.is_rank_zero:  # before any model is built
            deleted = claim_output_dir(cfg.output_dir, overwrite=cfg.overwrite_output_dir)
            if deleted:
                log.warning(f"overwrite_output_dir: deleted {len(deleted)} step folder(s) of "
                            f"an earlier run in {cfg.output_dir}")
        self.ranks.barrier()
        self._build_models()
        self._build_optimizer()
        if self.resume_dir is not None:
            self._load_recipe_state(load_recipe_state(self.resume_dir))
        if self.is_rank_zero and cfg.metric_logger is not None:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)

        self.rules = token_rules(self.tokenizer, self.model, self.device)
        self.allowed_tokens, self.logit_bias = self.rules.allowed, self.rules.logit_bias
        self.stop_tokens, self.pad_id = self.rules.stop_tokens, self.rules.pad_id
        self.chunk_size = int(cfg.logprob_chunk_size or auto_chunk_size(self.logit_bias.numel()))
        self.keep_probs = int(cfg.logprob_keep_probs_mib) * 2**20 // 4  # float32 elements
        self.rollouts = RolloutRuntime(
            self.generator, cfg, rules=self.rules, ranks=self.ranks, seed=self.seed,
            group_size=self.group_size, forward_batch_size=self.forward_batch_size,
            device=self.device, cache_dtype=self.dtype)
        self.generator.setup(self._generation_context())
        self.generator.sync_weights(self.model)  # a resumed or LoRA policy is not the base

    def evaluates(self) -> bool:
        """Whether this run evaluates at all (``eval_every_n_steps`` or ``eval_at_start``);
        the eval dataset is built only then. A subclass that evaluates on its own schedule
        returns True."""
        return bool(self.cfg.eval_every_n_steps) or bool(self.cfg.eval_at_start)

    def build_generator(self) -> Generator:
        """The rollout engine: ``generator:`` instantiated, or the native engine (null)."""
        cfg = self.cfg
        return config.instantiate(cfg.generator) if cfg.generator is not None else NativeGenerator()

    def _build_models(self) -> None:
        """The policy (from the base model or the step folder to resume) and, for a KL term
        without LoRA, the frozen reference (always the base model)."""
        cfg = self.cfg
        base_checkpointer = config.instantiate(cfg.checkpointer)
        needs_reference = self.loss_fn.needs_reference
        adapter_state = None
        if self.resume_dir is None or self.is_lora:
            # a LoRA step folder holds merged weights: rebuild base + saved adapters instead
            self.checkpointer = base_checkpointer
            state_dict = base_state = self.checkpointer.load_checkpoint()[training.MODEL_KEY]
            check_finite(state_dict, f"the weights in {cfg.checkpointer.get('checkpoint_dir')}",
                         action="load")
            if self.resume_dir is not None:
                adapter_state = load_recipe_state(self.resume_dir)["adapter"]
        else:
            self.checkpointer = config.instantiate(
                cfg.checkpointer, checkpoint_dir=str(self.resume_dir),
                checkpoint_files=weight_files(self.resume_dir),
            )
            state_dict = self.checkpointer.load_checkpoint()[training.MODEL_KEY]
            check_finite(state_dict, f"the weights in {self.resume_dir}", action="load")
            base_state = (base_checkpointer.load_checkpoint()[training.MODEL_KEY]
                          if needs_reference else None)
        self.model = self._build_model(state_dict, trainable=True, adapter_state=adapter_state)
        if cfg.compile:
            training.compile_model(self.model, verbose=self.is_rank_zero)
        self.activation_offloading = training.get_act_offloading_ctx_manager(
            self.model, cfg.enable_activation_offloading)
        self.ref_model = (self._build_model(base_state, trainable=False)
                          if needs_reference and not self.is_lora else None)

    def _build_model(self, state_dict: dict[str, torch.Tensor], *, trainable: bool,
                     adapter_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        cfg = self.cfg
        return build_model(
            cfg.model, state_dict, device=self.device, dtype=self.dtype,
            world_size=self.world_size, trainable=trainable, adapter_state_dict=adapter_state,
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
            reshard_after_forward=cfg.fsdp_reshard_after_forward, dp_mesh=self.dp_mesh,
        )

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = None
        if cfg.lr_scheduler is not None:
            self.lr_scheduler = config.instantiate(
                cfg.lr_scheduler, optimizer=self.optimizer,
                num_training_steps=cfg.num_steps * cfg.ppo_epochs)

    def _generation_context(self) -> GenerationContext:
        lora = None
        if self.is_lora:
            lora = {"rank": int(self.cfg.model.lora_rank),
                    "alpha": float(self.cfg.model.lora_alpha)}
        return generation_context(
            self.cfg, self.checkpointer, self.dataset, max_seq_len=self.max_seq_len,
            device=self.device, dtype=self.dtype, world_size=self.world_size, rank=self.rank,
            allowed_tokens=self.allowed_tokens, lora=lora)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """Steps 2-6 on this rank's ``batch`` of prompts; returns the step's metrics.

        Gradient accumulation rolls out and scores the batch in sequential chunks
        (``gradient_accumulation_steps``); the update still sees the whole batch. With
        ``dynamic_sampling``, tied groups are replaced by groups of extra draws
        (:meth:`dynamic_sample`) before the advantages.
        """
        timer = PhaseTimer()
        traj, rewards = self.rollout_and_score(batch, timer)
        sampled = None
        if self.dynamic_sampling is not None:  # DAPO: drop tied groups, draw more prompts
            sampled = self.dynamic_sample(traj, rewards, timer)
            traj, rewards = sampled.traj, sampled.rewards
        with timer("scoring"):
            adv = self.advantages(rewards)
        self.generator.before_update()  # e.g. vLLM frees its KV cache for the update
        with timer("reference"):
            ref = self.reference_logprobs(traj) if self.loss_fn.needs_reference else None
        with timer("old_logprobs"):
            old = self.old_logprobs(traj)
        with timer("update"):
            loss_metrics = self.update(traj, adv.advantages.to(self.device), ref,
                                       self.loss_mask(traj, adv), old_logprobs=old)
        with timer("weight_sync"):
            self.generator.sync_weights(self.model)  # no-op for the native engine
        self.step += 1
        metrics = self.step_metrics(traj, rewards, adv, loss_metrics, timer.seconds)
        if sampled is not None:
            metrics.update(self.dynamic_sampling_metrics(sampled, timer.seconds))
        return metrics

    def rollout_and_score(self, batch: dict[str, Any], timer: PhaseTimer,
                          draw: int = 0) -> tuple[Trajectory, RewardOutput]:
        """Steps 2-3 on ``batch``, in ``gradient_accumulation_steps`` sequential chunks,
        concatenated; ``draw``: 0 for the step's main batch, ``k`` for extra draw ``k``."""
        trajs, scores = [], []
        for chunk in split_batch(batch, self.cfg.gradient_accumulation_steps):
            with timer("generation"):
                trajs.append(self.rollout(chunk, draw=draw))
            with timer("scoring"):
                scores.append(self.score(trajs[-1], chunk))
        return concat_trajectories(trajs), concat_reward_outputs(scores)

    def dynamic_sample(self, traj: Trajectory, rewards: RewardOutput,
                       timer: PhaseTimer) -> SampledGroups:
        """DAPO's dynamic sampling (``dynamic_sampling:``): the groups of ``traj`` whose
        rewards tie are dropped and extra batches (:meth:`StepBatches.extra_batch`) rolled
        out and scored until every rank holds ``batch_size`` groups with a signal, or
        ``max_batches`` extra batches were drawn; every rank draws as often as the others
        (:func:`~torchtune_grpo.training.batching.dynamic_sample`)."""
        return dynamic_sample(
            (traj, rewards),
            lambda k: self.rollout_and_score(self.batches.extra_batch(self.step, k), timer, k),
            batch_size=self.batch_size, group_size=self.group_size,
            max_batches=self.dynamic_sampling.max_batches,
            all_ranks_true=partial(self.ranks.all_ranks_true, device=self.device))

    def dynamic_sampling_metrics(self, sampled: SampledGroups,
                                 seconds: dict[str, float]) -> dict[str, float]:
        """``dynamic_sampling/...`` over all ranks, and ``tokens_per_second/generation``
        counting every token the step generated (dropped groups included)."""
        t = torch.tensor([float(sampled.signal_groups), float(self.batch_size),
                          float(sampled.generated_tokens)], dtype=torch.float64,
                         device=self.device)
        self.ranks.all_reduce(t, "sum")
        return {
            "dynamic_sampling/extra_rollouts": float(sampled.extra_rollouts),
            "dynamic_sampling/kept_fraction": float(t[0] / t[1]),
            "dynamic_sampling/generated_tokens": float(t[2]),
            "tokens_per_second/generation": float(t[2]) / max(seconds["generation"], 1e-9),
        }

    def rollout(self, batch: dict[str, Any], draw: int = 0) -> Trajectory:
        """Step 2: ``group_size`` completions per prompt, padded to uniform shapes
        (:meth:`RolloutRuntime.rollout`: seeds from ``(seed, step, prompt, sample, draw)``
        alone); with tools, the step's tool counts are summed for :meth:`step_metrics`."""
        traj = self.rollouts.rollout(self.model, batch, step=self.step, draw=draw)
        if self.tools_on:
            self._tool_stats = self._tool_stats + self.tool_generator.pop_stats()
        return traj

    def _gathered(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """Under FSDP2, ``model``'s weights all-gathered once for a no-grad phase and freed at
        its end (:func:`~torchtune_grpo.training.distributed.gathered_for_inference`), not once per
        forward; off with ``rollout_gather_weights: false``, a no-op on one device or for
        None."""
        return D.gathered_for_inference(model, enabled=self.cfg.rollout_gather_weights)

    def score(self, traj: Trajectory, batch: dict[str, Any]) -> RewardOutput:
        """Step 3: decode the completions (with tools: model and tool text in order) and
        apply the reward components."""
        return score_rollout(self.rewards, self.tokenizer, traj, batch,
                             group_size=self.group_size, allowed_tokens=self.allowed_tokens,
                             max_generated_tokens=self.cfg.max_generated_tokens,
                             with_tools=self.tools_on)[1]

    def advantages(self, rewards: RewardOutput) -> AdvantageOutput:
        """Step 4: group-relative advantages ``[N]`` of the rewards (``advantages:`` block)."""
        settings = self.advantage_settings
        return group_advantages(rewards.total.to(self.device), self.group_size,
                                scale=settings.scale, eps=settings.eps)

    def loss_mask(self, traj: Trajectory, adv: AdvantageOutput) -> torch.Tensor:
        """``[N, T]`` response tokens that enter the loss and its normaliser
        (``mask_truncated_completions``, ``exclude_zero_std_groups``)."""
        return loss_token_mask(
            traj.response_mask, traj.stopped, adv.zero_std_groups.to(self.device),
            mask_truncated_completions=self.cfg.mask_truncated_completions,
            exclude_zero_std_groups=self.cfg.exclude_zero_std_groups,
        )

    @torch.no_grad()
    def reference_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Step 5: ``[N, T]`` log-probs of the responses under the frozen reference model.

        With LoRA the reference is the policy itself with its adapters disabled: no second
        copy of the weights exists.
        """
        model = self.model if self.is_lora else self.ref_model
        context = disable_adapter(self.model) if self.is_lora else contextlib.nullcontext()
        with context, self._gathered(model):
            return self._response_logprobs(model, traj)

    @property
    def needs_proximal(self) -> bool:
        """Whether the loss takes its ratio against the trainer's current weights and weights
        each token by proximal / behaviour (``loss.off_policy_correction``: decoupled, tis)."""
        return bool(getattr(self.loss_fn, "needs_proximal_logprobs", False))

    @torch.no_grad()
    def old_logprobs(self, traj: Trajectory) -> torch.Tensor | None:
        """Step 5: ``[N, T]`` log-probs of the rollout under the current policy (no graph),
        when the generator's own cannot serve as the sampling policy's (see its
        ``needs_policy_logprobs``, e.g. vLLM with ``top_k``) or when the loss needs the
        proximal policy's (:attr:`needs_proximal`); None: use ``traj.logprobs``."""
        if not (self.needs_proximal
                or self.generator.needs_policy_logprobs(top_k=self.cfg.top_k)):
            return None
        with self._gathered(self.model):
            return self._response_logprobs(self.model, traj) * traj.response_mask

    def _response_logprobs(self, model: nn.Module, traj: Trajectory) -> torch.Tensor:
        """``[N, T]`` log-probs of ``traj``'s responses under ``model``, micro-batch by
        micro-batch (call under ``torch.no_grad``), each on its own extent (0 past it)."""
        size = self.forward_batch_size
        return torch.cat([self._micro_batch_logprobs(model, traj, slice(i, i + size))[0]
                          for i in range(0, traj.num_sequences, size)])

    def _micro_batch_logprobs(self, model: nn.Module, traj: Trajectory,
                             rows: slice | torch.Tensor,
                             **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [n, T], entropy [n, T] or None)`` of ``traj``'s ``rows``, the model run
        on their real tokens only (``packed_forward``: packed into one row; otherwise on the
        columns that are not padding in all of them, ``trim_to_extent``); tool tokens
        (``traj.tool_mask``) are attended but get log-prob 0."""
        return micro_batch_logprobs(
            model, traj.tokens[rows], traj.prompt_mask[rows], traj.response_mask[rows],
            tool_mask=traj.tool_mask[rows], temperature=self.cfg.temperature,
            logit_bias=self.logit_bias, chunk_size=self.chunk_size, keep_probs=self.keep_probs,
            pack=self.packed, share_prompts=self.packed and self.cfg.share_prompt_forward,
            **kwargs)

    @property
    def packed(self) -> bool:
        """Whether training-time forward passes run on packed rows (``packed_forward``)."""
        return bool(self.cfg.packed_forward and not self.cfg.compile)

    def micro_batch_order(self, num_sequences: int, epoch: int) -> torch.Tensor:
        """``[N]`` the update's row order in ``epoch``: a pure function of (seed, step, epoch,
        rank). With prompt sharing (``share_prompt_forward``) whole groups are shuffled and
        their rows kept together, so that a micro-batch holds few distinct prompts."""
        gen = torch.Generator().manual_seed(
            int(mix_seeds(self.seed, self.step, epoch, self.rank, 0x5F0F)))
        group = self.group_size
        if self.packed and self.cfg.share_prompt_forward and num_sequences % group == 0:
            groups = torch.randperm(num_sequences // group, generator=gen)
            return (groups[:, None] * group + torch.arange(group)[None, :]).flatten()
        return torch.randperm(num_sequences, generator=gen)

    def update(self, traj: Trajectory, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None,
               loss_mask: torch.Tensor | None = None,
               old_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Step 6: ``ppo_epochs`` optimizer steps on this rollout; returns loss metrics.

        Args:
            traj: the rollout.
            advantages: ``[N]``.
            ref_logprobs: ``[N, T]`` reference log-probs, or None without a KL term.
            loss_mask: ``[N, T]`` tokens that count (default: every response token).
            old_logprobs: ``[N, T]`` log-probs of the sampling policy (default: the generator's,
                ``traj.logprobs``); with an off-policy correction (:attr:`needs_proximal`)
                the proximal policy's, and ``traj.logprobs`` are the behaviour log-probs.

        Besides the loss metrics, ``generation/logprob_diff_max`` and ``_mean`` compare the
        generator's log-probs with the policy's own in the first epoch (before any optimizer
        step: the same weights), over response tokens: ~1e-6 for the native engine in fp32,
        larger for another engine or precision, and large when its weights were not synced.
        Where the rollout came from an older policy (:meth:`behavior_is_current` False, the
        asynchronous recipe) that recipe measures the gap against the older weights instead.
        """
        cfg = self.cfg
        old = traj.logprobs if old_logprobs is None else old_logprobs
        response_mask = traj.response_mask if loss_mask is None else loss_mask
        normalizer = self.loss_fn.normalizer_contribution(response_mask).to(
            self.device, torch.float32)
        normalizer = self.ranks.all_reduce(normalizer.clone(), "sum")
        stats, grad_norms = [], []
        gap = torch.zeros(3, dtype=torch.float64, device=self.device)  # max, sum, count
        measure_gap = self.behavior_is_current()
        skip = self.skipped_sequences(advantages)
        # the skipped rollouts' share of the normaliser, counted with each epoch's first
        # micro-batch so that the loss metrics still average whole epochs
        skipped_share = (self.loss_fn.normalizer_contribution(response_mask[skip]).to(
            self.device, torch.float32) / normalizer.clamp(min=1e-30)).reshape(())
        kept = (~skip).nonzero().flatten().cpu()
        # every rank runs the same number of micro-batches (FSDP's collectives), at least one
        local = float(-(-kept.numel() // self.forward_batch_size))
        count = self.ranks.all_reduce(torch.tensor([local], device=self.device), "max")
        num_micro = max(1, int(count))
        for epoch in range(cfg.ppo_epochs):
            order = self.micro_batch_order(traj.num_sequences, epoch)
            if skip.any():
                order = order[~skip.cpu()[order]]  # the same order, less the skipped rows
            for i in range(0, num_micro * self.forward_batch_size, self.forward_batch_size):
                idx = order[i : i + self.forward_batch_size].to(self.device)
                counts = True
                if idx.numel() == 0:  # lockstep filler: one row that adds nothing
                    idx, counts = torch.zeros(1, dtype=torch.long, device=self.device), False
                with self.activation_offloading:
                    logprobs, entropy = self._micro_batch_logprobs(
                        self.model, traj, idx, return_entropy=True,
                        entropy_grad=self.loss_fn.needs_entropy)
                if epoch == 0 and measure_gap and counts:
                    diff = (logprobs.detach() - traj.logprobs[idx]).abs()[traj.response_mask[idx]]
                    if diff.numel():
                        gap[0] = torch.maximum(gap[0], diff.max().double())
                        gap[1] += diff.double().sum()
                        gap[2] += diff.numel()
                mb_mask = response_mask[idx] if counts else torch.zeros_like(response_mask[idx])
                loss, mb_stats = self.loss_fn(
                    logprobs, old[idx], advantages[idx], mb_mask,
                    normalizer=normalizer,
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[idx],
                    entropy=entropy,
                    **({"behavior_logprobs": traj.logprobs[idx]} if self.needs_proximal else {}),
                )
                # FSDP averages gradients over ranks; the loss is already a global mean.
                (loss * self.world_size).backward()
                if i == 0 and skip.any():
                    mb_stats = {**mb_stats, "normalizer_share":
                                mb_stats["normalizer_share"] + skipped_share}
                stats.append(mb_stats)
            grad_norms.append(self._optimizer_step())
        metrics = summarize_loss_stats(stats, all_reduce=self.ranks.all_reduce)
        gap_max = self.ranks.all_reduce(gap[:1].clone(), "max")
        gap_sum = self.ranks.all_reduce(gap[1:].clone(), "sum")
        metrics["generation/logprob_diff_max"] = float(gap_max[0])
        metrics["generation/logprob_diff_mean"] = float(gap_sum[0] / gap_sum[1].clamp(min=1))
        metrics["grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        metrics["skipped_steps"] = float(self.skipped_steps)
        return metrics

    def skipped_sequences(self, advantages: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: rollouts the update leaves out because they cannot move the weights.

        With ``skip_zero_advantage_sequences`` (the default), a sequence whose advantage is
        exactly 0 (every member of a group whose rewards all tie) adds exactly 0 to the
        gradient of every shipped loss unless it has a KL or entropy term, so its forward and
        backward passes are skipped; it still counts in the loss normaliser, so the gradient is
        the same as without skipping (up to float summation order). Nothing is skipped when
        the loss needs reference log-probs or the entropy.
        """
        if (not self.cfg.skip_zero_advantage_sequences or self.loss_fn.needs_reference
                or self.loss_fn.needs_entropy):
            return torch.zeros_like(advantages, dtype=torch.bool)
        return advantages == 0

    def behavior_is_current(self) -> bool:
        """Whether this step's rollout was sampled with the weights the update starts from
        (always, here): then the first epoch's forward also measures the generator/policy
        log-prob gap."""
        return True

    def _optimizer_step(self) -> float:
        """Clip, step (skipped when the gradient is not finite), zero, schedule; returns the
        gradient norm before clipping."""
        max_norm = float(self.cfg.clip_grad_norm or float("inf"))
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            log.warning(f"step {self.step + 1}: non-finite loss or gradient, update skipped "
                        f"({self.consecutive_skips} in a row)")
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return grad_norm

    # ------------------------------------------------------------------ metrics
    def _global_mean(self, values: torch.Tensor) -> float:
        t = torch.tensor([values.float().sum().item(), values.numel()], dtype=torch.float64,
                         device=self.device)
        self.ranks.all_reduce(t, "sum")
        return float(t[0] / t[1])

    def step_metrics(self, traj: Trajectory, rewards: RewardOutput, adv: AdvantageOutput,
                     loss_metrics: dict[str, float],
                     seconds: dict[str, float]) -> dict[str, float]:
        """The metrics of one step, averaged over all ranks (``docs/metrics.md``)."""
        total = rewards.total.float()
        mean = self._global_mean(total)
        mean_sq = self._global_mean(total * total)
        metrics = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(mean_sq - mean * mean, 0.0)),
            "success_rate": self._global_mean(rewards.success.float()),
            "response_length/mean": self._global_mean(traj.response_lengths.float()),
            "truncated_fraction": self._global_mean((~traj.stopped).float()),
            "zero_std_group_fraction": self._global_mean(adv.zero_std_groups.float()),
        }
        for name, values in rewards.components.items():
            metrics[f"reward/{name}"] = self._global_mean(values.float())
        for name, count in rewards.errors.items():
            errors = self.ranks.all_reduce(torch.tensor([float(count)], device=self.device), "sum")
            metrics[f"reward/{name}/errors"] = float(errors)
        metrics["data/skipped_rows"] = float(getattr(self.dataset, "skipped_rows", 0))
        metrics.update(loss_metrics)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        generated = torch.tensor([float(traj.response_mask.sum())], device=self.device)
        self.ranks.all_reduce(generated, "sum")
        metrics["tokens_per_second/generation"] = (
            float(generated) / max(seconds["generation"], 1e-9))
        if self.tools_on:  # every rollout of the step, summed over ranks
            sums = self.ranks.all_reduce(self._tool_stats.as_tensor().to(self.device), "sum")
            metrics.update(ToolStats.metrics(sums.cpu()))
            self._tool_stats = ToolStats()
        metrics.update({f"time/{phase}": value for phase, value in seconds.items()})
        if self.cfg.log_peak_memory_stats:
            metrics["peak_memory_gb"] = peak_memory_gb(self.device)
        return metrics

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        """Run the remaining of ``num_steps`` GRPO steps: a list of calls."""
        if self.step >= self.cfg.num_steps:
            if self.is_rank_zero:
                log.warning(f"already finished: {self.resume_dir} is step {self.step} and "
                            f"num_steps={self.cfg.num_steps}; nothing to do (raise num_steps to "
                            "train further)")
            return
        if self.eval_dataset is not None and self.step == 0 and self.cfg.eval_at_start:
            self.run_eval()
        with self._progress_bar(), self._sigterm_stops_after_the_step():
            while self.step < self.cfg.num_steps:
                start = time.perf_counter()
                metrics = self.train_step(self.batches.batch(self.step))
                metrics["time/step"] = time.perf_counter() - start  # whole step, rank 0
                if not self.after_step(metrics):
                    break
        if self.health is not None and self.is_rank_zero:
            summary = self.health.summary()
            (log.warning if any(self.health.spans.values()) else log.info)(summary)

    def after_step(self, metrics: dict[str, float]) -> bool:
        """Step 7: log, evaluate, checkpoint; returns False when the run must stop.

        A checkpoint is written at the last step, every ``save_every_n_steps``, with every
        evaluation (its results go into the folder), on preemption (SIGTERM on any rank) and
        before raising on divergence (``max_consecutive_skipped_steps`` non-finite updates
        in a row).
        """
        cfg = self.cfg
        if self.health is not None:  # the same metrics on every rank: the same flags
            flags, warnings = self.health.update(self.step, metrics)
            metrics.update(flags)
            for message in warnings if self.is_rank_zero else ():
                log.warning(message)
        self.log_metrics(metrics)
        preempted = not self.ranks.all_ranks_true(not self._stop_requested, self.device)
        diverged = self.consecutive_skips >= cfg.max_consecutive_skipped_steps
        last = self.step == cfg.num_steps
        evaluated = None
        if self.eval_dataset is not None and cfg.eval_every_n_steps and (
                self.step % cfg.eval_every_n_steps == 0 or last):
            evaluated = self.run_eval()
        if last or preempted or diverged or evaluated is not None or (
                cfg.save_every_n_steps and self.step % cfg.save_every_n_steps == 0):
            self.save_checkpoint(evaluated)
        if preempted:
            if self.is_rank_zero:
                log.warning(f"stopped after step {self.step} on request; saved "
                            f"{cfg.output_dir}/step_{self.step}; continue with the same command "
                            "and resume_from_checkpoint=true")
            return False
        if diverged:
            raise RuntimeError(
                f"{self.consecutive_skips} consecutive steps had a non-finite loss or gradient "
                f"(max_consecutive_skipped_steps={cfg.max_consecutive_skipped_steps}); saved "
                f"step_{self.step} and stopped. Lower the learning rate, check the rewards, "
                "or resume from an earlier checkpoint."
            )
        return True

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send ``metrics`` to the metric logger (every ``log_every_n_steps``) and the
        progress bar."""
        if self.metric_logger is not None and self.step % self.cfg.log_every_n_steps == 0:
            self.metric_logger.log_dict(metrics, step=self.step)
        if self._progress is not None:
            self._progress.update(1)
            self._progress.set_description(
                f"step {self.step} reward {metrics['reward/mean']:.3f} "
                f"success {metrics['success_rate']:.2f}")
        elif self._line_progress:  # output to a file: one line per step, not a redrawn bar
            log.info(f"step {self.step}/{self.cfg.num_steps}: reward "
                     f"{metrics['reward/mean']:.3f}, success {metrics['success_rate']:.2f}, "
                     f"{metrics.get('time/step', 0.0):.1f} s")

    @contextlib.contextmanager
    def _progress_bar(self) -> Iterator[None]:
        from tqdm import tqdm

        show = self.is_rank_zero and self.cfg.progress_bar
        self._line_progress = show and not sys.stderr.isatty()
        self._progress = (None if self._line_progress else
                          tqdm(total=self.cfg.num_steps, initial=self.step, disable=not show))
        try:
            yield
        finally:
            if self._progress is not None:
                self._progress.close()
            self._progress = None
            self._line_progress = False

    @contextlib.contextmanager
    def _sigterm_stops_after_the_step(self) -> Iterator[None]:
        """SIGTERM (preemption) and SIGINT (Ctrl-C) set a flag: the step finishes, is saved,
        and the loop stops with the command that resumes it. A second SIGINT stops at once
        (``KeyboardInterrupt``), losing the step in progress."""
        def request_stop(signum, _frame) -> None:
            if signum == signal.SIGINT and self._stop_requested:
                raise KeyboardInterrupt
            name = signal.Signals(signum).name
            extra = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            log.warning(f"received {name}: saving at the end of this step, then stopping{extra}")
            self._stop_requested = True

        previous = {sig: signal.signal(sig, request_stop)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run_eval(self) -> EvalResult:
        """Evaluate the current policy on ``eval_dataset``; log ``eval/...`` metrics."""
        result = evaluate(
            self.model, self.tokenizer, self.eval_dataset, self.rewards, self.eval_settings,
            device=self.device, logit_bias=self.logit_bias, allowed_tokens=self.allowed_tokens,
            stop_tokens=self.stop_tokens, pad_id=self.pad_id, cache_dtype=self.dtype,
            gather_weights=self.cfg.rollout_gather_weights,
            tool_generator=self.eval_tool_generator, ranks=self.ranks,
        )
        metrics = {f"eval/{k}": v for k, v in result.metrics.items()}
        metrics["eval/problems_per_second"] = len(result.samples) / max(result.seconds, 1e-9)
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)
        if self.is_rank_zero:
            log.info(f"step {self.step}: " + ", ".join(
                f"{k}={v:.4f}" for k, v in metrics.items()))
        return result

    # ------------------------------------------------------------------ checkpoint
    def _full_model_state_dict(self) -> dict[str, torch.Tensor]:
        if self.world_size > 1:
            return training.gather_cpu_state_dict(self.model, self.is_rank_zero, self.device)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _full_optimizer_state_dict(self) -> dict[str, Any]:
        if self.world_size > 1:  # gathered on rank 0 (a collective: every rank calls it)
            return training.get_full_optimizer_state_dict(
                self.model, self.optimizer, self.is_rank_zero, device=self.device)
        return self.optimizer.state_dict()

    def recipe_state(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """What the next step reads, for ``recipe_state.pt``.

        Sampling, prompt order and micro-batch order are pure functions of ``(seed, step)``,
        so no random-generator state needs saving: the step, the optimizer and the scheduler
        are the whole state.
        """
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.batch_size * self.world_size,
            "world_size": self.world_size,
            "optimizer": optimizer_state,
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "adapter": self._adapter_state,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }

    def extra_recipe_state(self) -> dict[str, Any]:
        """Entries a recipe adds to ``recipe_state.pt`` (called on every rank before rank 0
        writes; may be a collective); none here."""
        return {}

    def _load_recipe_state(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"resume_from_checkpoint: {self.resume_dir} was trained with seed "
                f"{state['seed']}, the config says {self.seed}; an exact resume needs the same seed"
            )
        if state["global_batch_size"] != self.batch_size * self.world_size:
            log.warning(
                f"resuming with a global batch of {self.batch_size * self.world_size} prompts "
                f"instead of {state['global_batch_size']}: later steps see other prompts"
            )
        if self.world_size > 1:
            training.load_from_full_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], self.device)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.is_rank_zero:
            log.info(f"resumed from {self.resume_dir} at step {self.step}")

    def save_checkpoint(self, evaluated: EvalResult | None = None) -> None:
        """Write ``output_dir/step_{step}`` (rank 0 writes, every rank takes part).

        Args:
            evaluated: evaluation results of this step, stored inside the folder.
        """
        cfg = self.cfg
        state = self._full_model_state_dict()
        optimizer_state = self._full_optimizer_state_dict()
        extra_state = self.extra_recipe_state()
        self._adapter_state = None
        # a step with non-finite weights is never saved: the last good one stays the newest
        # (rank 0 holds the gathered weights; every rank raises together)
        finite = not self.is_rank_zero or not non_finite_tensors(state)
        if not self.ranks.all_ranks_true(finite, self.device):
            if self.is_rank_zero:
                check_finite(state, f"step_{self.step} to {cfg.output_dir}", action="save")
            raise ValueError(f"refusing to save step_{self.step}: rank 0 found non-finite "
                             "weights")
        if self.is_rank_zero:
            checkpoint = {training.MODEL_KEY: state}
            if self.is_lora:
                checkpoint = lora_checkpoint(state, cfg.model,
                                             adapter_only=cfg.save_adapter_weights_only)
                self._adapter_state = checkpoint[training.ADAPTER_KEY]
            extra = None
            if evaluated is not None:
                extra = evaluated.files(
                    dataset=str(cfg.eval_dataset.get("_component_")),
                    split=str(cfg.eval_dataset.get("split", "")),
                    model_path=str(cfg.output_dir) + f"/step_{self.step}",
                    step=self.step,
                )
            path = save_step_checkpoint(
                output_dir=cfg.output_dir, step=self.step, checkpointer=self.checkpointer,
                checkpoint=checkpoint,
                adapter_only=self.is_lora and cfg.save_adapter_weights_only,
                recipe_state={**self.recipe_state(optimizer_state), **extra_state},
                extra_files=extra,
                keep_last_n=cfg.keep_last_n_checkpoints,
            )
            log.info(f"saved {path}")
        self.ranks.barrier()

    def cleanup(self) -> None:
        """Close the generator, the metric logger and the process group (safe to call after
        a failed or partial :meth:`setup`)."""
        try:
            generator = getattr(self, "generator", None)
            if generator is not None:
                generator.close()
            if self.metric_logger is not None:
                self.metric_logger.close()
        finally:
            D.destroy()
