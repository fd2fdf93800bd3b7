"""The GSM8K, MATH and DeepScaleR builders share one skeleton: the same rules for bad rows,
over-long prompts, skipping, counting and indexing, whatever the row format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torchtune_grpo.datasets import (
    GSM8K_TEMPLATE,
    MATH_TEMPLATE,
    PromptTemplate,
    deepscaler_dataset,
    gsm8k_dataset,
    math_dataset,
    tokenize_prompt,
)
from torchtune_grpo.datasets._loading import InvalidRow, build_prompt_dataset, required_text
from torchtune_grpo.quickstart.tiny import tiny_tokenizer

# builder, its name in messages, (question, answer) -> row, a row without a usable answer and
# the field its error names, the default template.
BUILDERS = {
    "gsm8k": (
        gsm8k_dataset,
        "gsm8k_dataset",
        lambda q, a: {"question": q, "answer": f"work\n#### {a}"},
        ({"question": "q", "answer": "no marker"}, "answer"),
        GSM8K_TEMPLATE,
    ),
    "math": (
        math_dataset,
        "math_dataset",
        lambda q, a: {"problem": q, "solution": f"so $\\boxed{{{a}}}$"},
        ({"problem": "q", "solution": "no box"}, "solution"),
        MATH_TEMPLATE,
    ),
    "deepscaler": (
        deepscaler_dataset,
        "deepscaler_dataset",
        lambda q, a: {"problem": q, "answer": a, "solution": None},
        ({"problem": "q"}, "answer"),
        MATH_TEMPLATE,
    ),
}
LONG_QUESTION = "word " * 200


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _limit(tokenizer, template: PromptTemplate) -> int:
    """A max_prompt_tokens that the short questions fit and LONG_QUESTION does not."""
    return len(tokenize_prompt(tokenizer, template, "question 3")) + 10


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_long_prompt_is_skipped_and_counted_alike(tokenizer, tmp_path, kind):
    build, builder, make_row, _, template = BUILDERS[kind]
    rows = [make_row("question 0", "1"), make_row(LONG_QUESTION, "2"), make_row("q 2", "3")]
    path = _write(tmp_path / f"{kind}.jsonl", rows)
    limit = _limit(tokenizer, template)
    with pytest.raises(ValueError) as raised:
        build(tokenizer, source=path, max_prompt_tokens=limit)
    n_tokens = len(tokenize_prompt(tokenizer, template, LONG_QUESTION))
    assert str(raised.value).startswith(
        f"{builder} ({path}, split 'train'): row 2 (field 'question') has {n_tokens} prompt "
        f"tokens, more than max_prompt_tokens={limit}."
    )
    ds = build(tokenizer, source=path, max_prompt_tokens=limit, invalid_rows="skip")
    assert ds.skipped_rows == 1
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 2]
    assert [ds[i]["answer"] for i in range(len(ds))] == ["1", "3"]
    assert max(ds.prompt_lengths) <= limit


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_malformed_row_error_names_file_row_and_field(tokenizer, tmp_path, kind):
    build, builder, make_row, (bad_row, field), _ = BUILDERS[kind]
    rows = [make_row("q 0", "1"), make_row("q 1", "2"), bad_row, make_row("q 3", "4")]
    path = _write(tmp_path / f"bad_{kind}.jsonl", rows)
    with pytest.raises(ValueError) as raised:
        build(tokenizer, source=path)
    message = str(raised.value)
    assert message.startswith(f"{builder} ({path}, split 'train'): row 3 field '{field}' ")
    assert message.endswith("Fix the data, or set invalid_rows=skip to drop such rows.")
    # The row number (from 1) is the one in the split, also for a slice of the file.
    with pytest.raises(ValueError, match=r"split 'train\[1:\]'\): row 2 field"):
        build(tokenizer, source=path, split="train[1:]")


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_bad_and_long_rows_skipped_together(tokenizer, tmp_path, kind):
    build, _, make_row, (bad_row, _), template = BUILDERS[kind]
    rows = [bad_row, make_row("q 1", "7"), make_row(LONG_QUESTION, "8"), make_row("q 3", "9")]
    path = _write(tmp_path / f"mixed_{kind}.jsonl", rows)
    ds = build(
        tokenizer,
        source=path,
        max_prompt_tokens=_limit(tokenizer, template),
        invalid_rows="skip",
    )
    assert ds.skipped_rows == 2 and len(ds) == 2
    assert [(ds[i]["index"], ds[i]["answer"]) for i in range(2)] == [(1, "7"), (3, "9")]
    assert ds.template == template


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_no_usable_row_and_unknown_policy(tokenizer, tmp_path, kind):
    build, builder, _, (bad_row, _), _ = BUILDERS[kind]
    path = _write(tmp_path / f"allbad_{kind}.jsonl", [bad_row] * 3)
    with pytest.raises(ValueError, match=rf"^{builder} \(.*\): no usable rows \(3 skipped\)"):
        build(tokenizer, source=path, invalid_rows="skip")
    with pytest.raises(ValueError, match=rf"^{builder}: invalid_rows must be one of"):
        build(tokenizer, source=path, invalid_rows="drop")


def _read_pair(row):
    return required_text(row, "q"), required_text(row, "a")


def test_skeleton_concatenates_configurations(tokenizer, tmp_path):
    """Several configurations: indices run across them, a bad row is named by configuration and
    local index, and the dataset's own messages name every configuration."""
    path = _write(tmp_path / "pairs.jsonl", [{"q": "one", "a": "1"}, {"q": "two", "a": "2"}])
    common = dict(
        builder="toy_dataset",
        read_row=_read_pair,
        default_template=PromptTemplate(),
        source=path,
        split="train",
        configurations=lambda name: name.split(","),
    )
    ds = build_prompt_dataset(tokenizer, name="x,y", **common)
    assert [(ds[i]["index"], ds[i]["question"]) for i in range(4)] == [
        (0, "one"),
        (1, "two"),
        (2, "one"),
        (3, "two"),
    ]
    too_long = re.escape(f"toy_dataset ({path}/x+y, split 'train'): row 1 (field 'question')")
    with pytest.raises(ValueError, match=too_long):
        build_prompt_dataset(tokenizer, name="x,y", max_prompt_tokens=1, **common)
    bad = _write(tmp_path / "bad_pairs.jsonl", [{"q": "one", "a": "1"}, {"q": "two"}])
    with pytest.raises(ValueError) as raised:
        build_prompt_dataset(tokenizer, name="x,y", **{**common, "source": bad})
    assert str(raised.value).startswith(
        f"toy_dataset ({bad}, split 'train'): x row 2 field 'a' is missing."
    )


def test_required_text():
    assert required_text({"q": " x "}, "q") == " x "
    for row, what in [
        ({}, "is missing"),
        ({"q": 1.5}, "is a float, not a string"),
        ({"q": " \n"}, "is empty"),
    ]:
        with pytest.raises(InvalidRow) as raised:
            required_text(row, "q")
        assert (raised.value.field, raised.value.what) == ("q", what)


def test_empty_and_malformed_local_files_are_named(tmp_path):
    """A bad data file fails with one line naming the file (and the row), before ``datasets``."""
    from torchtune_grpo.datasets import load_rows

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl' is empty"):
        load_rows(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 2 is not valid JSON"):
        load_rows(str(bad))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"question": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"train\.jsonl' line 2 is a JSON list"):
        load_rows(str(folder), split="train")
