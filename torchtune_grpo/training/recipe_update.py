"""Steps 5-6 of the GRPO step: the reference and old log-probs, and the policy update over
``ppo_epochs`` of shuffled micro-batches (part of
:class:`~torchtune_grpo.training.recipe.GRPORecipe`)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torchtune import utils
from torchtune.modules.peft import disable_adapter

from torchtune_grpo.algorithm.loss import summarize_loss_stats
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.policy.forward import micro_batch_logprobs
from torchtune_grpo.rollout.seeding import mix_seeds

log = utils.get_logger("INFO")


class RecipeUpdate:
    """Steps 5-6 of :class:`~torchtune_grpo.training.recipe.GRPORecipe`: log-probs under the
    reference and the current policy, and the optimizer steps on one rollout."""

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
