"""Where prompt datasets come from: rows from local files or the Hugging Face Hub
(:func:`load_rows`), and the skeleton every question/answer builder shares
(:func:`build_prompt_dataset`); a builder gives only its source, template and row reader.
"""


from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchtune_grpo.datasets._prompt import (
    INVALID_ROW_POLICIES,
    PromptDataset,
    PromptTemplate,
    check_limit,
    resolve_template,
)
from torchtune_grpo.errors import DataError, UserError, one_line

__all__ = ["LOCAL_FORMATS", "InvalidRow", "RowReader", "build_prompt_dataset", "load_rows",
           "required_text"]

#: ``datasets`` builder names for local files, and the file extensions that map to them.
LOCAL_FORMATS = {
    "json": (".json", ".jsonl"),
    "parquet": (".parquet",),
    "csv": (".csv",),
}


def _format_of(path: str) -> str | None:
    """The ``datasets`` builder for a file name (``"json"`` for ``x.jsonl``), or ``None``."""
    name = path.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        name = name.removesuffix(suffix)
    for fmt, extensions in LOCAL_FORMATS.items():
        if name.endswith(extensions):
            return fmt
    return None


def _looks_like_path(source: str) -> bool:
    """Whether ``source`` is meant as a local path rather than a Hub dataset id."""
    # Hub ids are "name" or "owner/name"; anything else path-like is a path.
    return (
        source.startswith(("/", ".", "~", "\\"))
        or source.count("/") > 1
        or _format_of(source) is not None
    )


def _file_list(data_files: Any) -> list[str]:
    """All file paths named by a ``data_files`` value (string, list or split mapping)."""
    if isinstance(data_files, str | os.PathLike):
        return [os.fspath(data_files)]
    if isinstance(data_files, Mapping):
        return [path for value in data_files.values() for path in _file_list(value)]
    if isinstance(data_files, Sequence):
        return [path for value in data_files for path in _file_list(value)]
    raise DataError(
        f"data_files must be a path, a list of paths or a mapping split -> paths, got "
        f"{type(data_files).__name__}"
    )


def _under(folder: Path, data_files: Any) -> Any:
    """``data_files`` with relative paths made relative to ``folder``."""
    if isinstance(data_files, str | os.PathLike):
        path = Path(data_files).expanduser()
        return str(path if path.is_absolute() else folder / path)
    if isinstance(data_files, Mapping):
        return {key: _under(folder, value) for key, value in data_files.items()}
    return [_under(folder, value) for value in data_files]


def _check_local_files(files: list[str]) -> None:
    """Raise FileNotFoundError for the first file that does not exist (globs are allowed)."""
    for path in files:
        if any(ch in path for ch in "*?[") or "://" in path:
            continue
        if not Path(path).expanduser().exists():
            raise FileNotFoundError(
                f"data file {path!r} does not exist; check the path (relative paths are "
                f"resolved from {os.getcwd()!r})"
            )


def _check_local_contents(files: list[str]) -> None:
    """Read JSON Lines files before ``datasets`` does, so a bad file is named with its line.

    Raises:
        ValueError: a file that is empty, or a ``.jsonl`` line that is not a JSON object
            (naming the file, the line number and the parser's message).
    """
    import json

    for path in files:
        if any(ch in path for ch in "*?[") or "://" in path:
            continue
        file = Path(path).expanduser()
        if file.is_dir():
            _check_local_contents([str(p) for p in sorted(file.iterdir())
                                   if p.suffix in (".jsonl", ".json")])
            continue
        if not file.is_file():
            continue
        if file.stat().st_size == 0 or not file.read_text(errors="replace").strip():
            raise DataError(f"data file {str(file)!r} is empty")
        if file.suffix != ".jsonl":
            continue
        with file.open(errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"data file {str(file)!r} line {number} is not valid JSON ({exc.msg} at "
                        f"column {exc.colno}): {line.strip()[:80]!r}; fix or remove the line"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"data file {str(file)!r} line {number} is a JSON "
                        f"{type(row).__name__}, not an object with named fields")


