"""GRPO building blocks: rollout generation, rewards, advantages, losses, log-probs."""
