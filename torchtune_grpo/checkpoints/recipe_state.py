"""Step checkpoints of a training run as one part, :class:`StepCheckpoints`: the full model and
optimizer state, the recipe state that makes a resume exact, and the save itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torchtune import training, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.checkpoints.resume_changes import apply_optimizer_settings
from torchtune_grpo.checkpoints.saving import (
    check_finite,
    non_finite_tensors,
    save_step_checkpoint,
)
from torchtune_grpo.errors import CheckpointError
from torchtune_grpo.evaluation.results import EvalResult

log = utils.get_logger("INFO")


class RecipeStateEntries(Protocol):
    """Entries a trainer adds to ``recipe_state.pt`` beyond :class:`StepCheckpoints`' own."""

    def state(self, step: int) -> dict[str, Any]:
        """The entries saved with ``step`` (called on every rank before rank 0 writes; may be
        a collective)."""

    def restore(self, state: dict[str, Any], resume_dir: Path) -> None:
        """Take the entries back from a loaded ``recipe_state.pt`` of ``resume_dir``.

        Raises:
            ValueError: the entries do not fit this run's config.
        """


class NoEntries:
    """No entries beyond :class:`StepCheckpoints`' own (the synchronous recipe)."""

    def state(self, step: int) -> dict[str, Any]:
        """Nothing."""
        return {}

    def restore(self, state: dict[str, Any], resume_dir: Path) -> None:
        """Nothing."""


