"""Configs shipped with torchtune-grpo (``--config grpo/<name>``)."""
