"""The shipped reward components.

A reward component is any callable ``component(completions, answers, **kwargs)`` returning one
float per completion; it accepts and may ignore the keyword arguments the recipe passes
(``questions``, ``stopped``, ``response_lengths``, ``max_generated_tokens``). Weights, names and
the success flag belong to the config entry (:class:`~torchtune_grpo.rewards.reward_set.RewardSet`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.rewards.answers import (
    after_thinking,
    extract_after_phrase,
    extract_tagged,
    numbers_match,
    parse_number,
)

__all__ = [
    "AnswerPhraseFormat",
    "FormatReward",
    "NumericCorrectness",
    "OverlongPenalty",
]

# --------------------------------------------------------------------------------------------
# Shipped components
# --------------------------------------------------------------------------------------------


class NumericCorrectness:
    """GSM8K-style correctness: 1.0 when the completion's final answer equals the gold number.

    The answer is the last number of the last complete ``<answer_tag>`` block, else of the line
    after the last ``answer_phrase``, else (``fallback="last_number"`` or neither set) of the
    whole completion; with ``think_tag`` only the text after the reasoning block counts. Gold
    answers are parsed the same way.

    Args:
        answer_tag: name of the tag holding the final answer, or ``None``.
        fallback: ``"none"`` or ``"last_number"``: what a completion without the tag (phrase)
            gets.
        rel_tol: relative tolerance of the comparison (see :func:`.numbers_match`).
        answer_phrase: the phrase that introduces the final answer; needs ``answer_tag: null``.
        think_tag: name of the reasoning block the answer follows (``None``: none).

    Raises:
        ValueError: on an unknown ``fallback``, an empty ``answer_tag``, or both
            ``answer_tag`` and ``answer_phrase`` set.
    """

    name = "correctness"

    def __init__(
        self,
        answer_tag: str | None = "answer",
        fallback: str = "none",
        rel_tol: float = 1e-6,
        answer_phrase: str | None = None,
        think_tag: str | None = None,
    ) -> None:
        if fallback not in ("none", "last_number"):
            raise ValueError(
                f"NumericCorrectness: fallback must be 'none' or 'last_number', got {fallback!r}"
            )
        if answer_tag is not None and (not isinstance(answer_tag, str) or not answer_tag):
            raise ValueError(
                "NumericCorrectness: answer_tag must be a non-empty tag name or None, "
                f"got {answer_tag!r}"
            )
        if answer_phrase is not None and answer_tag is not None:
            raise ValueError(
                "NumericCorrectness: set either answer_tag or answer_phrase, not both (got "
                f"answer_tag={answer_tag!r}, answer_phrase={answer_phrase!r}); use "
                "answer_tag: null with answer_phrase"
            )
        if answer_phrase is not None and (not isinstance(answer_phrase, str)
                                          or not answer_phrase.strip()):
            raise ValueError(f"NumericCorrectness: answer_phrase must be a non-empty string, "
                             f"got {answer_phrase!r}")
        self.answer_tag = answer_tag
        self.answer_phrase = answer_phrase
        self.think_tag = think_tag or None
        self.fallback = fallback
        self.rel_tol = rel_tol

    def extract_answer(self, completion: str) -> float | None:
        """The numeric final answer of one completion, or ``None`` when it has none."""
        if self.think_tag is not None:
            completion = after_thinking(completion, self.think_tag)
            if completion is None:
                return None
        if self.answer_tag is not None:
            content = extract_tagged(completion, self.answer_tag)
        elif self.answer_phrase is not None:
            content = extract_after_phrase(completion, self.answer_phrase)
        else:
            return parse_number(completion)
        if content is None:
            return parse_number(completion) if self.fallback == "last_number" else None
        return parse_number(content)

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Score ``N`` completions against ``N`` gold answers: floats in ``{0.0, 1.0}``.

        Raises:
            ValueError: when a gold answer holds no number.
        """
        scores = []
        for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
            gold = parse_number(str(answer))
            if gold is None:
                raise ValueError(
                    f"NumericCorrectness: gold answer {answer!r} of sample {i} holds no number; "
                    "this component needs numeric gold answers"
                )
            predicted = self.extract_answer(completion)
            correct = predicted is not None and numbers_match(predicted, gold, self.rel_tol)
            scores.append(1.0 if correct else 0.0)
        return scores


_SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|]{0,64}\|>")


