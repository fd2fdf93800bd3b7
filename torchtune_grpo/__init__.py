"""torchtune-grpo: GRPO reinforcement fine-tuning recipes and components for torchtune.

The sub-packages in layer order (each imports only from those before it; ``docs/design.md``):

* :mod:`~torchtune_grpo.errors`, :mod:`~torchtune_grpo.distributed`,
  :mod:`~torchtune_grpo.token_rules`: user errors, ranks, the ids a completion may hold
* :mod:`~torchtune_grpo.policy`: the policy decoder, its output head, forward passes, KV cache
* :mod:`~torchtune_grpo.models`: HF folders to architectures, tokenizers, GGUF import
* :mod:`~torchtune_grpo.backends`: device-specific speed machinery
* :mod:`~torchtune_grpo.algorithm`: trajectories, group advantages, the loss
* :mod:`~torchtune_grpo.rollout`: sampling a group of completions per prompt
* :mod:`~torchtune_grpo.rewards`: scoring them
* :mod:`~torchtune_grpo.datasets`: prompts
* :mod:`~torchtune_grpo.evaluation`: held-out evaluation and difficulty scoring
* :mod:`~torchtune_grpo.checkpoints`: step folders, resume, one run per output folder
* :mod:`~torchtune_grpo.config`: loading and validating a config
* :mod:`~torchtune_grpo.training`: the recipe
  (:meth:`~torchtune_grpo.training.recipe.GRPORecipe.train_step`) and its parts
* :mod:`~torchtune_grpo.quickstart` and :mod:`~torchtune_grpo.cli`: tools around the library
"""

__version__ = "0.1.0"
