"""The GRPO training loop shared by the single-device and distributed recipes.

One GRPO step (``docs/design.md``), each part a named method of :class:`GRPORecipe`:

1. prompts (``self.batches.batch(step)``; a prompt's group stays on the rank that drew it);
2. rollout (:meth:`~GRPORecipe.rollout`, a :class:`~torchtune_grpo.rollout.protocol.Generator`);
3. score (:meth:`~GRPORecipe.score`, :mod:`torchtune_grpo.rewards.scoring`);
4. advantages (:meth:`~GRPORecipe.advantages`, group-relative);
5. reference and old log-probs (only for a KL term; only when the engine's cannot serve);
6. update (:class:`~torchtune_grpo.training.update.PolicyUpdate`: ``ppo_epochs`` optimizer
   steps, every micro-batch loss divided by the *global* normaliser);
7. after the step (:meth:`~GRPORecipe.after_step`): metrics, evaluation, step checkpoint,
   preemption and divergence.

:meth:`GRPORecipe.train_step` is steps 2-6 as a list of those calls. One process (no torchrun)
runs the same code without FSDP; where the rollouts come from is a part
(:class:`~torchtune_grpo.training.parts.RolloutSource`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torchtune import config, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.advantages import AdvantageOutput, group_advantages, loss_token_mask
from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories
from torchtune_grpo.backends import backend_for
from torchtune_grpo.checkpoints.recipe_state import StepCheckpoints
from torchtune_grpo.checkpoints.saving import load_recipe_state
from torchtune_grpo.config.schema import RECIPE_KEYS, per_rank_batch_size, with_defaults
from torchtune_grpo.config.settings import (
    AdvantageSettings,
    DynamicSamplingSettings,
    HealthSettings,
    settings_from_config,
)
from torchtune_grpo.config.validation import check_device, check_input_files
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.evaluation.during_training import TrainingEvaluation
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted
from torchtune_grpo.evaluation.results import EvalResult
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.policy.model import DTYPES, token_rules
from torchtune_grpo.progress import Progress
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.rewards.reward_set import RewardOutput
from torchtune_grpo.rewards.scoring import concat_reward_outputs, score_rollout
from torchtune_grpo.rollout.protocol import Generator
from torchtune_grpo.rollout.runtime import (
    RolloutRuntime,
    check_context_length,
    generation_context,
)
from torchtune_grpo.rollout.tool_trajectory import ToolStats
from torchtune_grpo.training import parts
from torchtune_grpo.training.batching import (
    SampledGroups,
    StepBatches,
    dynamic_sample,
    dynamic_sampling_metrics,
    split_batch,
)
from torchtune_grpo.training.health import RunHealth
from torchtune_grpo.training.interrupts import StopSignals
from torchtune_grpo.training.metrics import PhaseTimer, StepProgress, step_metrics
from torchtune_grpo.training.parts import LocalRollouts, RolloutSource
from torchtune_grpo.training.update import PolicyUpdate

log = utils.get_logger("INFO")


def run_recipe(cfg: DictConfig, source: RolloutSource | None = None) -> None:
    """Set up, train and clean up a :class:`GRPORecipe`; cleanup runs on failure too.

    The training recipes' entry point: however training ends, the generator (e.g. vLLM), the
    metric logger and the process group are closed; a user error is printed first.

    Args:
        cfg: the merged config.
        source: where the rollouts come from (default :class:`LocalRollouts`).
    """
    recipe = GRPORecipe(cfg, source=source)
    try:
        with parts.failures_reported_first(recipe.cfg.output_dir):
            recipe.setup()
            recipe.train()
    finally:
        recipe.cleanup()


class GRPORecipe:
    """GRPO full fine-tuning on one or many ranks (see the module docstring for the step).

    The recipe builds its parts in :meth:`setup` and holds them: :attr:`policy_update`
    (steps 5-6), :attr:`checkpoints`, :attr:`evaluation` (None without an eval dataset),
    :attr:`rollouts` and :attr:`source`.

    Args:
        cfg: the merged config; validated before anything is built.
        source: where the rollouts come from (default :class:`LocalRollouts`).
    """

    def __init__(self, cfg: DictConfig, source: RolloutSource | None = None) -> None:
        # Ctrl-C / SIGTERM from the first second: one line while setting up, a clean stop
        # that keeps the work done while evaluating or training
        self.stop = StopSignals("the run", quiet=parts.rank_from_env() != 0).install()
        self.source = source = source if source is not None else LocalRollouts()
        source.validate(cfg)
        self.cfg = cfg = with_defaults(cfg, {**RECIPE_KEYS, **source.extra_keys})
        check_device(cfg.device)
        self.device = utils.get_device(cfg.device)
        # process-wide settings of the device (CPU: the allocator keeps freed memory), before
        # the model and the step's tensors are allocated
        backend_for(self.device).configure_process(keep_freed_memory=cfg.keep_freed_cpu_memory)
        self.dtype = DTYPES[cfg.dtype]
        self.ranks = source.process_group(self.device, float(cfg.distributed_timeout_s))
        self.world_size, self.rank = self.ranks.size(), self.ranks.rank()  # every collective
        self.is_rank_zero = self.rank == 0
        self.seed = D.set_seed(cfg.seed)
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
        # rank 0: the phase of the step in flight, a line every 30 s while one runs long
        self.work = Progress(show=self.is_rank_zero,
                             prefix=lambda: f"step {self.step + 1}/{cfg.num_steps}")
        self.metric_logger = None
        self._progress: StepProgress | None = None
        self.output_lock = None  # rank 0: the lock on output_dir (setup)
        self.model_files: dict[str, bytes] = {}  # rank 0: written into every step folder
        self.generator: Generator | None = None
        self.evaluation: TrainingEvaluation | None = None  # None: no eval dataset

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build data, rewards and loss first (cheap, validating), then the models, the
        optimizer and the parts that use them."""
        cfg = self.cfg
        check_input_files(cfg)  # the base model is read even when resuming
        if self.is_rank_zero:  # one run per output_dir, held until the process ends
            self.output_lock, self.model_files = parts.claim_output(cfg)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.rewards = build_reward_set(cfg.rewards)
        self.health = None if cfg.run_health is None else RunHealth(
            settings_from_config(HealthSettings, cfg.run_health, "run_health"),
            success_component=self.rewards.success_name,
            gated_components=[e.name for e in self.rewards.entries if e.requires_success])
        self.loss_fn = config.instantiate(cfg.loss)
        self.generator = self.source.generator(parts.build_engine(cfg), cfg)
        self.tools_on = bool(cfg.tools)
        # multi-turn: the engine samples each turn, tools run in between; the recipe reads the
        # tool counts from it (pop_stats, part of the Generator protocol)
        self.tool_generator = self.eval_tool_generator = None
        if self.tools_on:
            self.tool_generator, self.eval_tool_generator = parts.build_tool_generators(
                cfg, self.tokenizer, self.generator)
            self.generator = self.tool_generator
        self._tool_stats = ToolStats()
        # after the tool engine: the chat-template tool format gives the tokenizer the tools'
        # schemas, which the prompts are rendered with
        self.dataset = config.instantiate(cfg.dataset, tokenizer=self.tokenizer)
        self.max_seq_len, self.is_lora = parts.model_shape(cfg)
        check_context_length(self.dataset, cfg.max_generated_tokens, self.max_seq_len)
        self.batches = StepBatches(
            self.dataset, batch_size=self.batch_size, world_size=self.world_size,
            rank=self.rank, seed=self.seed, shuffle=cfg.shuffle,
            collate=partial(collate_prompts, pad_id=int(getattr(self.tokenizer, "pad_id", 0))),
        )
        # built only when an evaluation is scheduled (eval_dataset=null: none at all)
        self.eval_dataset = (config.instantiate(cfg.eval_dataset, tokenizer=self.tokenizer)
                             if cfg.eval_dataset is not None and self.evaluates() else None)
        self.resume_dir, changes = parts.resume_folder(
            cfg, self.model_files, global_batch_size=self.batch_size * self.world_size,
            is_rank_zero=self.is_rank_zero)
        self.ranks.barrier()
        policy = parts.build_policy(
            cfg, self.resume_dir, is_lora=self.is_lora,
            needs_reference=self.loss_fn.needs_reference, device=self.device, dtype=self.dtype,
            world_size=self.world_size, is_rank_zero=self.is_rank_zero,
            dp_mesh=self.source.device_mesh(self.ranks, self.device))
        self.model, self.ref_model, self.checkpointer = (policy.model, policy.ref_model,
                                                         policy.checkpointer)
        self.optimizer, self.lr_scheduler = parts.build_optimizer(cfg, self.model)
        self.checkpoints = StepCheckpoints(
            self.model, self.optimizer, self.lr_scheduler, self.checkpointer, self.ranks,
            self.device, parts.checkpoint_settings(
                cfg, seed=self.seed, global_batch_size=self.batch_size * self.world_size,
                config_changes=changes),
            is_lora=self.is_lora, model_files=self.model_files,
            model_state=partial(self.source.model_state, self.model, self.ranks, self.device),
            entries=self.source.state_entries(self.model, self.ranks))
        skipped_steps = 0
        if self.resume_dir is not None:
            resumed = self.checkpoints.restore(load_recipe_state(self.resume_dir),
                                               self.resume_dir)
            self.step, skipped_steps = resumed.step, resumed.skipped_steps
        if self.is_rank_zero and cfg.metric_logger is not None:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)

        self.rules = token_rules(self.tokenizer, self.model, self.device)
        self.allowed_tokens, self.logit_bias = self.rules.allowed, self.rules.logit_bias
        self.stop_tokens, self.pad_id = self.rules.stop_tokens, self.rules.pad_id
        self.policy_update = PolicyUpdate(
            self.model, self.optimizer, self.lr_scheduler, self.loss_fn, self.ranks, self.device,
            parts.update_settings(cfg, seed=self.seed, forward_batch_size=self.forward_batch_size,
                                  vocab_size=self.logit_bias.numel()),
            logit_bias=self.logit_bias, ref_model=self.ref_model, is_lora=self.is_lora,
            activation_offloading=policy.activation_offloading, skipped_steps=skipped_steps,
            progress=self.work)
        if self.eval_dataset is not None:
            self.evaluation = TrainingEvaluation(
                self.model, self.tokenizer, self.eval_dataset, self.rewards, self.eval_settings,
                rules=self.rules, ranks=self.ranks, device=self.device, cache_dtype=self.dtype,
                sources=parts.eval_sources(cfg), stop=self.stop,
                metric_logger=self.metric_logger, gather_weights=cfg.rollout_gather_weights,
                tool_generator=self.eval_tool_generator, progress=cfg.progress_bar)
        self.rollouts = RolloutRuntime(
            self.generator, cfg, rules=self.rules, ranks=self.ranks, seed=self.seed,
            group_size=self.group_size, forward_batch_size=self.forward_batch_size,
            device=self.device, cache_dtype=self.dtype, progress=self.work)
        lora = ({"rank": int(cfg.model.lora_rank), "alpha": float(cfg.model.lora_alpha)}
                if self.is_lora else None)
        self.generator.setup(generation_context(
            cfg, self.checkpointer, self.dataset, max_seq_len=self.max_seq_len,
            device=self.device, dtype=self.dtype, world_size=self.world_size, rank=self.rank,
            allowed_tokens=self.allowed_tokens, lora=lora))
        self.generator.sync_weights(self.model)  # a resumed or LoRA policy is not the base

    def evaluates(self) -> bool:
        """Whether this run evaluates at all (the eval dataset is built only then)."""
        return bool(self.cfg.eval_every_n_steps) or bool(self.cfg.eval_at_start)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """Steps 2-6 on this rank's ``batch`` of prompts; returns the step's metrics.

        Gradient accumulation rolls out and scores the batch in sequential chunks
        (``gradient_accumulation_steps``); the update still sees the whole batch. With
        ``dynamic_sampling``, tied groups are replaced by groups of extra draws
        (:meth:`dynamic_sample`) before the advantages.
        """
        timer = PhaseTimer()
        self.source.begin_step(self.step)
        traj, rewards = self.rollout_and_score(batch, timer)
        sampled = None
        if self.dynamic_sampling is not None:  # DAPO: drop tied groups, draw more prompts
            sampled = self.dynamic_sample(traj, rewards, timer)
            traj, rewards = sampled.traj, sampled.rewards
        with timer("scoring"):
            adv = self.advantages(rewards, traj)
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
        step, self.step = self.step, self.step + 1
        metrics = self.step_metrics(traj, rewards, adv, loss_metrics, timer.seconds)
        if sampled is not None:
            metrics.update(dynamic_sampling_metrics(sampled, timer.seconds, ranks=self.ranks,
                                                    batch_size=self.batch_size,
                                                    device=self.device))
        self.source.step_metrics(step, metrics, self.ranks, self.device)
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
                self.work.begin(f"scoring {trajs[-1].num_sequences} completions")
                scores.append(self.score(trajs[-1], chunk))
                self.work.end()
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

    def rollout(self, batch: dict[str, Any], draw: int = 0) -> Trajectory:
        """Step 2: ``group_size`` completions per prompt, padded to uniform shapes
        (:meth:`RolloutRuntime.rollout`: seeds from ``(seed, step, prompt, sample, draw)``
        alone); with tools, the step's tool counts are summed for :meth:`step_metrics`; the
        source sees each rollout (:meth:`RolloutSource.after_rollout`)."""
        traj = self.rollouts.rollout(self.model, batch, step=self.step, draw=draw)
        if self.tools_on:
            self._tool_stats = self._tool_stats + self.generator.pop_stats()
        self.source.after_rollout(traj, self.step, self.policy_update)
        return traj

    def score(self, traj: Trajectory, batch: dict[str, Any]) -> RewardOutput:
        """Step 3: decode the completions (with tools: model and tool text in order) and
        apply the reward components."""
        return score_rollout(self.rewards, self.tokenizer, traj, batch,
                             group_size=self.group_size, allowed_tokens=self.allowed_tokens,
                             max_generated_tokens=self.cfg.max_generated_tokens,
                             with_tools=self.tools_on)[1]

    def advantages(self, rewards: RewardOutput, traj: Trajectory) -> AdvantageOutput:
        """Step 4: group-relative advantages ``[N]`` of the rewards (``advantages:`` block);
        ``traj``'s generated tokens per completion weigh ``reinforce_pp``'s statistics."""
        settings = self.advantage_settings
        tokens = traj.response_mask if traj.tool_mask is None else (
            traj.response_mask & ~traj.tool_mask)
        return group_advantages(rewards.total.to(self.device), self.group_size,
                                estimator=settings.estimator, scale=settings.scale,
                                eps=settings.eps, token_counts=tokens.sum(1),
                                reduce_sum=self.ranks.all_reduce)

    def loss_mask(self, traj: Trajectory, adv: AdvantageOutput) -> torch.Tensor:
        """``[N, T]`` response tokens that enter the loss and its normaliser
        (``mask_truncated_completions``, ``exclude_zero_std_groups``)."""
        return loss_token_mask(
            traj.response_mask, traj.stopped, adv.zero_std_groups.to(self.device),
            mask_truncated_completions=self.cfg.mask_truncated_completions,
            exclude_zero_std_groups=self.cfg.exclude_zero_std_groups,
        )

    def reference_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Step 5: :meth:`PolicyUpdate.reference_logprobs` ``[N, T]``."""
        return self.policy_update.reference_logprobs(traj)

    def old_logprobs(self, traj: Trajectory) -> torch.Tensor | None:
        """Step 5: ``[N, T]`` log-probs of the rollout under the current policy when the
        generator's own cannot serve as the sampling policy's (see its
        ``needs_policy_logprobs``, e.g. vLLM with ``top_k``) or when the loss needs the
        proximal policy's (:attr:`PolicyUpdate.needs_proximal`); None: use ``traj.logprobs``."""
        if not (self.policy_update.needs_proximal
                or self.generator.needs_policy_logprobs(top_k=self.cfg.top_k)):
            return None
        return self.policy_update.policy_logprobs(traj)

    def update(self, traj: Trajectory, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None, loss_mask: torch.Tensor | None = None,
               old_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Step 6: :meth:`PolicyUpdate.update` of this step; the generator/policy log-prob gap
        is measured when the rollout was sampled with the current weights
        (:meth:`RolloutSource.behavior_is_current`)."""
        return self.policy_update.update(
            traj, advantages, ref_logprobs, loss_mask, old_logprobs, step=self.step,
            measure_gap=self.source.behavior_is_current(self.step))

    # ------------------------------------------------------------------ metrics
    def step_metrics(self, traj: Trajectory, rewards: RewardOutput, adv: AdvantageOutput,
                     loss_metrics: dict[str, float],
                     seconds: dict[str, float]) -> dict[str, float]:
        """The metrics of one step, averaged over all ranks (``docs/metrics.md``;
        :func:`~torchtune_grpo.training.metrics.step_metrics`); the tool counts restart."""
        tool_stats, self._tool_stats = (self._tool_stats if self.tools_on else None), ToolStats()
        return step_metrics(
            traj, rewards, adv, loss_metrics, seconds, ranks=self.ranks, device=self.device,
            group_size=self.group_size, lr=float(self.optimizer.param_groups[0]["lr"]),
            skipped_rows=float(getattr(self.dataset, "skipped_rows", 0)), tool_stats=tool_stats,
            peak_memory=self.cfg.log_peak_memory_stats)

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        """Run the remaining of ``num_steps`` GRPO steps: a list of calls; then the source
        finishes (:meth:`RolloutSource.finish`)."""
        if self.step >= self.cfg.num_steps:
            if self.is_rank_zero:
                log.warning(f"already finished: {self.resume_dir} is step {self.step} and "
                            f"num_steps={self.cfg.num_steps}; nothing to do (raise num_steps to "
                            "train further)")
            self.source.finish()
            return
        if self.evaluation is not None and self.step == 0 and self.cfg.eval_at_start:
            with self.stop.deferred():
                self.evaluation.run_at_start()
        show = self.is_rank_zero and self.cfg.progress_bar
        with StepProgress(self.cfg.num_steps, self.step, show=show,
                          warn=self.is_rank_zero, work=self.work) as self._progress, \
                self.stop.deferred(), self.work:
            bar = self._progress.bar  # a terminal's bar shows the phase; else lines every 30 s
            self.work.bar = bar if bar is not None and not bar.disable else None
            while self.step < self.cfg.num_steps:
                start = time.perf_counter()
                metrics = self.train_step(self.batches.batch(self.step))
                metrics["time/step"] = time.perf_counter() - start  # whole step, rank 0
                if not self.after_step(metrics):
                    break
        if self.health is not None and self.is_rank_zero:
            summary = self.health.summary()
            (log.warning if any(self.health.spans.values()) else log.info)(summary)
        self.source.finish()

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
            for message in self.health.info if self.is_rank_zero else ():
                log.info(message)
        self.log_metrics(metrics)
        preempted = not self.ranks.all_ranks_true(self.stop.requested is None, self.device)
        # a signal (not a time budget's request): evaluations are skipped or cut short
        signalled = preempted and not self.ranks.all_ranks_true(not self.stop.signalled,
                                                                self.device)
        diverged = (skips := self.policy_update.consecutive_skips) >= (
            cfg.max_consecutive_skipped_steps)
        last = self.step == cfg.num_steps
        evaluated, eval_note = None, ""
        if self.evaluation is not None and cfg.eval_every_n_steps and (
                self.step % cfg.eval_every_n_steps == 0 or last):
            if signalled:
                eval_note = "its evaluation was skipped"
            else:
                try:
                    evaluated = self.evaluation.run(self.step)
                except EvaluationInterrupted as exc:
                    preempted, eval_note = True, f"its {exc}"
        if eval_note:
            eval_note = (f" ({eval_note}: `tune run grpo_eval ... checkpoint_dir="
                         f"{cfg.output_dir}/step_{self.step}` evaluates it)")
        if last or preempted or diverged or evaluated is not None or (
                cfg.save_every_n_steps and self.step % cfg.save_every_n_steps == 0):
            self.save_checkpoint(evaluated)
        if preempted:
            if self.is_rank_zero:
                log.warning(f"stopped after step {self.step} on request; saved "
                            f"{cfg.output_dir}/step_{self.step}{eval_note}; continue with the "
                            "same command and resume_from_checkpoint=true")
            return False
        if diverged:
            raise RuntimeError(
                f"{skips} consecutive steps had a non-finite loss or gradient "
                f"(max_consecutive_skipped_steps={cfg.max_consecutive_skipped_steps}); saved "
                f"step_{self.step} and stopped. Lower the learning rate, check the rewards, "
                "or resume from an earlier checkpoint."
            )
        return True

    def save_checkpoint(self, evaluated: EvalResult | None = None) -> None:
        """:meth:`StepCheckpoints.save` of this step, with ``evaluated``'s results inside."""
        self.checkpoints.save(self.step, skipped_steps=self.policy_update.skipped_steps,
                              evaluated=evaluated)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send ``metrics`` to the metric logger (every ``log_every_n_steps``) and the
        progress display."""
        if self.metric_logger is not None and self.step % self.cfg.log_every_n_steps == 0:
            self.metric_logger.log_dict(metrics, step=self.step)
        if self._progress is not None:
            self._progress.update(self.step, metrics)

    def cleanup(self) -> None:
        """Close the generator, the metric logger and the process group (safe to call after
        a failed or partial :meth:`setup`)."""
        try:
            if self.generator is not None:
                self.generator.close()
            if self.metric_logger is not None:
                self.metric_logger.close()
        finally:
            if self.output_lock is not None:
                self.output_lock.release()
            self.stop.restore()
            D.destroy()
