"""Competition math as prompt datasets: MATH and DeepScaleR-format data.

The gold answer (LaTeX) is the ``answer`` field, else the last ``\\boxed{...}`` of
``solution``; grade it with :class:`~torchtune_grpo.rewards.math_grading.MathEquivalence`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from torchtune_grpo.datasets._loading import InvalidRow, build_prompt_dataset, required_text
from torchtune_grpo.datasets._prompt import PromptDataset, PromptTemplate
from torchtune_grpo.errors import DataError
from torchtune_grpo.rewards.answers import extract_boxed

__all__ = [
    "MATH_SUBJECTS",
    "MATH_TEMPLATE",
    "deepscaler_dataset",
    "format_boxed_completion",
    "math_dataset",
    "math_gold_answer",
]

#: Subject configurations of ``EleutherAI/hendrycks_math``; ``name=None`` loads all of them.
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
_HENDRYCKS_MATH = "EleutherAI/hendrycks_math"

#: Chat prompt for competition math: reason step by step, final answer in ``\boxed{}`` (the
#: instruction Qwen2.5-Math and DeepSeek-R1 were trained with). No pre-filled tag, so the
#: completion is the whole assistant turn; grade it with ``MathEquivalence``.
MATH_TEMPLATE = PromptTemplate(
    system="You are a helpful assistant that solves competition math problems.",
    user="{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    assistant_prefix="",
    chat=True,
    think_tag=None,
    answer_tag=None,
)


def format_boxed_completion(reasoning: str, answer: str) -> str:
    """A gold completion in the format :data:`MATH_TEMPLATE` asks for.

    Args:
        reasoning: the worked solution (may be empty).
        answer: the final answer (LaTeX, without ``\\boxed``).

    Returns:
        ``reasoning``, a blank line, then ``The final answer is $\\boxed{answer}$.``.
    """
    reasoning = reasoning.strip()
    head = reasoning + "\n\n" if reasoning else ""
    return head + f"The final answer is $\\boxed{{{answer.strip()}}}$."


def math_gold_answer(row: Mapping[str, Any]) -> str | None:
    """The gold answer of a MATH/DeepScaleR row.

    Args:
        row: a row with ``answer`` and/or ``solution``.

    Returns:
        The stripped ``answer`` when it is a non-empty string (or an integer), else the content
        of the last ``\\boxed{...}`` of ``solution``; ``None`` when neither gives an answer.
    """
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    solution = row.get("solution")
    if isinstance(solution, str):
        boxed = extract_boxed(solution)
        if boxed:
            return boxed
    return None


def _read_row(row: Mapping[str, Any]) -> tuple[str, str]:
    """``(problem, gold answer)`` of a MATH/DeepScaleR row (gold answer: :func:`math_gold_answer`).

    Raises:
        InvalidRow: on a missing, empty or non-string ``problem``, an ``answer`` that is neither
            a string nor an integer, or a row that gives no gold answer (naming the field that
            should have given it).
    """
    problem = required_text(row, "problem")
    answer = row.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, str | int)):
        raise InvalidRow("answer", f"is a {type(answer).__name__}, not a string")
    gold = math_gold_answer(row)
    if gold is not None:
        return problem, gold
    solution = row.get("solution")
    if solution is None:
        if answer is not None:
            raise InvalidRow(
                "answer", "is empty and there is no 'solution' to take a \\boxed{} answer from"
            )
        raise InvalidRow("answer", "is missing and there is no 'solution' either")
    if not isinstance(solution, str):
        raise InvalidRow("solution", f"is a {type(solution).__name__}, not a string")
    raise InvalidRow(
        "solution", "has no \\boxed{...} final answer (and there is no 'answer' field)"
    )


def _subjects(
    name: str | Sequence[str] | None, *, source: str, data_files: Any
) -> list[str | None]:
    """The configurations ``math_dataset`` loads for its ``name`` argument, in order.

    Args:
        name: one subject, a list of subjects, or ``None``.
        source: the dataset source.
        data_files: the local file(s), if any.

    Returns:
        ``name`` as a list; for ``None``, every subject in :data:`MATH_SUBJECTS` when loading
        ``EleutherAI/hendrycks_math`` from the Hub, else ``[None]`` (no configuration).

    Raises:
        ValueError: on an empty list or a list with a non-string or empty entry.
    """
    if name is None and source == _HENDRYCKS_MATH and data_files is None:
        return list(MATH_SUBJECTS)
    if name is None or isinstance(name, str):
        return [name]
    names = list(name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise DataError(
            f"math_dataset: name must be a subject, a non-empty list of subjects or null, "
            f"got {name!r}"
        )
    return names


def math_dataset(
    tokenizer: Any,
    *,
    source: str = _HENDRYCKS_MATH,
    name: str | Sequence[str] | None = None,
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
    """MATH problems with their gold answers (:func:`math_gold_answer`).

    Args:
        tokenizer: a torchtune model tokenizer.
        source: Hub dataset id, a local file/folder, or a format name with ``data_files``.
        name: one subject or a list of them, concatenated in order. ``None``: every subject in
            :data:`MATH_SUBJECTS` for ``EleutherAI/hendrycks_math``, none for other sources.
        split: split expression, slicing allowed; applied per subject.
        data_files: local file(s).
        template: prompt template; default :data:`MATH_TEMPLATE`.
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` or ``"skip"``.
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.
        limit: keep only the first ``limit`` problems (of the whole split, or slice; rows
            skipped as invalid do not count); ``None``: every one.
        **load_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        A :class:`~torchtune_grpo.datasets.PromptDataset` (``index`` counted across subjects).

    Raises:
        ValueError: on an invalid row (naming the subject, the row and the field) or too-long
            prompt with ``invalid_rows="error"``, an unknown ``invalid_rows``, an empty ``name``
            list, or no usable row.
        FileNotFoundError: when a local source does not exist.
    """
    return build_prompt_dataset(
        tokenizer, builder="math_dataset", read_row=_read_row, default_template=MATH_TEMPLATE,
        source=source, split=split, data_files=data_files, name=name,
        configurations=partial(_subjects, source=source, data_files=data_files), template=template,
        max_prompt_tokens=max_prompt_tokens, invalid_rows=invalid_rows, load_kwargs=load_kwargs,
        difficulty_file=difficulty_file, difficulty_band=difficulty_band, limit=limit)


def deepscaler_dataset(
    tokenizer: Any,
    *,
    source: str = "agentica-org/DeepScaleR-Preview-Dataset",
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
    """Problems in the DeepScaleR format (``problem``, ``answer``, ``solution``).

    Args:
        tokenizer: a torchtune model tokenizer.
        source: Hub dataset id, a local file/folder, or a format name with ``data_files``.
        split: split expression, slicing allowed.
        data_files: local file(s).
        template: prompt template; default :data:`MATH_TEMPLATE`.
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` or ``"skip"``.
        difficulty_file, difficulty_band: keep only the rows whose pass rate in this
            ``tune-grpo difficulty`` file lies strictly inside ``[low, high]`` (default
            ``[0, 1]``); ``None``: every row.
        limit: keep only the first ``limit`` problems (of the whole split, or slice; rows
            skipped as invalid do not count); ``None``: every one.
        **load_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        A :class:`~torchtune_grpo.datasets.PromptDataset`.

    Raises:
        ValueError: on an invalid row or too-long prompt with ``invalid_rows="error"``, an
            unknown ``invalid_rows``, or no usable row.
        FileNotFoundError: when a local source does not exist.
    """
    return build_prompt_dataset(
        tokenizer, builder="deepscaler_dataset", read_row=_read_row,
        default_template=MATH_TEMPLATE, source=source, split=split, data_files=data_files,
        template=template, max_prompt_tokens=max_prompt_tokens, invalid_rows=invalid_rows,
        load_kwargs=load_kwargs,
        difficulty_file=difficulty_file, difficulty_band=difficulty_band, limit=limit)
