"""Prompt templates, prompt tokenization, the generic prompt dataset and its left-padding
collate function.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import Dataset
from torchtune.data import Message

from torchtune_grpo.errors import DataError

__all__ = [
    "GSM8K_PHRASE_TEMPLATE",
    "GSM8K_TEMPLATE",
    "INVALID_ROW_POLICIES",
    "PromptDataset",
    "PromptTemplate",
    "check_limit",
    "check_split",
    "collate_prompts",
    "format_reference_completion",
    "resolve_template",
    "tokenize_prompt",
]

#: Accepted values of ``invalid_rows``: raise on the first bad row, or drop and count them.
INVALID_ROW_POLICIES = ("error", "skip")

#: ``NAME[:N]``: the split slice that ``limit`` replaces.
_FIRST_N = re.compile(r"\s*(\w+)\s*\[\s*:\s*(\d+)\s*\]\s*")


def check_limit(builder: str, limit: Any) -> int | None:
    """``limit`` (keep the first ``limit`` problems) when it is a positive integer or None.

    Raises:
        DataError: another value, naming ``builder``.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"{builder}: limit must be a positive integer or null, got {limit!r}")
    return limit


def check_split(what: str, split: Any, names: Sequence[str]) -> str:
    """``split`` when it is one of ``names``, the splits of a generated dataset (whole: they
    cannot be sliced as Hub and local splits can).

    Raises:
        DataError: another value, naming ``what``; a sliced split (``"test[:4]"``) is told to
            use ``dataset.limit``.
    """
    if isinstance(split, str) and split in names:
        return split
    quoted = [repr(name) for name in names]
    listed = ", ".join(quoted[:-1]) + f" {{}} {quoted[-1]}" if len(quoted) > 1 else quoted[0]
    if isinstance(split, str) and "[" in split:
        first = _FIRST_N.fullmatch(split)
        how = (f"the first {first[2]} problems set dataset.split={first[1]} "
               f"dataset.limit={first[2]}" if first and first[1] in names
               else "the first N problems set dataset.limit=N")
        raise DataError(f"{what}: split {split!r} cannot be sliced (its splits are "
                        f"{listed.format('and')}); to take {how}")
    raise DataError(f"{what}: split must be {listed.format('or')}, got {split!r}")


@dataclass(frozen=True)
class PromptTemplate:
    """How a question becomes a prompt.

    Attributes:
        user: the user message; ``{question}`` is replaced by the question (literal braces:
            ``{{`` and ``}}``).
        system: optional system message.
        assistant_prefix: text that starts the assistant's turn (e.g. ``"<think>"``), not part
            of the completion; its outer whitespace is lost in chat mode.
        chat: use the tokenizer's chat format; ``False`` encodes
            ``system + "\\n\\n" + user + assistant_prefix`` as plain text.
        think_tag: name of the reasoning tag the template asks for, or ``None``.
        answer_tag: name of the final-answer tag the template asks for, or ``None``.
        answer_phrase: the sentence start the final answer follows, or ``None``. These three
            describe the format only; they do not change the prompt.
    """

    user: str = "{question}"
    system: str | None = None
    assistant_prefix: str = ""
    chat: bool = True
    think_tag: str | None = None
    answer_tag: str | None = None
    answer_phrase: str | None = None

    def format_user(self, question: str) -> str:
        """``user`` with ``{question}`` filled in."""
        return self.user.format(question=question)


#: A reasoning template for GSM8K-style problems: think inside ``<think>``, answer with only the
#: final number inside ``<answer>``. The assistant turn is pre-filled with ``<think>``, so score
#: format with ``FormatReward(prefix="<think>")``.
GSM8K_TEMPLATE = PromptTemplate(
    system=(
        "You are a helpful assistant that solves math word problems. You first think about "
        "the reasoning process step by step and then give the final answer."
    ),
    user=(
        "{question}\n\n"
        "Reason step by step inside <think> </think> tags. Then give only the final answer, "
        "a single number without units, inside <answer> </answer> tags, for example "
        "<think> reasoning here </think> <answer> 42 </answer>."
    ),
    assistant_prefix="<think>",
    chat=True,
    think_tag="think",
    answer_tag="answer",
)


