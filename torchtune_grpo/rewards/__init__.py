"""Scoring completions: answer extraction, reward components, math equivalence and the reward set.

The learned reward components (``RewardModelScore``, ``GenerativeJudge``) are loaded on first
access.
"""

from typing import Any

__all__ = ["GenerativeJudge", "RewardModelScore"]


def __getattr__(name: str) -> Any:
    """``RewardModelScore`` and ``GenerativeJudge`` from :mod:`.learned`, imported when asked."""
    if name in __all__:
        from torchtune_grpo.rewards import learned

        return getattr(learned, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
