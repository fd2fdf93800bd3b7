"""Steps 5-6 of the GRPO step as one part, :class:`PolicyUpdate`: log-probs under the reference
and the current policy, and the optimizer steps on one rollout.

The update is three pieces:

1. the **global normaliser** (:meth:`PolicyUpdate.normalizer`): the loss's normaliser summed
   over every rank, so micro-batching and the number of ranks do not change the update;
2. the **plan** (:func:`plan_micro_batches`): which rows each micro-batch holds in each epoch,
   which micro-batch carries the share of the skipped rows, and which micro-batches are lockstep
   fillers that count nothing: plain data from a pure function;
3. the **loop** (:meth:`PolicyUpdate.update`): run the plan, one optimizer step per epoch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtune import utils
from torchtune.modules.peft import disable_adapter

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.loss import summarize_loss_stats
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.optim import explained_compile_errors
from torchtune_grpo.policy.forward import micro_batch_logprobs
from torchtune_grpo.progress import SILENT, Progress
from torchtune_grpo.rollout.seeding import mix_seeds

log = utils.get_logger("INFO")


@dataclass(frozen=True)
class UpdateSettings:
    """What :class:`PolicyUpdate` reads, fixed for a run.

    Args:
        ppo_epochs: optimizer steps per rollout (``ppo_epochs``).
        forward_batch_size: rows per micro-batch (``forward_batch_size``).
        group_size: completions per prompt.
        seed: the run's seed (the micro-batch order is a function of it).
        temperature: sampling temperature the log-probs are taken at.
        packed: forward passes on packed rows (``packed_forward``).
        share_prompt_forward: with ``packed``, a group's common prompt runs once and its rows
            stay together in the micro-batch order.
        clip_grad_norm: the gradient-norm clip, or None for no clipping.
        skip_zero_advantage_sequences: leave rows with advantage exactly 0 out of the passes
            (when the loss has no KL and no entropy term).
        gather_weights: under FSDP2, gather the weights once per no-grad phase
            (``rollout_gather_weights``).
        chunk_size: vocabulary rows per log-prob chunk.
        keep_probs: float32 elements of probabilities kept for the backward pass.
    """

    ppo_epochs: int
    forward_batch_size: int
    group_size: int
    seed: int
    temperature: float
    packed: bool
    share_prompt_forward: bool
    clip_grad_norm: float | None
    skip_zero_advantage_sequences: bool
    gather_weights: bool
    chunk_size: int
    keep_probs: int


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the plan.

    Args:
        rows: ``[n]`` int64 rows of the trajectory it runs (on the CPU).
        counts: False for a lockstep filler: it runs row 0 with an all-False mask, so that every
            rank runs as many forward and backward passes as the others, and adds nothing.
        adds_skipped_share: its ``normalizer_share`` metric also counts the skipped rows'
            share, so that the loss metrics average whole epochs.
    """

    rows: torch.Tensor
    counts: bool
    adds_skipped_share: bool


def plan_micro_batches(orders: Sequence[torch.Tensor], skip: torch.Tensor, *, size: int,
                       count: int) -> list[list[MicroBatch]]:
    """The update's micro-batches, epoch by epoch.

    Args:
        orders: per epoch, ``[N]`` the row order (a permutation of ``0 .. N-1``).
        skip: ``[N]`` bool, rows left out of every epoch (the order of the others is kept).
        size: rows per micro-batch.
        count: micro-batches per epoch, the same on every rank (at least the number this
            rank's kept rows need); those past the rows are fillers (``counts`` False,
            ``rows`` = ``[0]``).

    Returns:
        ``plan[epoch][i]``: ``count`` micro-batches per epoch; when any row is skipped, the
        first micro-batch of each epoch ``adds_skipped_share``.
    """
    skip = skip.cpu()
    any_skipped = bool(skip.any())
    plan = []
    for order in orders:
        if any_skipped:
            order = order[~skip[order]]  # the same order, less the skipped rows
        epoch = []
        for i in range(0, count * size, size):
            rows = order[i : i + size]
            counts = rows.numel() > 0
            if not counts:
                rows = torch.zeros(1, dtype=torch.long)
            epoch.append(MicroBatch(rows, counts, adds_skipped_share=any_skipped and i == 0))
        plan.append(epoch)
    return plan


