"""Step checkpoints of a recipe: the full model and optimizer state, the recipe state that
makes a resume exact, and the save itself (part of
:class:`~torchtune_grpo.training.recipe.GRPORecipe`)."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf
from torchtune import training, utils

from torchtune_grpo.checkpoints.saving import (
    check_finite,
    non_finite_tensors,
    save_step_checkpoint,
)
from torchtune_grpo.errors import CheckpointError
from torchtune_grpo.evaluation.results import EvalResult

log = utils.get_logger("INFO")


class RecipeCheckpoints:
    """Saving and restoring :class:`~torchtune_grpo.training.recipe.GRPORecipe`'s state: what a
    step folder holds and how a resumed run continues exactly."""

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
            raise CheckpointError(
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
            raise CheckpointError(f"refusing to save step_{self.step}: rank 0 found non-finite "
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
