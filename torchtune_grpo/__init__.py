"""torchtune-grpo: GRPO reinforcement fine-tuning recipes and components for torchtune.

The sub-packages follow one GRPO step
(:meth:`torchtune_grpo.training.recipe.GRPORecipe.train_step`):

* :mod:`~torchtune_grpo.datasets` and :mod:`~torchtune_grpo.models`: prompts, tokenizers,
  model builders
* :mod:`~torchtune_grpo.rollout`: sampling a group of completions per prompt
* :mod:`~torchtune_grpo.rewards`: scoring them
* :mod:`~torchtune_grpo.algorithm`: trajectories, group advantages, the loss
* :mod:`~torchtune_grpo.policy`: the policy model's forward passes and log-probs
* :mod:`~torchtune_grpo.backends`: device-specific speed machinery
* :mod:`~torchtune_grpo.training`: the recipe, config, checkpoints, metrics
* :mod:`~torchtune_grpo.evaluation`: held-out evaluation and difficulty scoring
* :mod:`~torchtune_grpo.quickstart` and :mod:`~torchtune_grpo.cli`: tools around the library
"""

__version__ = "0.1.0"