#: A plain-text GSM8K template for small chat models, which follow a closing sentence far
#: more often than an XML layout: the model's own chat template (and default system message),
#: step-by-step reasoning, then "The answer is N." Score it with
#: ``NumericCorrectness(answer_tag=None, answer_phrase="The answer is")`` and
#: ``AnswerPhraseFormat("The answer is")`` (``grpo/smollm2_gsm8k_cpu``).
GSM8K_PHRASE_TEMPLATE = PromptTemplate(
    user=(
        "{question}\n"
        "Solve the problem step by step. At the end, write: The answer is <number>."
    ),
    chat=True,
    answer_phrase="The answer is",
)


def _check_template(template: PromptTemplate, where: str) -> PromptTemplate:
    """Validate a template's fields; ``where`` names it in error messages."""
    for name in ("user", "assistant_prefix"):
        value = getattr(template, name)
        if not isinstance(value, str):
            raise DataError(  # noqa: TRY004 - a config error
                f"{where}: `{name}` must be a string, got {value!r}"
            )
    if template.system is not None and not isinstance(template.system, str):
        raise DataError(f"{where}: `system` must be a string or null, got {template.system!r}")
    if "{question}" not in template.user:
        raise DataError(
            f"{where}: `user` must contain the placeholder {{question}}, got {template.user!r}"
        )
    try:
        template.format_user("x")
    except (KeyError, IndexError, ValueError) as exc:
        raise DataError(
            f"{where}: `user` is not a valid format string ({exc!r}); only {{question}} may be "
            "a placeholder, write literal braces as {{{{ and }}}}"
        ) from exc
    return template


