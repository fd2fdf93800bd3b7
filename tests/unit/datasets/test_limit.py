"""``limit`` shrinks every dataset the same way (the first N problems), and a split that cannot
be read, a sliced one included, is one line naming ``dataset.limit``."""

from __future__ import annotations

import inspect
import json
import re

import pytest

import torchtune_grpo.datasets as datasets_module
from torchtune_grpo.datasets import (
    addition_dataset,
    arithmetic_dataset,
    deepscaler_dataset,
    gsm8k_dataset,
    load_rows,
    math_dataset,
    multiplication_dataset,
    word_problem_dataset,
)
from torchtune_grpo.errors import DataError
from torchtune_grpo.quickstart.tiny import tiny_tokenizer

ROWS = 7


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A local test split of ``ROWS`` problems in each row format: GSM8K's, MATH's and
    DeepScaleR's."""
    folder = tmp_path_factory.mktemp("data")
    formats = {
        "gsm8k": lambda i: {"question": f"q {i}", "answer": f"work\n#### {i}"},
        "math": lambda i: {"problem": f"q {i}", "solution": f"so $\\boxed{{{i}}}$"},
        "deepscaler": lambda i: {"problem": f"q {i}", "answer": str(i), "solution": None},
    }
    paths = {}
    for kind, row in formats.items():
        paths[kind] = folder / f"{kind}.jsonl"
        paths[kind].write_text("".join(json.dumps(row(i)) + "\n" for i in range(ROWS)))
    return paths


def _builders(files):
    """Every builder, with the arguments that make it load a test split."""
    return {
        "addition": (addition_dataset, {"split": "test"}),
        "arithmetic": (arithmetic_dataset, {"split": "test"}),
        "multiplication": (multiplication_dataset, {"split": "test"}),
        "word_problems": (word_problem_dataset, {"split": "test"}),
        "gsm8k": (gsm8k_dataset, {"source": str(files["gsm8k"]), "split": "test"}),
        "math": (math_dataset, {"source": str(files["math"]), "split": "test"}),
        "deepscaler": (deepscaler_dataset, {"source": str(files["deepscaler"]),
                                            "split": "test"}),
    }


BUILDER_NAMES = ["addition", "arithmetic", "multiplication", "word_problems", "gsm8k", "math",
                 "deepscaler"]


def test_every_builder_takes_limit():
    """A builder added later takes ``limit`` too (and is listed in this file's tests)."""
    builders = {name: getattr(datasets_module, name) for name in datasets_module.__all__
                if name.endswith("_dataset") and callable(getattr(datasets_module, name))}
    assert {f"{n}_dataset" if n != "word_problems" else "word_problem_dataset"
            for n in BUILDER_NAMES} == set(builders)
    for name, fn in builders.items():
        param = inspect.signature(fn).parameters.get("limit")
        assert param is not None and param.default is None, name


@pytest.mark.parametrize("kind", BUILDER_NAMES)
def test_limit_keeps_the_first_problems(tokenizer, files, kind):
    builder, kwargs = _builders(files)[kind]
    whole = builder(tokenizer, **kwargs)
    first = builder(tokenizer, limit=3, **kwargs)
    assert len(first) == 3 < len(whole)
    assert [first[i] for i in range(3)] == [whole[i] for i in range(3)]
    assert len(builder(tokenizer, limit=10**6, **kwargs)) == len(whole)
    for bad in (0, -1, True, "3", 2.5):
        with pytest.raises(DataError, match=r"limit must be a positive integer or null, got "):
            builder(tokenizer, limit=bad, **kwargs)


def test_limit_on_a_file_counts_usable_problems_and_composes_with_slicing(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "bad", "answer": "no marker"}] + [
        {"question": f"q {i}", "answer": f"#### {i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = gsm8k_dataset(tokenizer, source=str(path), invalid_rows="skip", limit=2)
    assert [ds[i]["index"] for i in range(2)] == [1, 2] and ds.skipped_rows == 1
    ds = gsm8k_dataset(tokenizer, source=str(path), split="train[2:]", limit=2)
    assert [ds[i]["question"] for i in range(2)] == ["q 1", "q 2"]


@pytest.mark.parametrize("kind", ["addition", "arithmetic", "multiplication", "word_problems"])
def test_slicing_a_generated_split_names_dataset_limit(tokenizer, files, kind):
    builder, _ = _builders(files)[kind]
    with pytest.raises(DataError) as info:
        builder(tokenizer, split="test[:4]")
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"split 'test\[:4\]' cannot be sliced \(its splits are 'train'.*\); to "
                     r"take the first 4 problems set dataset.split=test dataset.limit=4$",
                     message), message
    with pytest.raises(DataError, match=r"to take the first N problems set dataset.limit=N$"):
        builder(tokenizer, split="test[10:20]")
    with pytest.raises(DataError, match=r"split must be 'train'.* got 'tset'$"):
        builder(tokenizer, split="tset")


def test_a_malformed_split_of_a_file_names_dataset_limit(files, tmp_path):
    with pytest.raises(DataError) as info:
        load_rows(str(files["gsm8k"]), split="test[:x]")
    assert str(info.value) == (
        f"dataset {str(files['gsm8k'])!r}: split 'test[:x]' is not a split expression (NAME, "
        "NAME[:N], NAME[A:B] or NAME[:P%], joined by +); to take the first N problems set "
        "dataset.limit=N")
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "test.jsonl").write_text(files["gsm8k"].read_text())
    with pytest.raises(DataError, match=r"split 'tset': Unknown split \"tset\""):
        load_rows(str(folder), split="tset")
