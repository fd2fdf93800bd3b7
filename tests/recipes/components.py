"""Reward components used by recipe tests (plugged in by `_component_` path)."""

from __future__ import annotations


def length_reward(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Reward = number of characters: varies within every group of a random policy."""
    return [float(len(c)) for c in completions]
