"""The shipped reward components.

A *reward component* is any callable with the signature::

    component(completions: list[str], answers: list[str], **kwargs) -> Sequence[float] | Tensor

returning one float per completion (a sequence or tensor of length ``N``). The recipe passes
these keyword arguments, and every component must accept (and may ignore) unknown ones through
``**kwargs``:

- ``questions: list[str]``: the prompts' questions.
- ``stopped: list[bool]``: whether each completion ended on a stop token (not truncated).
- ``response_lengths: list[int]``: number of generated tokens of each completion.
- ``max_generated_tokens: int``: the generation budget.

Components are built from the ``rewards`` list of a config by
:func:`~torchtune_grpo.rewards.build.build_reward_set`. The weights, names and the success
definition live in the config entry, not in the component: the
:class:`~torchtune_grpo.rewards.reward_set.RewardSet` applies them.

Shipped components: :class:`NumericCorrectness` (GSM8K-style final-number correctness),
:class:`FormatReward` (the ``<think>...</think><answer>...</answer>`` layout),
:class:`AnswerPhraseFormat` ("The answer is 42.") and :class:`OverlongPenalty` (DAPO's soft
length penalty). They read answers with :mod:`torchtune_grpo.rewards.answers`, the module that
evaluation graders use too, so training and evaluation score answers alike.
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

    The final answer is extracted from each completion as follows:

    - ``answer_tag`` set (default ``"answer"``): the content of the last complete
      ``<answer>...</answer>`` block (see :func:`.extract_tagged`); the last number in that
      content (see :func:`.parse_number`) is the answer. A block without a number scores 0.
      If the completion has no complete block, ``fallback="last_number"`` uses the last number
      of the whole completion, and ``fallback="none"`` scores 0.
    - ``answer_phrase`` set (with ``answer_tag=None``), e.g. ``"The answer is"``: the last
      number on the line after the phrase's last occurrence (see
      :func:`.extract_after_phrase`); without the phrase, ``fallback`` decides as above.
    - both ``None``: the last number of the whole completion.

    With ``think_tag`` (``"think"`` for Qwen3's thinking mode) all of this reads only the text
    after the completion's reasoning block (:func:`.after_thinking`); a completion whose
    ``<think>`` never closes has no answer (0).

    Gold answers are parsed with :func:`.parse_number` too, so ``"1,000"`` and ``"1000"`` are the
    same gold answer. A gold answer without any number raises ``ValueError`` (the dataset does
    not fit this component). Completions never make it raise.

    Args:
        answer_tag: name of the tag holding the final answer, or ``None``.
        fallback: ``"none"`` or ``"last_number"``: what to do when ``answer_tag`` (or
            ``answer_phrase``) is set and a completion has no complete answer block (phrase).
        rel_tol: relative tolerance of the comparison (see :func:`.numbers_match`).
        answer_phrase: the phrase that introduces the final answer, for models asked to end
            with a sentence instead of a tag; needs ``answer_tag: null``.
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
        """The numeric final answer of one completion, or ``None`` when it has none.

        Args:
            completion: the generated text.

        Returns:
            The extracted number, or ``None``.
        """
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
        """Score a batch.

        Args:
            completions: ``N`` generated texts.
            answers: ``N`` gold answers (GSM8K final answers such as ``"1,000"``).
            **kwargs: ignored.

        Returns:
            ``N`` floats in ``{0.0, 1.0}``.

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

    With ``L = max_generated_tokens`` (from the recipe, or ``max_tokens``) and a buffer of
    ``cache_tokens``: a completion of ``n`` generated tokens scores ``0`` when
    ``n <= L - cache_tokens``, ``(L - cache_tokens - n) / cache_tokens`` (from 0 down to -1)
    inside the buffer, and ``-1`` beyond ``L`` (not reachable when ``L`` is the generation
    limit). Add it to ``rewards`` with a weight, next to a correctness component.

    Args:
        cache_tokens: length of the soft-penalty buffer (DAPO: 4096 of 20480).
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
    """Reward for following the reasoning template's layout.

    The text checked is ``prefix + completion`` (pass the template's ``assistant_prefix``, e.g.
    ``"<think>"``, when the prompt pre-fills it). Tags are matched literally and
    case-sensitively. The rule:

    1. **Answer block**: the text holds exactly one ``<answer>`` and exactly one ``</answer>``,
       the opening one first, and the content between them is non-empty after stripping
       whitespace. Without it the score is **0.0**.
    2. **Score 1.0** when, in addition:

       - *before* ``<answer>`` there is, up to surrounding whitespace, exactly one
         ``<think>...</think>`` block with non-empty content and nothing else (no other text,
         no other think tags); with ``require_think=False`` the part before ``<answer>`` may
         instead be whitespace only;
       - *after* ``</answer>`` there is nothing but whitespace and special-token markers such
         as ``<|eot_id|>`` or ``<|im_end|>``.
    3. **Score 0.5** otherwise (a well-formed answer block, but not the full layout).

    Args:
        think_tag: name of the reasoning tag.
        answer_tag: name of the answer tag.
        require_think: whether the reasoning block is required for full credit.
        prefix: text prepended to every completion before checking (the prompt's
            ``assistant_prefix``; the recipe does not prepend it for you).

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
        """Score one completion (see the class docstring for the rule).

        Args:
            completion: the generated text (without the prefix).

        Returns:
            1.0, 0.5 or 0.0.
        """
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
        """Score a batch.

        Args:
            completions: ``N`` generated texts.
            answers: ``N`` gold answers (unused).
            **kwargs: ignored.

        Returns:
            ``N`` floats in ``{0.0, 0.5, 1.0}``.
        """
        return [self.score(c) for c in completions]


class AnswerPhraseFormat:
    """Reward for ending with a plain-text final-answer sentence ("The answer is 42.").

    For chat models that are asked to finish with a phrase rather than tags (small instruct
    models follow a sentence far more often than an XML layout). The rule:

    - **1.0**: the last non-empty line of the completion contains ``phrase`` followed by a
      number (see :func:`.extract_after_phrase` and :func:`.parse_number`), and the completion
      ended on a stop token (it was not cut at ``max_generated_tokens``);
    - **0.5**: ``phrase`` followed by a number appears somewhere (an earlier line, or a
      completion that was cut off later);
    - **0.0** otherwise.

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
        """Score one completion (see the class docstring).

        Args:
            completion: the generated text.
            stopped: whether it ended on a stop token.

        Returns:
            1.0, 0.5 or 0.0.
        """
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
        """Score a batch.

        Args:
            completions: ``N`` generated texts.
            answers: ``N`` gold answers (unused).
            stopped: ``N`` flags, True where the completion ended on a stop token (the
                recipe passes them); ``None`` treats every completion as stopped.
            **kwargs: ignored.

        Returns:
            ``N`` floats in ``{0.0, 0.5, 1.0}``.
        """
        flags = [True] * len(completions) if stopped is None else list(stopped)
        return [self.score(c, bool(f)) for c, f in zip(completions, flags, strict=True)]
