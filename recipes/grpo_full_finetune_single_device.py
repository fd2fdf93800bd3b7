"""GRPO full fine-tuning on one device (GPU or CPU).

Usage::

    tune run grpo_full_finetune_single_device --config grpo/quickstart_cpu

Same step as ``grpo_full_finetune_distributed`` (the code is shared in
:class:`torchtune_grpo.training.recipe.GRPORecipe`), without a process group or FSDP. Launching it
under torchrun is an error: use the distributed recipe for several ranks.
"""

from omegaconf import DictConfig

from torchtune_grpo.config.loading import parse
from torchtune_grpo.distributed import launched_by_torchrun
from torchtune_grpo.training.recipe import run_recipe


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``--config NAME [key=value ...]``."""
    if launched_by_torchrun() and int(__import__("os").environ.get("WORLD_SIZE", 1)) > 1:
        raise SystemExit(
            "grpo_full_finetune_single_device runs on one device; for several processes use "
            "`tune run --nproc_per_node N grpo_full_finetune_distributed`"
        )
    run_recipe(cfg)


if __name__ == "__main__":
    recipe_main()
