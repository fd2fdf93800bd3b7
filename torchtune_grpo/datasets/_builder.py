"""The skeleton every question/answer dataset builder shares (GSM8K, MATH, DeepScaleR).

A builder such as :func:`~torchtune_grpo.datasets.gsm8k_dataset` only knows its own data: its
default source and template, and how one row becomes a ``(question, gold answer)`` pair (its
field names and its answer extraction). Everything else is :func:`build_prompt_dataset`:
checking ``invalid_rows``, resolving the template, loading the rows (local file or Hub, split
slicing, one or several Hub configurations), turning bad rows into errors that name the source,
the row and the field (or skipping and counting them), and handing the pairs to
:class:`~torchtune_grpo.datasets.PromptDataset`, which tokenizes the prompts and applies
``max_prompt_tokens``.

A row reader returns ``(question, answer)`` and raises :class:`InvalidRow` for a row it cannot
use; :func:`required_text` checks the common case of a field that must be a non-empty string.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchtune_grpo.datasets._loading import load_rows
from torchtune_grpo.datasets._prompt import (
    INVALID_ROW_POLICIES,
    PromptDataset,
    PromptTemplate,
    resolve_template,
)
from torchtune_grpo.errors import DataError

__all__ = ["InvalidRow", "RowReader", "build_prompt_dataset", "required_text"]


class InvalidRow(Exception):  # noqa: N818 - a signal from a row reader, not an error to users
    """Raised by a row reader for a row it cannot use.

    Args:
        field: the offending field (``"answer"``).
        what: what is wrong with it, as a predicate (``"is missing"``, ``"is empty"``).
    """

    def __init__(self, field: str, what: str) -> None:
        super().__init__(f"field {field!r} {what}")
        self.field = field
        self.what = what


#: Turns one source row into ``(question, gold answer)``; raises :class:`InvalidRow` on a bad row.
RowReader = Callable[[Mapping[str, Any]], tuple[str, str]]


def required_text(row: Mapping[str, Any], field: str) -> str:
    """The value of a field that must be a non-empty string.

    Args:
        row: a source row.
        field: the field's name.

    Returns:
        The value, unchanged.

    Raises:
        InvalidRow: when the field is missing, not a string, or only white space.
    """
    value = row.get(field)
    if value is None:
        raise InvalidRow(field, "is missing")
    if not isinstance(value, str):
        raise InvalidRow(field, f"is a {type(value).__name__}, not a string")
    if not value.strip():
        raise InvalidRow(field, "is empty")
    return value


def build_prompt_dataset(
    tokenizer: Any,
    *,
    builder: str,
    read_row: RowReader,
    default_template: PromptTemplate,
    source: str,
    split: str,
    data_files: Any = None,
    name: Any = None,
    configurations: Callable[[Any], Sequence[str | None]] | None = None,
    template: PromptTemplate | Mapping[str, Any] | str | None = None,
    max_prompt_tokens: int | None = None,
    invalid_rows: str = "error",
    load_kwargs: Mapping[str, Any] | None = None,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """Load a question/answer source and build its :class:`PromptDataset`.

    The steps, in order: check ``invalid_rows``; resolve ``template`` (``None``:
    ``default_template``); expand ``name`` with ``configurations``; for each configuration,
    load the split with :func:`~torchtune_grpo.datasets.load_rows` (lazily, one after the
    other) and read every row with ``read_row``; build the dataset, which tokenizes the prompts
    and drops or raises on those over ``max_prompt_tokens``. Rows are indexed across all
    configurations in order.

    A row that ``read_row`` rejects raises (``invalid_rows="error"``)
    ``DataError("{builder} ({source}, split '...'): [{configuration} ]row {i} field '{field}'
    {what}. Fix the data, ...")``, the configuration named only when there are several and
    ``i`` the row's number within it, counted from 1; with ``invalid_rows="skip"`` it
    is dropped and counted in ``dataset.skipped_rows``, together with the prompts dropped
    for their length.

    Args:
        tokenizer: a torchtune model tokenizer.
        builder: the public builder's name (``"gsm8k_dataset"``), the start of every message.
        read_row: the builder's row reader: ``row -> (question, answer)``, raising
            :class:`InvalidRow` for a row it cannot use.
        default_template: the template used when ``template`` is ``None``.
        source: Hub dataset id, local file/folder, or a format name used with ``data_files``.
        split: split expression, slicing allowed (``"train[:200]"``); applied per configuration.
        data_files: local file(s), see :func:`~torchtune_grpo.datasets.load_rows`.
        name: the builder's ``name`` argument: the Hub configuration (``None``: the source's
            default), or whatever ``configurations`` expands.
        configurations: for builders whose data comes in several configurations (MATH
            subjects): turns ``name`` into the configurations to load and concatenate, in order,
            raising ``ValueError`` on a bad ``name``; the dataset's own messages then name the
            data ``{source}/{config}+{config}...``. ``None``: load ``name`` alone, and name the
            data by ``source`` only.
        template: anything :func:`~torchtune_grpo.datasets.resolve_template` accepts.
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` or ``"skip"``.
        load_kwargs: passed to ``datasets.load_dataset``.
        difficulty_file: per-row pass rates (``tune-grpo difficulty``); keep only the rows whose
            pass rate lies strictly inside ``difficulty_band`` (see
            :class:`~torchtune_grpo.datasets.PromptDataset`). ``None``: every row.
        difficulty_band: ``[low, high]``; default ``(0, 1)``.

    Returns:
        The :class:`~torchtune_grpo.datasets.PromptDataset` of ``{"tokens", "answer",
        "question", "index"}`` items.

    Raises:
        ValueError: on an unknown ``invalid_rows``, an invalid template, a ``name`` that
            ``configurations`` rejects, an invalid row or too-long prompt with
            ``invalid_rows="error"``, or no usable row.
        FileNotFoundError: when a local source does not exist.
    """
    if invalid_rows not in INVALID_ROW_POLICIES:
        raise DataError(
            f"{builder}: invalid_rows must be one of {INVALID_ROW_POLICIES}, got {invalid_rows!r}"
        )
    template = resolve_template(template, default=default_template)
    names = [name] if configurations is None else list(configurations(name))
    label = source if configurations is None or names == [None] else f"{source}/{'+'.join(names)}"
    where = f"{builder} ({source}, split {split!r})"
    samples: list[tuple[str, str, int]] = []
    skipped = 0
    offset = 0
    for config in names:
        rows = load_rows(
            source, data_files=data_files, split=split, name=config, **(load_kwargs or {})
        )
        count = 0
        for local, row in enumerate(rows):
            count += 1
            try:
                question, answer = read_row(row)
            except InvalidRow as bad:
                if invalid_rows == "skip":
                    skipped += 1
                    continue
                part = f"{config} " if len(names) > 1 else ""
                raise DataError(
                    f"{where}: {part}row {local + 1} field {bad.field!r} {bad.what}. Fix the "
                    "data, or set invalid_rows=skip to drop such rows."
                ) from None
            samples.append((question, answer, offset + local))
        offset += count
    return PromptDataset(
        samples,
        tokenizer,
        template,
        max_prompt_tokens=max_prompt_tokens,
        invalid_rows=invalid_rows,
        skipped_rows=skipped,
        name=f"{builder} ({label}, split {split!r})",
        difficulty_file=difficulty_file,
        difficulty_band=difficulty_band,
    )
