"""GSM8K (grade-school math word problems) as a GRPO prompt dataset."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchtune_grpo.datasets._loading import InvalidRow, build_prompt_dataset, required_text
from torchtune_grpo.datasets._prompt import GSM8K_TEMPLATE, PromptDataset, PromptTemplate

__all__ = ["extract_gsm8k_answer", "gsm8k_dataset", "split_gsm8k_solution"]

_MARKER = "####"


def split_gsm8k_solution(solution: str) -> tuple[str, str] | None:
    """Split a GSM8K reference solution into its reasoning and its final answer.

    Args:
        solution: the ``answer`` field of a GSM8K row: reasoning, then ``#### <final answer>``.

    Returns:
        ``(reasoning, final_answer)``: the text before the last ``####`` (stripped) and the
        text after it, stripped and with thousands commas removed (``"1,000"`` -> ``"1000"``);
        ``None`` when there is no ``####`` or nothing after it.
    """
    if not isinstance(solution, str) or _MARKER not in solution:
        return None
    reasoning, _, final = solution.rpartition(_MARKER)
    final = final.strip().replace(",", "")
    if not final:
        return None
    return reasoning.strip(), final


def extract_gsm8k_answer(solution: str) -> str | None:
    """The gold final answer of a GSM8K reference solution (see :func:`split_gsm8k_solution`).

    Args:
        solution: the ``answer`` field of a GSM8K row.

    Returns:
        The final answer without commas (e.g. ``"18"``), or ``None`` when it has none.
    """
    parts = split_gsm8k_solution(solution)
    return None if parts is None else parts[1]


def _read_row(row: Mapping[str, Any]) -> tuple[str, str]:
    """``(question, gold final answer)`` of a GSM8K row.

    Raises:
        InvalidRow: on a missing, empty or non-string ``question``/``answer``, or an ``answer``
            without a final answer after ``####``.
    """
    question = required_text(row, "question")
    answer = extract_gsm8k_answer(required_text(row, "answer"))
    if answer is None:
        raise InvalidRow("answer", "has no final answer after '####'")
    return question, answer


def gsm8k_dataset(
    tokenizer: Any,
    *,
    source: str = "openai/gsm8k",
    name: str | None = "main",
    split: str = "train",
    data_files: Any = None,
    template: PromptTemplate | Mapping[str, Any] | str | None = None,
    max_prompt_tokens: int | None = None,
    invalid_rows: str = "error",
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
    limit: int | None = None,
    **load_kwargs: Any,
) -> PromptDataset:
    """GSM8K prompts with their gold final answers (the text after ``####``, without commas).

    Args:
        tokenizer: a torchtune model tokenizer.
        source: Hub dataset id, a local file/folder, or a format name with ``data_files`` (see
            :func:`~torchtune_grpo.datasets.load_rows`).
        name: Hub configuration (``"main"`` or ``"socratic"``).
        split: split expression, slicing allowed (``"train[:200]"``).
        data_files: local file(s).
        template: prompt template; default :data:`~torchtune_grpo.datasets.GSM8K_TEMPLATE`.
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` (raise on the first invalid row or too-long prompt) or
            ``"skip"`` (drop and count them).
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.
        limit: keep only the first ``limit`` problems (of the whole split, or slice; rows
            skipped as invalid do not count); ``None``: every one.
        **load_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        A :class:`~torchtune_grpo.datasets.PromptDataset` of ``{"tokens", "answer", "question",
        "index"}`` items.

    Raises:
        ValueError: on an invalid row or too-long prompt with ``invalid_rows="error"`` (naming
            the row and the field), an unknown ``invalid_rows``, or no usable row.
        FileNotFoundError: when a local source does not exist.
    """
    return build_prompt_dataset(
        tokenizer, builder="gsm8k_dataset", read_row=_read_row, default_template=GSM8K_TEMPLATE,
        source=source, split=split, data_files=data_files, name=name, template=template,
        max_prompt_tokens=max_prompt_tokens, invalid_rows=invalid_rows, load_kwargs=load_kwargs,
        difficulty_file=difficulty_file, difficulty_band=difficulty_band, limit=limit)
