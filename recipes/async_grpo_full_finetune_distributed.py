"""Asynchronous GRPO: rollout ranks generate while trainer ranks train (``docs/async.md``).

Usage::

    tune run --nproc_per_node 3 async_grpo_full_finetune_distributed \
        --config grpo/quickstart_cpu_async
    tune run --nproc_per_node 8 async_grpo_full_finetune_distributed \
        --config grpo/qwen2_5_3B_full rollout_ranks=2 max_staleness=1

The algorithm's choices, beyond those of ``grpo_full_finetune_distributed`` (whose step the
trainer ranks run unchanged):

* ``rollout_ranks: R`` of the ``N`` processes only generate, each with the whole policy and one
  engine; the other ``N - R`` train with FSDP2 over their own process group;
* the batch of step ``t`` is sampled by the policy after ``max(0, t - k)`` updates
  (``max_staleness: k``), fixed by ``(t, k)`` and not by timing: ``k = 0`` is the synchronous
  algorithm, ``k = 1`` overlaps the generation of step ``t + 1`` with the update of step ``t``;
* after every update, trainer rank 0 broadcasts the new weights to the rollout ranks;
* the loss's ratio is taken against the log-probs the engine sampled with (the behaviour
  policy); ``loss.off_policy_correction`` adds decoupled PPO or truncated importance sampling.

The roles live in :mod:`torchtune_grpo.training.async_recipe`.
"""

from omegaconf import DictConfig

from torchtune_grpo.config.loading import parse
from torchtune_grpo.training.async_recipe import run_async_recipe


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``--config NAME [key=value ...]``."""
    run_async_recipe(cfg)


if __name__ == "__main__":
    recipe_main()
