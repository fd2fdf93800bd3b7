"""torchtune-grpo: GRPO reinforcement fine-tuning recipes and components for torchtune.

Subpackages: :mod:`torchtune_grpo.rlhf` (generation, rewards, advantages, losses, trajectories)
and :mod:`torchtune_grpo.datasets`; the training step lives in :mod:`torchtune_grpo.recipe`.
"""

__version__ = "0.1.0"
