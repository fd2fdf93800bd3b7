"""Components used by recipe tests (plugged in by `_component_` path)."""

from __future__ import annotations


def length_reward(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Reward = number of characters: varies within every group of a random policy."""
    return [float(len(c)) for c in completions]


def half_tied_length_reward(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Reward = number of characters for prompts whose gold answer is even, 0 for the others:
    about half the groups tie (advantage 0) and the rest vary."""
    return [float(len(c)) if int(a) % 2 == 0 else 0.0 for c, a in zip(completions, answers)]


def _vllm_generator_without_sync():
    from torchtune_grpo.rollout.vllm_engine import VLLMGenerator

    class VLLMGeneratorWithoutSync(VLLMGenerator):
        """A vLLM generator that never receives the policy's weights (a deliberate bug)."""

        def sync_weights(self, model) -> None:
            pass

    return VLLMGeneratorWithoutSync


def VLLMGeneratorWithoutSync(**kwargs):  # noqa: N802 - used as a `_component_` class name
    """Build the never-syncing vLLM generator (vLLM imported only when a test asks for it)."""
    return _vllm_generator_without_sync()(**kwargs)


class CountingLengthReward:
    """Reward = number of characters; reports how many completions of each call are longer
    than ``long_chars`` through ``last_counts`` (the component counters of
    :class:`~torchtune_grpo.rewards.reward_set.RewardSet`), and remembers each call's count in
    :attr:`calls` (class-wide, for in-process tests)."""

    calls: list[int] = []

    def __init__(self, long_chars: int = 4) -> None:
        self.long_chars = long_chars
        self.last_counts: dict[str, int] = {}

    def __call__(self, completions: list[str], answers: list[str], **kwargs) -> list[float]:
        n = sum(len(c) > self.long_chars for c in completions)
        self.last_counts = {"long": n}
        CountingLengthReward.calls.append(n)
        return [float(len(c)) for c in completions]


def slow_addition_dataset(tokenizer, marker: str, seconds: float = 60.0, **kwargs):
    """The addition dataset, built slowly: writes ``marker`` then sleeps, so a test can signal
    a run while it is setting up (before any model loads)."""
    import time
    from pathlib import Path

    from torchtune_grpo.datasets import addition_dataset

    Path(marker).write_text("setting up\n")
    time.sleep(seconds)
    return addition_dataset(tokenizer, **kwargs)


def slow_length_reward(completions: list[str], answers: list[str], seconds: float = 0.5,
                       **kwargs) -> list[float]:
    """:func:`length_reward` after ``seconds`` of sleep: a scoring phase that runs long."""
    import time

    time.sleep(seconds)
    return length_reward(completions, answers)


def odd_answer_fails(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """:func:`length_reward`, raising ``ValueError`` for a prompt whose gold answer is odd: a
    reward component that fails on about half the samples."""
    if any(int(a) % 2 for a in answers):
        raise ValueError("odd answer")
    return length_reward(completions, answers)


class DyingGenerator:
    """The native engine, whose process exits (as if killed) on its ``die_at_call``-th
    rollout: a rollout rank that dies."""

    def __new__(cls, die_at_call: int = 2):
        import os

        from torchtune_grpo.rollout.native import NativeGenerator

        class _Dying(NativeGenerator):
            calls = 0

            def generate(self, model, request):
                self.calls += 1
                if self.calls >= die_at_call:
                    os._exit(9)
                return super().generate(model, request)

        return _Dying()
