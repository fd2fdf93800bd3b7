"""Inputs of the learned reward components: padding, the score at the last token, template
fields, and the checks of their common arguments.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "JUDGE_FIELDS",
    "check_count",
    "folder_tokenizer",
    "last_position_scores",
    "pad_left",
    "pad_right",
    "questions_of",
    "resolve_device",
    "resolve_dtype",
    "template_fields",
]

JUDGE_FIELDS = ("question", "completion", "answer")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- pure helpers
def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists into one tensor.

    Args:
        sequences: ``b`` non-empty id lists.
        pad_id: the id written after each sequence.

    Returns:
        ``(tokens [b, L] long, lengths [b] long)`` with ``L`` the longest length.
    """
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return tokens, lengths


def pad_left(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into one tensor, as the generation engine takes them.

    Args:
        sequences: ``b`` non-empty id lists.
        pad_id: the id written before each sequence.

    Returns:
        ``(tokens [b, P] long, mask [b, P] bool)``, the mask True on real tokens.
    """
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        tokens[i, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, width - len(seq):] = True
    return tokens, mask


def last_position_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The score of each right-padded sequence at its last real token (as ``transformers``'
    ``*ForSequenceClassification``, but from the true lengths).

    Args:
        scores: ``[b, L]`` per-position scores.
        lengths: ``[b]`` real tokens per sequence (``1 <= length <= L``).

    Returns:
        ``[b]``, ``scores[i, lengths[i] - 1]``.
    """
    index = (lengths.to(scores.device) - 1).unsqueeze(1)
    return scores.gather(1, index).squeeze(1)


def template_fields(template: str) -> set[str]:
    """The fields a ``str.format`` template names (``{question}`` -> ``"question"``).

    Args:
        template: the template (``{{`` and ``}}`` are literal braces).

    Raises:
        ValueError: the template does not parse, or has a positional field (``{}``, ``{0}``).
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"prompt_template does not parse as a format string ({exc}); write "
                         "literal braces as {{ and }}") from exc
    fields = set()
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if not base or base.isdigit():
            raise ValueError(f"prompt_template has a positional field {{{name}}}; name the field: "
                             f"one of {', '.join('{' + f + '}' for f in JUDGE_FIELDS)}")
        fields.add(base)
    return fields


def check_count(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def resolve_device(device: str, where: str) -> torch.device:
    """``device`` as a :class:`torch.device`, refused when that device is not available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{where}: device {device!r} is not a device ({exc})") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: device {device!r} but CUDA is not available; use "
                         "device: cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{where}: device {device!r} but there are only "
                         f"{torch.cuda.device_count()} CUDA devices")
    return dev


def resolve_dtype(dtype: str, where: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def folder_tokenizer(model_dir: str, chat_template: str | None, where: str) -> Any:
    """The folder's :class:`~torchtune_grpo.models.HFTokenizer`; a chat template is required."""
    from torchtune_grpo.models.chat_template import missing_template_error
    from torchtune_grpo.models.tokenizer import TOKENIZER_CONFIG, HFTokenizer

    tokenizer = HFTokenizer(model_dir, chat_template=chat_template)
    if tokenizer.chat_template is None:
        raise ValueError(f"{where}: {missing_template_error(tokenizer.path, TOKENIZER_CONFIG, [])}"
                         " (or pass `chat_template:` to this reward entry)")
    return tokenizer


def questions_of(kwargs: dict[str, Any], n: int, where: str) -> list[str]:
    questions = kwargs.get("questions")
    if questions is None:
        raise ValueError(f"{where} needs the `questions` keyword argument (the GRPO recipes "
                         "and grpo_eval pass it)")
    questions = list(questions)
    if len(questions) != n:
        raise ValueError(f"{where}: got {len(questions)} questions for {n} completions")
    return [str(q) for q in questions]
