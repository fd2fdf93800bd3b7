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
:data:`torchtune_grpo.config.schema.RECIPE_KEYS`: the recipe reads ``cfg.key`` after
:func:`~torchtune_grpo.config.schema.with_defaults`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import training, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.advantages import AdvantageOutput, group_advantages, loss_token_mask
from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories
from torchtune_grpo.backends import backend_for
from torchtune_grpo.checkpoints.recipe_state import RecipeCheckpoints
from torchtune_grpo.config.schema import RECIPE_KEYS, Key, per_rank_batch_size, with_defaults
from torchtune_grpo.config.settings import (
    AdvantageSettings,
    DynamicSamplingSettings,
    settings_from_config,
)
from torchtune_grpo.config.validation import check_device, validate_config
from torchtune_grpo.evaluation.during_training import RecipeEvaluation
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.policy.model import DTYPES
from torchtune_grpo.rewards.reward_set import RewardOutput
from torchtune_grpo.rewards.scoring import concat_reward_outputs, score_rollout
from torchtune_grpo.rollout.tool_trajectory import ToolStats
from torchtune_grpo.training.batching import (
    SampledGroups,
    dynamic_sample,
    split_batch,
)
from torchtune_grpo.training.interrupts import StopSignals
from torchtune_grpo.training.metrics import PhaseTimer, peak_memory_gb
from torchtune_grpo.training.recipe_setup import RecipeSetup
from torchtune_grpo.training.recipe_update import RecipeUpdate

log = utils.get_logger("INFO")


def _world_size_from_env() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank_from_env() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


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


class GRPORecipe(RecipeSetup, RecipeUpdate, RecipeCheckpoints, RecipeEvaluation):
    """GRPO full fine-tuning on one or many ranks (see the module docstring for the step).

    Args:
        cfg: the merged config; validated before anything is built.
    """

    #: config keys of this recipe beyond :data:`~torchtune_grpo.config.schema.RECIPE_KEYS`
    EXTRA_KEYS: dict[str, Key] = {}

    def __init__(self, cfg: DictConfig) -> None:
        # Ctrl-C / SIGTERM from the first second: one line while setting up, a clean stop
        # that keeps the work done while evaluating or training
        self.stop = StopSignals("the run", quiet=_rank_from_env() != 0).install()
        self.validate(cfg)
        self.cfg = cfg = with_defaults(cfg, {**RECIPE_KEYS, **self.EXTRA_KEYS})
        check_device(cfg.device)
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
        self._adapter_state = None
        self.output_lock = None  # rank 0: the lock on output_dir (setup)
        self.model_files: dict[str, bytes] = {}  # rank 0: written into every step folder

    def validate(self, cfg: DictConfig) -> None:
        """Check the config before anything is built
        (:func:`~torchtune_grpo.config.validation.validate_config` with the world size torchrun
        set)."""
        validate_config(cfg, world_size=_world_size_from_env(), extra_keys=self.EXTRA_KEYS)

    def init_process_group(self) -> D.Ranks:
        """The ranks that train together: the default process group under torchrun (this
        process alone without)."""
        D.init_distributed(self.device, timeout_s=float(self.cfg.distributed_timeout_s))
        return D.WORLD

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
            self._tool_stats = self._tool_stats + self.generator.pop_stats()
        return traj

    def _gathered(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """Under FSDP2, ``model``'s weights all-gathered once for a no-grad phase and freed at
        its end (:func:`~torchtune_grpo.distributed.gathered_for_inference`), not once per
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

    def behavior_is_current(self) -> bool:
        """Whether this step's rollout was sampled with the weights the update starts from
        (always, here): then the first epoch's forward also measures the generator/policy
        log-prob gap."""
        return True

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
            # groups whose completions were all right: tied, but solved (run health)
            "solved_group_fraction": self._global_mean(
                rewards.success.reshape(-1, self.group_size).all(1).float()),
        }
        for name, values in rewards.components.items():
            metrics[f"reward/{name}"] = self._global_mean(values.float())
        for name, count in rewards.errors.items():
            errors = self.ranks.all_reduce(torch.tensor([float(count)], device=self.device), "sum")
            metrics[f"reward/{name}/errors"] = float(errors)
        for name, count in sorted(rewards.counts.items()):  # a component's own counters
            total_count = self.ranks.all_reduce(
                torch.tensor([float(count)], device=self.device), "sum")
            metrics[f"reward/{name}"] = float(total_count)
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
            with self.stop.deferred():
                self.run_start_eval()
        with self._progress_bar(), self.stop.deferred():
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
            for message in self.health.info if self.is_rank_zero else ():
                log.info(message)
        self.log_metrics(metrics)
        preempted = not self.ranks.all_ranks_true(self.stop.requested is None, self.device)
        # a signal (not a time budget's request): evaluations are skipped or cut short
        signalled = preempted and not self.ranks.all_ranks_true(not self.stop.signalled,
                                                                self.device)
        diverged = self.consecutive_skips >= cfg.max_consecutive_skipped_steps
        last = self.step == cfg.num_steps
        evaluated, eval_note = None, ""
        if self.eval_dataset is not None and cfg.eval_every_n_steps and (
                self.step % cfg.eval_every_n_steps == 0 or last):
            if signalled:
                eval_note = "its evaluation was skipped"
            else:
                try:
                    evaluated = self.run_eval()
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
            if self.output_lock is not None:
                self.output_lock.release()
            self.stop.restore()
            D.destroy()