def full_model_state(model: nn.Module, ranks: D.Ranks,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """``model``'s full state dict on the CPU: gathered onto rank 0 under FSDP2 (a collective
    of the whole world; the other ranks get an empty dict), copied on one rank."""
    if ranks.size() > 1:
        return training.gather_cpu_state_dict(model, ranks.rank() == 0, device)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@dataclass(frozen=True)
class CheckpointSettings:
    """What :class:`StepCheckpoints` reads, fixed for a run.

    Args:
        output_dir: the run's output folder; step ``N`` goes to ``output_dir/step_N``.
        seed: the run's seed (a resume needs the same).
        global_batch_size: prompts per step over all ranks.
        keep_last_n: complete step folders kept (None: all).
        save_adapter_weights_only: LoRA: write the adapters only, not the merged weights.
        model_cfg: the config's ``model`` node (the LoRA settings of an adapter checkpoint).
        eval_dataset: ``(component, split)`` of the evaluation data named in the eval files.
        config: the run's resolved config, stored in ``recipe_state.pt``.
        config_changes: the keys this resume changed against the step's saved config
            (:meth:`~torchtune_grpo.checkpoints.resume_changes.ConfigChange.record`), added
            to the history saved as ``config_changes``.
    """

    output_dir: str
    seed: int
    global_batch_size: int
    keep_last_n: int | None
    save_adapter_weights_only: bool
    model_cfg: Any
    eval_dataset: tuple[str, str]
    config: dict[str, Any]
    config_changes: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Resumed:
    """What a run continues from: the steps finished and the optimizer steps skipped so far."""

    step: int
    skipped_steps: int


class StepCheckpoints:
    """Saving and restoring a run's state: what a step folder holds and how a resumed run
    continues exactly.

    Sampling, prompt order and micro-batch order are pure functions of ``(seed, step)``, so no
    random-generator state is saved: the step, the optimizer and the scheduler are the whole
    state.

    Args:
        model: the policy (FSDP2-sharded over ``ranks`` when they are several).
        optimizer: the policy's optimizer.
        lr_scheduler: its scheduler, or None.
        checkpointer: the torchtune checkpointer that writes the weights in the input format.
        ranks: the ranks that train together.
        device: where the model lives.
        settings: the part's settings.
        is_lora: the policy carries LoRA adapters.
        model_files: rank 0: ``name -> content`` written into every step folder.
        model_state: the full model state dict on rank 0 (every rank calls it);
            :func:`full_model_state` by default.
        entries: extra recipe-state entries (:class:`NoEntries` by default).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 checkpointer: Any, ranks: D.Ranks, device: torch.device,
                 settings: CheckpointSettings, *, is_lora: bool, model_files: dict[str, bytes],
                 model_state: Callable[[], dict[str, torch.Tensor]] | None = None,
                 entries: RecipeStateEntries | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.checkpointer = checkpointer
        self.ranks = ranks
        self.device = device
        self.settings = settings
        self.is_lora = is_lora
        self.model_files = model_files
        self.world_size = ranks.size()
        self.is_rank_zero = ranks.rank() == 0
        self.model_state = model_state or (lambda: full_model_state(model, ranks, device))
        self.entries = entries or NoEntries()
        #: every config change made at a resume of this run, oldest first (saved with each step)
        self.config_changes: list[dict[str, Any]] = []

    def _full_optimizer_state_dict(self) -> dict[str, Any]:
        if self.world_size > 1:  # gathered on rank 0 (a collective: every rank calls it)
            return training.get_full_optimizer_state_dict(
                self.model, self.optimizer, self.is_rank_zero, device=self.device)
        return self.optimizer.state_dict()

    def recipe_state(self, step: int, optimizer_state: dict[str, Any], *, skipped_steps: int,
                     adapter: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """What the next step reads, for ``recipe_state.pt`` (without the extra entries)."""
        return {
            "step": step,
            "seed": self.settings.seed,
            "global_batch_size": self.settings.global_batch_size,
            "world_size": self.world_size,
            "optimizer": optimizer_state,
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "skipped_steps": skipped_steps,
            "adapter": adapter,
            "config": self.settings.config,
            "config_changes": list(self.config_changes),
        }

    def restore(self, state: dict[str, Any], resume_dir: Path) -> Resumed:
        """Load the optimizer and scheduler state of ``state`` (``recipe_state.pt`` of
        ``resume_dir``) and the extra entries; returns where the run continues.

        The config's optimizer and scheduler settings (learning rate, betas, weight decay,
        schedule) are put back over the restored ones
        (:func:`~torchtune_grpo.checkpoints.resume_changes.apply_optimizer_settings`): a rate
        lowered for the resume takes effect from its first step. Whether the config may differ
        from the saved one at all was decided before the model was built
        (:mod:`~torchtune_grpo.checkpoints.resume_changes`).
        """
        fresh_groups = [{k: v for k, v in g.items() if k != "params"}
                        for g in self.optimizer.param_groups]
        if self.world_size > 1:
            training.load_from_full_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], self.device)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        apply_optimizer_settings(self.optimizer, fresh_groups, self.lr_scheduler)
        self.config_changes = [*state.get("config_changes", []),
                               *self.settings.config_changes]
        resumed = Resumed(int(state["step"]), int(state.get("skipped_steps", 0)))
        if self.is_rank_zero:
            log.info(f"resumed from {resume_dir} at step {resumed.step}")
        self.entries.restore(state, resume_dir)
        return resumed

    def save(self, step: int, *, skipped_steps: int,
             evaluated: EvalResult | None = None) -> None:
        """Write ``output_dir/step_{step}`` (rank 0 writes, every rank takes part).

        Args:
            step: the steps finished.
            skipped_steps: optimizer steps skipped so far for a non-finite gradient.
            evaluated: evaluation results of this step, stored inside the folder.

        Raises:
            CheckpointError: rank 0 found non-finite weights (on every rank).
        """
        s = self.settings
        state = self.model_state()
        optimizer_state = self._full_optimizer_state_dict()
        extra_state = self.entries.state(step)
        adapter = None
        # a step with non-finite weights is never saved: the last good one stays the newest
        # (rank 0 holds the gathered weights; every rank raises together)
        finite = not self.is_rank_zero or not non_finite_tensors(state)
        if not self.ranks.all_ranks_true(finite, self.device):
            if self.is_rank_zero:
                check_finite(state, f"step_{step} to {s.output_dir}", action="save")
            raise CheckpointError(f"refusing to save step_{step}: rank 0 found non-finite "
                                  "weights")
        if self.is_rank_zero:
            checkpoint = {training.MODEL_KEY: state}
            if self.is_lora:
                checkpoint = lora_checkpoint(state, s.model_cfg,
                                             adapter_only=s.save_adapter_weights_only)
                adapter = checkpoint[training.ADAPTER_KEY]
            extra = None
            if evaluated is not None:
                extra = evaluated.files(
                    dataset=s.eval_dataset[0], split=s.eval_dataset[1],
                    model_path=str(s.output_dir) + f"/step_{step}", step=step)
            path = save_step_checkpoint(
                output_dir=s.output_dir, step=step, checkpointer=self.checkpointer,
                checkpoint=checkpoint,
                adapter_only=self.is_lora and s.save_adapter_weights_only,
                recipe_state={**self.recipe_state(step, optimizer_state,
                                                  skipped_steps=skipped_steps, adapter=adapter),
                              **extra_state},
                extra_files=extra,
                keep_last_n=s.keep_last_n,
                model_files=self.model_files,
            )
            log.info(f"saved {path}")
        self.ranks.barrier()


def lora_checkpoint(state: dict[str, torch.Tensor], model_cfg: Any, *,
                    adapter_only: bool) -> dict[str, Any]:
    """What a torchtune checkpointer writes for a LoRA policy.

    Args:
        state: the policy's full state dict (base weights and ``lora_a``/``lora_b``).
        model_cfg: the config's ``model`` node (``lora_rank``, ``lora_alpha``,
            ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``).
        adapter_only: leave out the merged weights (``save_adapter_weights_only``).

    Returns:
        ``{"adapter": ..., "adapter_config": ...}`` (PEFT format through the checkpointer)
        plus, unless ``adapter_only``, ``{"model": merged weights}`` that ``transformers``
        and vLLM load without PEFT.
    """
    from torchtune import training
    from torchtune.modules.peft import (
        get_adapter_state_dict,
        get_lora_module_names,
        get_merged_lora_ckpt,
    )

    checkpoint: dict[str, Any] = {
        training.ADAPTER_KEY: get_adapter_state_dict(state),
        training.ADAPTER_CONFIG: {
            "r": model_cfg.lora_rank,
            "lora_alpha": model_cfg.lora_alpha,
            "target_modules": get_lora_module_names(
                list(model_cfg.lora_attn_modules), model_cfg.get("apply_lora_to_mlp", False),
                model_cfg.get("apply_lora_to_output", False),
            ),
            "peft_type": "LORA",
        },
    }
    if not adapter_only:
        checkpoint[training.MODEL_KEY] = get_merged_lora_ckpt(
            dict(state), rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha)
    return checkpoint
