"""Step 2 of every recipe: a group of completions per prompt, with reproducible seeds.

:class:`RolloutRuntime` holds an engine, its token rules and the config's sampling settings;
the step and draw are arguments of each call.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.trajectory import Trajectory, prompt_mask
from torchtune_grpo.backends import backend_for
from torchtune_grpo.policy.model import TokenRules
from torchtune_grpo.progress import SILENT, Progress
from torchtune_grpo.rollout.protocol import GenerationContext, GenerationRequest, Generator
from torchtune_grpo.rollout.seeding import rollout_seeds

__all__ = ["RolloutRuntime", "check_context_length", "generation_context"]


class RolloutRuntime:
    """Sample ``group_size`` completions per prompt with one engine.

    Seeds derive from ``(seed, step, prompt index, sample index, draw)`` alone
    (:func:`rollout_seeds`), so a resumed run repeats its rollouts on any number of ranks.

    Args:
        generator: the engine.
        cfg: the recipe's config after ``with_defaults`` (``max_generated_tokens``,
            ``temperature``, ``top_k``, ``rollout_gather_weights``, ``rollout_batch_size``,
            ``stop_check_interval``; a null one takes the device's default from
            :func:`~torchtune_grpo.backends.backend_for`).
        rules: the token rules of the tokenizer for the policy's vocabulary.
        ranks: the ranks that roll out together (each calls :meth:`rollout` as often as the
            others).
        seed: the run's seed.
        group_size: completions per prompt.
        forward_batch_size: rollouts per forward pass.
        device: the device the prompts go to.
        cache_dtype: the KV cache's dtype (the recipe's ``dtype``).
        progress: where the rollout reports its rows and decode steps (default: nowhere).
    """

    def __init__(self, generator: Generator, cfg: DictConfig, *, rules: TokenRules,
                 ranks: D.Ranks, seed: int, group_size: int, forward_batch_size: int,
                 device: torch.device, cache_dtype: torch.dtype,
                 progress: Progress = SILENT) -> None:
        self.generator = generator
        self.progress = progress
        self.rules = rules
        self.ranks = ranks
        self.seed = seed
        self.group_size = group_size
        self.forward_batch_size = forward_batch_size
        self.device = device
        self.cache_dtype = cache_dtype
        self.max_generated_tokens = int(cfg.max_generated_tokens)
        self.temperature = cfg.temperature
        self.top_k = cfg.top_k
        self.gather_weights = cfg.rollout_gather_weights
        backend = backend_for(device)
        #: decode steps between stop checks
        self.stop_check_interval = int(cfg.get("stop_check_interval")
                                       or backend.stop_check_interval)
        #: rows decoded at once (None: every row of a rollout call)
        self.rollout_batch_size = cfg.get("rollout_batch_size") or (
            None if backend.decode_all_rows else forward_batch_size)

    def rollout(self, model: nn.Module, batch: dict[str, Any], *, step: int,
                draw: int = 0) -> Trajectory:
        """``group_size`` completions of each prompt of ``batch``, padded to uniform shapes.

        Args:
            model: the policy (put in eval mode for the rollout and back in train mode after).
            batch: collated prompts (``tokens`` ``[B, P]``, ``prompt_lengths``, ``indices``).
            step: the training step the seeds derive from.
            draw: 0 for the step's main batch, ``k`` for extra draw ``k`` of dynamic sampling.

        Returns:
            The :class:`Trajectory` of ``B * group_size`` rows.
        """
        tokens = batch["tokens"].to(self.device)
        rules = self.rules
        model.eval()
        request = GenerationRequest(
            tokens, prompt_mask(tokens, batch["prompt_lengths"]),
            group_size=self.group_size, forward_batch_size=self.forward_batch_size,
            rollout_batch_size=self.rollout_batch_size or tokens.shape[0] * self.group_size,
            stop_check_interval=self.stop_check_interval,
            max_generated_tokens=self.max_generated_tokens, temperature=self.temperature,
            top_k=self.top_k, stop_tokens=rules.stop_tokens, pad_id=rules.pad_id,
            logit_bias=rules.logit_bias,
            prompt_seeds=rollout_seeds(self.seed, step, batch["indices"], draw),
            all_done=partial(self.ranks.all_ranks_true, device=self.device),
            cache_dtype=self.cache_dtype, progress=self.progress,
        )
        self.progress.begin(f"rollout of {request.num_rows} rows")
        # an engine that runs the policy once per decode step: gather its shards once
        gathered = model if self.generator.runs_policy() else None
        with D.gathered_for_inference(gathered, enabled=self.gather_weights):
            traj = self.generator.generate(model, request)
        self.progress.end()
        model.train()
        return traj


def check_context_length(dataset: Any, max_generated_tokens: int,
                         max_seq_len: int | None) -> None:
    """The longest prompt of ``dataset`` plus ``max_generated_tokens`` must fit the model's
    ``max_seq_len`` (nothing to check when either is unknown).

    Raises:
        ValueError: naming ``max_generated_tokens``, the longest prompt and the limit.
    """
    lengths = getattr(dataset, "prompt_lengths", None)
    if max_seq_len is None or not lengths:
        return
    need = max(lengths) + max_generated_tokens
    if need > max_seq_len:
        raise ValueError(
            f"config key 'max_generated_tokens' ({max_generated_tokens}) plus the longest "
            f"prompt ({max(lengths)} tokens) is {need}, above the model's max_seq_len of "
            f"{max_seq_len}: lower max_generated_tokens or set dataset.max_prompt_tokens"
        )


def generation_context(cfg: DictConfig, checkpointer: Any, dataset: Any, *,
                       max_seq_len: int | None, device: torch.device, dtype: torch.dtype,
                       world_size: int, rank: int, allowed_tokens: torch.Tensor,
                       lora: dict[str, float] | None) -> GenerationContext:
    """The :class:`GenerationContext` of a run: model files and type, the longest sequence a
    rollout can make (longest prompt plus ``max_generated_tokens``, else the model's limit),
    device and ranks.
    """
    lengths = getattr(dataset, "prompt_lengths", None)
    max_len = (max(lengths) + cfg.max_generated_tokens if lengths
               else int(max_seq_len or 4096))
    return GenerationContext(
        model_dir=str(cfg.checkpointer.checkpoint_dir),
        model_type=checkpointer._model_type.name,
        hf_config=dict(getattr(checkpointer, "_config", None) or {}),
        device=device, dtype=dtype, world_size=world_size, rank=rank,
        max_len=max_len, allowed_tokens=allowed_tokens, lora=lora,
    )