def micro_batches_needed(skip: torch.Tensor, size: int) -> int:
    """Micro-batches of ``size`` rows that the rows not in ``skip`` ``[N]`` fill."""
    kept = int((~skip).sum())
    return -(-kept // size)


class PolicyUpdate:
    """Steps 5-6 on one rollout: reference and old log-probs, and ``ppo_epochs`` optimizer
    steps over shuffled micro-batches, each loss divided by the global normaliser.

    Args:
        model: the policy (FSDP2-sharded over ``ranks`` when they are several).
        optimizer: over the policy's trainable parameters.
        lr_scheduler: stepped after every optimizer step, or None.
        loss_fn: the loss (:class:`~torchtune_grpo.algorithm.loss.GRPOLoss` or one with its
            interface).
        ranks: the ranks that train together; every collective of the update goes there.
        device: where the step's tensors live.
        settings: the update's settings.
        logit_bias: ``[V]`` added to the logits before the log-softmax (token rules).
        ref_model: the frozen reference, or None (no KL term, or LoRA: the policy with its
            adapters disabled is the reference).
        is_lora: the policy carries LoRA adapters.
        activation_offloading: the context the update's forward passes run in.
        skipped_steps: optimizer steps skipped for a non-finite gradient before this run
            (a resumed run's count).
        progress: where the update reports the micro-batches done (default: nowhere).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 loss_fn: nn.Module, ranks: D.Ranks, device: torch.device,
                 settings: UpdateSettings, *, logit_bias: torch.Tensor,
                 ref_model: nn.Module | None, is_lora: bool,
                 activation_offloading: contextlib.AbstractContextManager,
                 skipped_steps: int = 0, progress: Progress = SILENT) -> None:
        self.model = model
        self.progress = progress
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self.ranks = ranks
        self.device = device
        self.settings = settings
        self.logit_bias = logit_bias
        self.ref_model = ref_model
        self.is_lora = is_lora
        self.activation_offloading = activation_offloading
        # FSDP averages gradients over ranks, and each rank's loss is already its share of the
        # global mean: the backward pass runs on loss * world size
        self.gradient_scale = ranks.size()
        self.rank = ranks.rank()
        # optimizer steps skipped for a non-finite gradient: in all, and in a row until the last
        self.skipped_steps = skipped_steps
        self.consecutive_skips = 0

    @property
    def needs_proximal(self) -> bool:
        """Whether the loss takes its ratio against the trainer's current weights and weights
        each token by proximal / behaviour (``loss.off_policy_correction``: decoupled, tis)."""
        return bool(getattr(self.loss_fn, "needs_proximal_logprobs", False))

    # ------------------------------------------------------------------ log-probs
    def gathered(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """Under FSDP2, ``model``'s weights all-gathered once for a no-grad phase and freed at
        its end (:func:`~torchtune_grpo.distributed.gathered_for_inference`); a no-op with
        ``gather_weights`` off, on one device or for None."""
        return D.gathered_for_inference(model, enabled=self.settings.gather_weights)

    @torch.no_grad()
    def reference_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Step 5: ``[N, T]`` log-probs of the responses under the frozen reference model.

        With LoRA the reference is the policy itself with its adapters disabled: no second
        copy of the weights exists.
        """
        model = self.model if self.is_lora else self.ref_model
        context = disable_adapter(self.model) if self.is_lora else contextlib.nullcontext()
        with context, self.gathered(model):
            return self.response_logprobs(model, traj, "reference log-probs")

    @torch.no_grad()
    def policy_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Step 5: ``[N, T]`` log-probs of the rollout under the current policy (no graph), 0
        outside the responses."""
        with self.gathered(self.model):
            return self.response_logprobs(self.model, traj, "old log-probs") * traj.response_mask

    def response_logprobs(self, model: nn.Module, traj: Trajectory,
                          phase: str = "log-probs") -> torch.Tensor:
        """``[N, T]`` log-probs of ``traj``'s responses under ``model``, micro-batch by
        micro-batch (call under ``torch.no_grad``), each on its own extent (0 past it);
        reported as ``phase``."""
        size = self.settings.forward_batch_size
        self.progress.begin(phase, total=-(-traj.num_sequences // size), unit="micro-batches")
        parts = []
        for i in range(0, traj.num_sequences, size):
            parts.append(self.micro_batch_logprobs(model, traj, slice(i, i + size))[0])
            self.progress.advance()
        self.progress.end()
        return torch.cat(parts)

    def micro_batch_logprobs(self, model: nn.Module, traj: Trajectory,
                             rows: slice | torch.Tensor,
                             **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [n, T], entropy [n, T] or None)`` of ``traj``'s ``rows``, the model run
        on their real tokens only (``packed``: packed into one row; otherwise on the columns
        that are not padding in all of them); tool tokens (``traj.tool_mask``) are attended
        but get log-prob 0. ``kwargs`` go to
        :func:`~torchtune_grpo.policy.forward.micro_batch_logprobs`."""
        s = self.settings
        return micro_batch_logprobs(
            model, traj.tokens[rows], traj.prompt_mask[rows], traj.response_mask[rows],
            tool_mask=traj.tool_mask[rows], temperature=s.temperature,
            logit_bias=self.logit_bias, chunk_size=s.chunk_size, keep_probs=s.keep_probs,
            pack=s.packed, share_prompts=s.packed and s.share_prompt_forward, **kwargs)

    # ------------------------------------------------------------------ the plan
    def micro_batch_order(self, num_sequences: int, *, step: int, epoch: int) -> torch.Tensor:
        """``[N]`` the update's row order in ``epoch`` of ``step``: a pure function of (seed,
        step, epoch, rank). With prompt sharing whole groups are shuffled and their rows kept
        together, so that a micro-batch holds few distinct prompts."""
        s = self.settings
        gen = torch.Generator().manual_seed(
            int(mix_seeds(s.seed, step, epoch, self.rank, 0x5F0F)))
        group = s.group_size
        if s.packed and s.share_prompt_forward and num_sequences % group == 0:
            groups = torch.randperm(num_sequences // group, generator=gen)
            return (groups[:, None] * group + torch.arange(group)[None, :]).flatten()
        return torch.randperm(num_sequences, generator=gen)

    def skipped_sequences(self, advantages: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: rollouts the update leaves out because they cannot move the weights.

        With ``skip_zero_advantage_sequences``, a sequence whose advantage is exactly 0 (every
        member of a group whose rewards all tie) adds exactly 0 to the gradient of every
        shipped loss unless it has a KL or entropy term, so its forward and backward passes
        are skipped; it still counts in the loss normaliser, so the gradient is the same as
        without skipping (up to float summation order). Nothing is skipped when the loss
        needs reference log-probs or the entropy.
        """
        if (not self.settings.skip_zero_advantage_sequences or self.loss_fn.needs_reference
                or self.loss_fn.needs_entropy):
            return torch.zeros_like(advantages, dtype=torch.bool)
        return advantages == 0

    def normalizer(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of ``loss_mask`` ``[N, T]`` summed over the ranks (float32, on
        the device)."""
        local = self.loss_fn.normalizer_contribution(loss_mask).to(self.device, torch.float32)
        return self.ranks.all_reduce(local.clone(), "sum")

    def plan(self, num_sequences: int, skip: torch.Tensor, *, step: int) -> list[list[MicroBatch]]:
        """:func:`plan_micro_batches` for this rank in ``step``: every rank runs as many
        micro-batches as the rank that needs most (FSDP's collectives), at least one."""
        size = self.settings.forward_batch_size
        local = float(micro_batches_needed(skip, size))
        count = self.ranks.all_reduce(torch.tensor([local], device=self.device), "max")
        orders = [self.micro_batch_order(num_sequences, step=step, epoch=epoch)
                  for epoch in range(self.settings.ppo_epochs)]
        return plan_micro_batches(orders, skip, size=size, count=max(1, int(count)))

    # ------------------------------------------------------------------ the loop
    def update(self, traj: Trajectory, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None, loss_mask: torch.Tensor | None = None,
               old_logprobs: torch.Tensor | None = None, *, step: int,
               measure_gap: bool = True) -> dict[str, float]:
        """Step 6: ``ppo_epochs`` optimizer steps on this rollout; returns loss metrics.

        Args:
            traj: the rollout.
            advantages: ``[N]``.
            ref_logprobs: ``[N, T]`` reference log-probs, or None without a KL term.
            loss_mask: ``[N, T]`` tokens that count (default: every response token).
            old_logprobs: ``[N, T]`` log-probs of the sampling policy (default: the generator's,
                ``traj.logprobs``); with an off-policy correction (:attr:`needs_proximal`)
                the proximal policy's, and ``traj.logprobs`` are the behaviour log-probs.
            step: the steps finished before this one (the micro-batch order depends on it).
            measure_gap: the rollout was sampled with the weights the update starts from.

        Besides the loss metrics, ``generation/logprob_diff_max`` and ``_mean`` compare the
        generator's log-probs with the policy's own in the first epoch (before any optimizer
        step: the same weights), over response tokens, when ``measure_gap``: ~1e-6 for the
        native engine in fp32, larger for another engine or precision, and large when its
        weights were not synced.
        """
        old = traj.logprobs if old_logprobs is None else old_logprobs
        response_mask = traj.response_mask if loss_mask is None else loss_mask
        normalizer = self.normalizer(response_mask)
        skip = self.skipped_sequences(advantages)
        # the skipped rollouts' share of the normaliser, counted with the micro-batch the plan
        # marks, so that the loss metrics still average whole epochs
        skipped_share = (self.loss_fn.normalizer_contribution(response_mask[skip]).to(
            self.device, torch.float32) / normalizer.clamp(min=1e-30)).reshape(())
        plan = self.plan(traj.num_sequences, skip, step=step)
        behavior = traj.logprobs if self.needs_proximal else None
        stats, grad_norms = [], []
        gap = torch.zeros(3, dtype=torch.float64, device=self.device)  # max, sum, count
        self.progress.begin("update", total=sum(len(m) for m in plan), unit="micro-batches")
        for epoch, micro_batches in enumerate(plan):
            for mb in micro_batches:
                idx = mb.rows.to(self.device)
                with self.activation_offloading:
                    logprobs, entropy = self.micro_batch_logprobs(
                        self.model, traj, idx, return_entropy=True,
                        entropy_grad=self.loss_fn.needs_entropy)
                if epoch == 0 and measure_gap and mb.counts:
                    diff = (logprobs.detach() - traj.logprobs[idx]).abs()[traj.response_mask[idx]]
                    if diff.numel():
                        gap[0] = torch.maximum(gap[0], diff.max().double())
                        gap[1] += diff.double().sum()
                        gap[2] += diff.numel()
                mb_mask = response_mask[idx] if mb.counts else torch.zeros_like(response_mask[idx])
                loss, mb_stats = self.loss_fn(
                    logprobs, old[idx], advantages[idx], mb_mask, normalizer=normalizer,
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[idx],
                    entropy=entropy, behavior_logprobs=None if behavior is None else behavior[idx])
                (loss * self.gradient_scale).backward()
                if mb.adds_skipped_share:
                    mb_stats = {**mb_stats, "normalizer_share":
                                mb_stats["normalizer_share"] + skipped_share}
                stats.append(mb_stats)
                self.progress.advance()
            grad_norms.append(self.optimizer_step(step))
        self.progress.end()
        metrics = summarize_loss_stats(stats, all_reduce=self.ranks.all_reduce)
        gap_max = self.ranks.all_reduce(gap[:1].clone(), "max")
        gap_sum = self.ranks.all_reduce(gap[1:].clone(), "sum")
        metrics["generation/logprob_diff_max"] = float(gap_max[0])
        metrics["generation/logprob_diff_mean"] = float(gap_sum[0] / gap_sum[1].clamp(min=1))
        metrics["grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        metrics["skipped_steps"] = float(self.skipped_steps)
        return metrics

    def optimizer_step(self, step: int) -> float:
        """Clip, step (skipped when the gradient is not finite), zero, schedule; returns the
        gradient norm before clipping. ``step``: the steps finished before this one (for the
        warning)."""
        max_norm = float(self.settings.clip_grad_norm or float("inf"))
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            with explained_compile_errors(self.optimizer):  # a compiled step: one line
                self.optimizer.step()
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            log.warning(f"step {step + 1}: non-finite loss or gradient, update skipped "
                        f"({self.consecutive_skips} in a row)")
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return grad_norm
