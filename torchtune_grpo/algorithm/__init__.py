"""The GRPO algorithm on tensors: padded trajectories, group advantages and the policy loss.

Pure functions and modules with tensor shapes in their docstrings; nothing here generates text,
reads a model file or talks to other ranks."""
