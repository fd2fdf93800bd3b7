"""GRPO full fine-tuning, distributed with FSDP2 (or one process without torchrun).

Usage::

    tune run --nproc_per_node 8 grpo_full_finetune_distributed --config grpo/qwen2_5_3B_full
    tune run grpo_full_finetune_distributed --config grpo/quickstart_cpu output_dir=/tmp/run

The algorithm's choices, each a config key (see ``docs/``):

* each rank draws ``batch_size`` prompts and samples all ``group_size`` completions of each
  itself, so a group never straddles ranks and advantages need no communication;
* completions are padded to one shape per rank (prompts left, responses right); all ranks
  decode the same number of steps, so FSDP's collectives stay in lockstep;
* sampling cannot emit ids the tokenizer does not define, and the same restriction applies
  to the training log-probs;
* advantages are ``(r - mean_group) / (std_group + eps)`` (``advantages.scale``);
* the loss (``loss._component_``) is a clipped surrogate with optional KL to a frozen
  reference, normalised by a *global* denominator so neither micro-batching
  (``forward_batch_size``) nor the number of ranks changes the update;
* ``ppo_epochs`` optimizer steps reuse the rollout and its generation-time log-probs.

The step itself lives in :class:`torchtune_grpo.training.recipe.GRPORecipe`, shared with
``grpo_full_finetune_single_device``.
"""

from omegaconf import DictConfig

from torchtune_grpo.config.loading import parse
from torchtune_grpo.training.recipe import run_recipe


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``--config NAME [key=value ...]``."""
    run_recipe(cfg)


if __name__ == "__main__":
    recipe_main()
