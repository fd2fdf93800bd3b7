"""Scoring completions: answer extraction, reward components, math equivalence, and the reward
set that turns a config's list into per-completion rewards.

The learned reward components are importable from here (``_component_:
torchtune_grpo.rewards.RewardModelScore`` or ``torchtune_grpo.rewards.GenerativeJudge``); they
are loaded on first access, so importing this package does not import their dependencies.
"""

from typing import Any

__all__ = ["GenerativeJudge", "RewardModelScore"]


def __getattr__(name: str) -> Any:
    """``RewardModelScore`` and ``GenerativeJudge`` from :mod:`.learned`, imported when asked."""
    if name in __all__:
        from torchtune_grpo.rewards import learned

        return getattr(learned, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