class HubUnreachable(UserError, ConnectionError):
    """A Hub dataset could not be downloaded (no network, the Hub down) and is not cached: a
    user error, one line naming the ``source`` key and the local alternative."""


def _load_hub(source: str, name: str | None, split: str, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` of a Hub id; a connection failure says how to use local files.

    Raises:
        HubUnreachable: the Hub could not be reached and no cached copy serves.
    """
    import datasets

    try:
        return datasets.load_dataset(source, name, split=split, **kwargs)
    except (ConnectionError, OSError, TimeoutError) as exc:
        if isinstance(exc, FileNotFoundError) and "doesn't exist on the Hub" in str(exc):
            raise
        why = one_line(str(exc))[:160]
        raise HubUnreachable(
            f"dataset.source (or eval_dataset.source): could not download the Hub dataset "
            f"{source!r} ({type(exc).__name__}: {why}). Without Hub access, set source to local "
            "files: source=/path/to/folder (with train.jsonl and test.jsonl) or "
            "source=FILE.jsonl; with a cached copy, set HF_DATASETS_OFFLINE=1"
        ) from None


def _split_names(split: str) -> list[str]:
    """Split names used in a split expression: ``"train[:200]+test"`` -> ``["train", "test"]``."""
    return [part.split("[", 1)[0].strip() for part in split.split("+") if part.strip()]


def _split_error(exc: ValueError, source: str, split: str) -> DataError | None:
    """The one-line error for a ``datasets`` failure caused by ``split`` (a malformed slice, an
    unknown split name), or None for any other failure."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if text.startswith("Unrecognized instruction format"):
        return DataError(
            f"dataset {source!r}: split {split!r} is not a split expression (NAME, NAME[:N], "
            "NAME[A:B] or NAME[:P%], joined by +); to take the first N problems set "
            "dataset.limit=N")
    if text.startswith("Unknown split"):
        return DataError(f"dataset {source!r}: split {split!r}: {text}")
    return None


def load_rows(
    source: str,
    *,
    data_files: Any = None,
    split: str = "train",
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Load the rows of a dataset split as a ``datasets.Dataset``.

    Local data when ``data_files`` is given or ``source`` exists on disk (format from ``source``
    when it is ``"json"``, ``"parquet"`` or ``"csv"``, else from the extension; a folder's splits
    from its file names); otherwise a Hub dataset. Split slicing (``"train[:200]"``,
    ``"train[:10%]"``) works for local files too.

    Args:
        source: a Hub dataset id, a path to a file or folder, or a format name used together
            with ``data_files``.
        data_files: local file(s): a path, a list of paths or a mapping split -> path(s).
        split: split expression, with optional slicing.
        name: the Hub dataset configuration; ignored for local files.
        **kwargs: passed to ``datasets.load_dataset`` (e.g. ``cache_dir``, ``revision``).

    Returns:
        The ``datasets.Dataset`` of the split.

    Raises:
        FileNotFoundError: when a local file or folder does not exist.
        ValueError: when the format of local files cannot be determined, a local file is
            empty, a JSON Lines row does not parse (naming the file and the line), or ``split``
            is malformed or names no split (naming ``dataset.limit`` as the way to shrink).
        ConnectionError: a Hub dataset could not be reached (the message says how to use
            local files instead).
    """
    try:
        return _load_rows(source, data_files=data_files, split=split, name=name, **kwargs)
    except DataError:
        raise
    except ValueError as exc:
        error = _split_error(exc, str(source), str(split))
        if error is None:
            raise
        raise error from None


def _load_rows(source: str, *, data_files: Any, split: str, name: str | None,
               **kwargs: Any) -> Any:
    """:func:`load_rows` without the naming of split errors."""
    import datasets

    if not isinstance(source, str) or not source:
        raise DataError(f"source must be a dataset id or a path, got {source!r}")
    source_path = Path(source).expanduser()
    is_format = source in LOCAL_FORMATS
    if data_files is None and not is_format and not source_path.exists():
        if _looks_like_path(source):
            raise FileNotFoundError(
                f"dataset source {source!r} looks like a local path but does not exist; check "
                f"the path (relative paths are resolved from {os.getcwd()!r})"
            )
        return _load_hub(source, name, split, **kwargs)

    if data_files is None and source_path.is_dir():
        _check_local_contents([str(source_path)])
        return datasets.load_dataset(str(source_path), split=split, **kwargs)

    if data_files is None:
        data_files = str(source_path)
        fmt = _format_of(source)
    elif is_format:
        fmt = source
    else:
        if source_path.is_dir():  # data_files relative to the source folder
            data_files = _under(source_path, data_files)
        formats = {_format_of(path) for path in _file_list(data_files)}
        fmt = formats.pop() if len(formats) == 1 else None
    if fmt is None:
        raise DataError(
            f"cannot tell the format of the local data {source!r} / data_files={data_files!r}; "
            f"use files ending in {sorted(e for v in LOCAL_FORMATS.values() for e in v)} or set "
            f"source to one of {sorted(LOCAL_FORMATS)}"
        )
    _check_local_files(_file_list(data_files))
    _check_local_contents(_file_list(data_files))
    if not isinstance(data_files, Mapping):
        names = set(_split_names(split))
        if len(names) == 1:
            data_files = {names.pop(): data_files}
    return datasets.load_dataset(fmt, data_files=data_files, split=split, **kwargs)


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
    """The value of a field that must be a non-empty string, unchanged.

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
    limit: int | None = None,
) -> PromptDataset:
    """Load a question/answer source and build its :class:`PromptDataset`.

    Each configuration's split is loaded in turn and every row read with ``read_row``; rows are
    indexed across configurations. A rejected row raises a ``DataError`` naming the builder, the
    source, the split, the row (from 1) and the field (``invalid_rows="error"``), or is dropped and
    counted in ``dataset.skipped_rows`` (``"skip"``).

    Args:
        tokenizer: a torchtune model tokenizer.
        builder: the public builder's name (``"gsm8k_dataset"``), the start of every message.
        read_row: ``row -> (question, answer)``, raising :class:`InvalidRow`.
        default_template: the template used when ``template`` is ``None``.
        source: Hub dataset id, local file/folder, or a format name used with ``data_files``.
        split: split expression, slicing allowed; applied per configuration.
        data_files: local file(s), see :func:`~torchtune_grpo.datasets.load_rows`.
        name: the Hub configuration (``None``: the default), or what ``configurations`` expands.
        configurations: turns ``name`` into the configurations to load and concatenate
            (raising ``ValueError`` on a bad ``name``); ``None``: load ``name`` alone.
        template: anything :func:`~torchtune_grpo.datasets.resolve_template` accepts.
        max_prompt_tokens: the longest prompt allowed, or ``None``.
        invalid_rows: ``"error"`` or ``"skip"``.
        load_kwargs: passed to ``datasets.load_dataset``.
        difficulty_file: per-row pass rates; keep the rows strictly inside ``difficulty_band``.
        difficulty_band: ``[low, high]``; default ``(0, 1)``.
        limit: keep only the first ``limit`` problems (rows skipped as invalid do not count;
            the difficulty and prompt-length filters apply after); reading stops there.

    Returns:
        The :class:`~torchtune_grpo.datasets.PromptDataset` of ``{"tokens", "answer",
        "question", "index"}`` items.

    Raises:
        ValueError: on an unknown ``invalid_rows``, an invalid template, a ``name`` that
            ``configurations`` rejects, an invalid row or too-long prompt with
            ``invalid_rows="error"``, a non-positive ``limit``, or no usable row.
        FileNotFoundError: when a local source does not exist.
    """
    check_limit(builder, limit)
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
        if limit is not None and len(samples) >= limit:
            break
        rows = load_rows(
            source, data_files=data_files, split=split, name=config, **(load_kwargs or {})
        )
        count = 0
        for local, row in enumerate(rows):
            if limit is not None and len(samples) >= limit:
                break
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