def resolve_template(
    template: PromptTemplate | Mapping[str, Any] | str | None,
    default: PromptTemplate = GSM8K_TEMPLATE,
) -> PromptTemplate:
    """Turn a config value into a :class:`PromptTemplate`.

    Args:
        template: a :class:`PromptTemplate`, a mapping of its fields (``_component_`` ignored), a
            dotted import path to one, or ``None`` for ``default``.
        default: the template used for ``None``.

    Returns:
        The validated template.

    Raises:
        ValueError: on unknown fields, a path that does not import or does not name a
            ``PromptTemplate``, or a ``user`` string without ``{question}``.
    """
    if template is None:
        return _check_template(default, "template (default)")
    if isinstance(template, PromptTemplate):
        return _check_template(template, "template")
    if isinstance(template, str):
        from torchtune.config._utils import _get_component_from_path

        try:
            obj = _get_component_from_path(template)
        except Exception as exc:
            raise DataError(
                f"template: {template!r} does not import ({exc}); give the dotted path of a "
                "PromptTemplate object, or the template's fields as a mapping"
            ) from exc
        if not isinstance(obj, PromptTemplate):
            raise DataError(  # noqa: TRY004 - a config error
                f"template: {template!r} is a {type(obj).__name__}, not a PromptTemplate"
            )
        return _check_template(obj, f"template {template!r}")
    if hasattr(template, "keys"):  # Mapping or DictConfig
        from omegaconf import DictConfig, OmegaConf

        values = (
            OmegaConf.to_container(template, resolve=True)
            if isinstance(template, DictConfig)
            else dict(template)
        )
        values.pop("_component_", None)
        allowed = {f.name for f in fields(PromptTemplate)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise DataError(
                f"template: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}"
            )
        return _check_template(PromptTemplate(**values), "template")
    raise DataError(
        f"template: expected a PromptTemplate, a mapping, a dotted path or null, got "
        f"{type(template).__name__}"
    )


def _tokenize_messages_kwargs(tokenizer: Any) -> dict[str, bool]:
    """Keyword that stops ``tokenize_messages`` from closing the last (assistant) turn."""
    try:
        params = inspect.signature(tokenizer.tokenize_messages).parameters
    except (TypeError, ValueError):
        return {"add_end_tokens": False}
    if "add_end_tokens" in params:  # Llama 3 style
        return {"add_end_tokens": False}
    if "add_eos" in params:  # Qwen 2 / 2.5 style: the last assistant turn is left open
        return {"add_eos": False}
    return {"add_end_tokens": False}


def tokenize_prompt(tokenizer: Any, template: PromptTemplate, question: str) -> list[int]:
    """Token ids of the prompt for ``question``, ending where the completion starts.

    Chat mode tokenizes ``[system, user, assistant(assistant_prefix)]`` with the assistant turn
    left open; plain mode encodes ``system + "\\n\\n" + user + assistant_prefix`` with BOS and
    without EOS.

    Args:
        tokenizer: a torchtune model tokenizer (``tokenize_messages`` and ``encode``).
        template: the prompt template.
        question: the question text.

    Returns:
        The prompt's token ids (length ``P``).
    """
    user = template.format_user(question)
    if template.chat:
        messages = []
        if template.system:
            messages.append(Message(role="system", content=template.system, masked=True))
        messages.append(Message(role="user", content=user, masked=True))
        messages.append(Message(role="assistant", content=template.assistant_prefix, eot=False))
        tokens, _ = tokenizer.tokenize_messages(messages, **_tokenize_messages_kwargs(tokenizer))
        return list(tokens)
    text = user + template.assistant_prefix
    if template.system:
        text = template.system + "\n\n" + text
    return list(tokenizer.encode(text, add_bos=True, add_eos=False))


def format_reference_completion(template: PromptTemplate, reasoning: str, final_answer: str) -> str:
    """A gold completion in the format ``template`` asks for (without its ``assistant_prefix``).

    The reasoning goes in the think block (its opening tag omitted when the prefix ends with it),
    the final answer in the answer block, else after ``answer_phrase`` (default
    ``"The final answer is"``).
    """
    reasoning = reasoning.strip()
    if template.think_tag:
        opening, closing = f"<{template.think_tag}>", f"</{template.think_tag}>"
        prefilled = template.assistant_prefix.rstrip().endswith(opening)
        head = ("" if prefilled else opening) + "\n" + reasoning + "\n" + closing + "\n"
    else:
        head = reasoning + "\n" if reasoning else ""
    if template.answer_tag:
        tail = f"<{template.answer_tag}>{final_answer}</{template.answer_tag}>"
    else:
        tail = f"{template.answer_phrase or 'The final answer is'} {final_answer}."
    return head + tail


class PromptDataset(Dataset):
    """Tokenized prompts with their gold answers; generic over the question source.

    Prompts are tokenized up front; one is too long beyond ``max_prompt_tokens`` or when it reaches
    the tokenizer's ``max_seq_len``.

    Args:
        samples: ``(question, answer, index)`` triples; ``index`` is the row's index in its
            source.
        tokenizer: a torchtune model tokenizer.
        template: anything :func:`resolve_template` accepts (``None``: :data:`GSM8K_TEMPLATE`).
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` (raise on an over-long prompt) or ``"skip"`` (drop it).
        skipped_rows: rows the caller already dropped.
        name: the dataset's name, used in error messages.
        difficulty_file: per-row pass rates (:mod:`torchtune_grpo.datasets.difficulty`); keep
            the rows strictly inside ``difficulty_band``. ``None``: every row.
        difficulty_band: ``[low, high]``, ``0 <= low < high <= 1``; default ``(0, 1)``.

    Raises:
        ValueError: on an unknown ``invalid_rows``, a non-positive ``max_prompt_tokens``, an
            over-long prompt with ``invalid_rows="error"``, or no prompt left.

    Attributes:
        skipped_rows: number of source rows dropped (invalid or too long).
        template: the resolved template.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, str, int]],
        tokenizer: Any,
        template: PromptTemplate | Mapping[str, Any] | str | None = None,
        *,
        max_prompt_tokens: int | None = None,
        invalid_rows: str = "error",
        skipped_rows: int = 0,
        name: str = "dataset",
        difficulty_file: str | None = None,
        difficulty_band: Sequence[float] = (0.0, 1.0),
    ) -> None:
        if invalid_rows not in INVALID_ROW_POLICIES:
            raise DataError(
                f"{name}: invalid_rows must be one of {INVALID_ROW_POLICIES}, got {invalid_rows!r}"
            )
        if max_prompt_tokens is not None and (
            isinstance(max_prompt_tokens, bool)
            or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens <= 0
        ):
            raise DataError(
                f"{name}: max_prompt_tokens must be a positive integer or null, "
                f"got {max_prompt_tokens!r}"
            )
        self.template = resolve_template(template)
        self.skipped_rows = int(skipped_rows)
        #: rows left out by ``difficulty_file`` (pass rate outside ``difficulty_band``)
        self.dropped_by_difficulty = 0
        if difficulty_file is not None:
            from torchtune_grpo.datasets.difficulty import select_by_difficulty

            samples, self.dropped_by_difficulty = select_by_difficulty(
                list(samples), difficulty_file, difficulty_band, name=name)
        seq_limit = getattr(tokenizer, "max_seq_len", None)
        self._tokens: list[list[int]] = []
        self._answers: list[str] = []
        self._questions: list[str] = []
        self._indices: list[int] = []
        for question, answer, index in samples:
            tokens = tokenize_prompt(tokenizer, self.template, question)
            problem = None
            if max_prompt_tokens is not None and len(tokens) > max_prompt_tokens:
                problem = f"has {len(tokens)} prompt tokens, more than max_prompt_tokens="
                problem += f"{max_prompt_tokens}"
            elif seq_limit and len(tokens) >= seq_limit:
                problem = (
                    f"reaches the tokenizer's max_seq_len={seq_limit} ({len(tokens)} tokens) and "
                    "was truncated"
                )
            if problem is not None:
                if invalid_rows == "skip":
                    self.skipped_rows += 1
                    continue
                raise DataError(
                    f"{name}: row {index + 1} (field 'question') {problem}. Raise the limit, or "
                    "set invalid_rows=skip to drop such rows."
                )
            self._tokens.append(tokens)
            self._answers.append(answer)
            self._questions.append(question)
            self._indices.append(int(index))
        if not self._tokens:
            raise DataError(
                f"{name}: no usable rows ({self.skipped_rows} skipped); check the data source, "
                "the split and max_prompt_tokens"
            )

    def __len__(self) -> int:
        """Number of prompts."""
        return len(self._tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """``{"tokens": list[int] (length P), "answer": str, "question": str, "index": int}``."""
        return {
            "tokens": list(self._tokens[i]),
            "answer": self._answers[i],
            "question": self._questions[i],
            "index": self._indices[i],
        }

    @property
    def prompt_lengths(self) -> list[int]:
        """Number of tokens of every prompt, in dataset order."""
        return [len(t) for t in self._tokens]


def collate_prompts(batch: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Stack prompts into a left-padded batch, so that all prompts end at column ``P - 1``.

    Args:
        batch: ``B`` items of a :class:`PromptDataset`.
        pad_id: the padding token id.

    Returns:
        ``tokens``: LongTensor ``[B, P]`` (``P`` the longest prompt), left-padded with
        ``pad_id``; ``prompt_lengths``: LongTensor ``[B]``; ``answers``: ``list[str]`` of
        length ``B``; ``questions``: ``list[str]``; ``indices``: LongTensor ``[B]``.

    Raises:
        ValueError: on an empty batch or an empty prompt.
    """
    if not batch:
        raise DataError("collate_prompts: the batch is empty")
    lengths = [len(item["tokens"]) for item in batch]
    if min(lengths) == 0:
        row = int(batch[lengths.index(0)].get("index", -1)) + 1
        raise DataError(f"collate_prompts: the prompt of row {row} is empty")
    width = max(lengths)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, item in enumerate(batch):
        tokens[row, width - lengths[row] :] = torch.as_tensor(item["tokens"], dtype=torch.long)
    return {
        "tokens": tokens,
        "prompt_lengths": torch.tensor(lengths, dtype=torch.long),
        "answers": [item["answer"] for item in batch],
        "questions": [item["question"] for item in batch],
        "indices": torch.tensor([item["index"] for item in batch], dtype=torch.long),
    }