class OverlongPenalty:
    """DAPO's soft overlong punishment, a length-only reward component.

    With ``L`` the length limit and ``c = cache_tokens``, ``n`` generated tokens score 0 up to
    ``L - c``, ``(L - c - n) / c`` inside the buffer and -1 beyond ``L``.

    Args:
        cache_tokens: length of the soft-penalty buffer.
        max_tokens: ``L``; default: the ``max_generated_tokens`` the recipe passes.
    """

    name = "overlong"

    def __init__(self, cache_tokens: int, max_tokens: int | None = None) -> None:
        if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int) or cache_tokens < 1:
            raise ValueError(f"OverlongPenalty: cache_tokens must be a positive integer, "
                             f"got {cache_tokens!r}")
        self.cache_tokens = cache_tokens
        self.max_tokens = max_tokens

    def __call__(self, completions: list[str], answers: list[str], *,
                 response_lengths: Sequence[int] | None = None,
                 max_generated_tokens: int | None = None, **kwargs: Any) -> list[float]:
        """Score a batch from ``response_lengths`` (generated tokens, stop token included).

        Raises:
            ValueError: the recipe did not pass ``response_lengths`` or no ``L`` is known.
        """
        limit = self.max_tokens if self.max_tokens is not None else max_generated_tokens
        if response_lengths is None or limit is None:
            raise ValueError("OverlongPenalty needs response_lengths and max_generated_tokens "
                             "(passed by the GRPO recipes) or max_tokens")
        if self.cache_tokens > limit:
            raise ValueError(f"OverlongPenalty: cache_tokens ({self.cache_tokens}) exceeds the "
                             f"maximum length ({limit})")
        start = limit - self.cache_tokens
        scores = []
        for n in response_lengths:
            if n <= start:
                scores.append(0.0)
            elif n <= limit:
                scores.append((start - n) / self.cache_tokens)
            else:
                scores.append(-1.0)
        return scores


class FormatReward:
    """Reward for the ``<think>...</think><answer>...</answer>`` layout of ``prefix + completion``.

    0.0 without exactly one non-empty answer block; 1.0 when it is preceded only by one non-empty
    think block (or whitespace with ``require_think=False``) and followed only by whitespace and
    special-token markers; 0.5 otherwise. Tags match literally.

    Args:
        think_tag: name of the reasoning tag.
        answer_tag: name of the answer tag.
        require_think: whether the reasoning block is required for full credit.
        prefix: text prepended to every completion before checking (the prompt's
            ``assistant_prefix``).

    Raises:
        ValueError: on empty or identical tag names.
    """

    name = "format"

    def __init__(
        self,
        think_tag: str = "think",
        answer_tag: str = "answer",
        require_think: bool = True,
        prefix: str = "",
    ) -> None:
        if not think_tag or not answer_tag or think_tag == answer_tag:
            raise ValueError(
                "FormatReward: think_tag and answer_tag must be distinct non-empty tag names, "
                f"got {think_tag!r} and {answer_tag!r}"
            )
        self.think_open, self.think_close = f"<{think_tag}>", f"</{think_tag}>"
        self.answer_open, self.answer_close = f"<{answer_tag}>", f"</{answer_tag}>"
        self.require_think = bool(require_think)
        self.prefix = prefix or ""

    def score(self, completion: str) -> float:
        """Score one completion (without the prefix): 1.0, 0.5 or 0.0."""
        text = self.prefix + completion
        if text.count(self.answer_open) != 1 or text.count(self.answer_close) != 1:
            return 0.0
        start = text.index(self.answer_open)
        end = text.index(self.answer_close)
        if end < start or not text[start + len(self.answer_open) : end].strip():
            return 0.0
        head = text[:start].strip()
        tail = _SPECIAL_TOKEN_RE.sub("", text[end + len(self.answer_close) :])
        if tail.strip():
            return 0.5
        if not head:
            return 0.5 if self.require_think else 1.0
        if (
            head.startswith(self.think_open)
            and head.endswith(self.think_close)
            and head.count(self.think_open) == 1
            and head.count(self.think_close) == 1
            and head[len(self.think_open) : -len(self.think_close)].strip()
        ):
            return 1.0
        return 0.5

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Score ``N`` completions: floats in ``{0.0, 0.5, 1.0}``."""
        return [self.score(c) for c in completions]


class AnswerPhraseFormat:
    """Reward for ending with a plain-text final-answer sentence ("The answer is 42.").

    1.0 when the last non-empty line holds ``phrase`` and a number and the completion stopped on a
    stop token; 0.5 when ``phrase`` and a number appear elsewhere; 0.0 otherwise.

    Args:
        phrase: the phrase, matched case-insensitively.

    Raises:
        ValueError: on an empty phrase.
    """

    name = "format"

    def __init__(self, phrase: str = "The answer is") -> None:
        if not isinstance(phrase, str) or not phrase.strip():
            raise ValueError(f"AnswerPhraseFormat: phrase must be a non-empty string, "
                             f"got {phrase!r}")
        self.phrase = phrase

    def score(self, completion: str, stopped: bool = True) -> float:
        """Score one completion (``stopped``: it ended on a stop token): 1.0, 0.5 or 0.0."""
        after = extract_after_phrase(completion, self.phrase)
        if after is None or parse_number(after) is None:
            return 0.0
        lines = [line for line in completion.splitlines() if line.strip()]
        last = extract_after_phrase(lines[-1], self.phrase) if lines else None
        if stopped and last is not None and parse_number(last) is not None:
            return 1.0
        return 0.5

    def __call__(self, completions: list[str], answers: list[str],
                 stopped: Sequence[bool] | None = None, **kwargs: Any) -> list[float]:
        """Score ``N`` completions: floats in ``{0.0, 0.5, 1.0}``; ``stopped`` None treats every
        completion as stopped.
        """
        flags = [True] * len(completions) if stopped is None else list(stopped)
        return [self.score(c, bool(f)) for c, f in zip(completions, flags, strict=True)]
