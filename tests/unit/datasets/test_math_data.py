"""Tests of the MATH / DeepScaleR datasets, the boxed template and the math configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchtune import config as tt_config

from tests.conftest import check_instantiates_offline, config_json_alone, shared_data
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.config.schema import EVAL_KEYS
from torchtune_grpo.config.validation import validate_config
from torchtune_grpo.datasets import (
    MATH_TEMPLATE,
    PromptTemplate,
    deepscaler_dataset,
    format_boxed_completion,
    math_dataset,
    math_gold_answer,
    tokenize_prompt,
)
from torchtune_grpo.quickstart.tiny import tiny_tokenizer
from torchtune_grpo.rewards.answers import extract_boxed

MATH_ROWS = [
    {"problem": "What is $1+1$?", "solution": "Clearly $1+1=\\boxed{2}$."},
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Solve.", "solution": "No box \\boxed{3}, then $\\boxed{\\{1,2\\}}$"},
    {"problem": "Name?", "solution": "ignored \\boxed{x}", "answer": "\\text{Evelyn}"},
]
DEEPSCALER_ROWS = [
    {"problem": "AIME 1", "answer": "60", "solution": "... \\boxed{60}."},
    {"problem": "AIME 2", "answer": "", "solution": "so \\boxed{15}"},
    {"problem": "AIME 3", "answer": 20, "solution": None},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write(path: Path, rows: list[dict], as_list: bool = True) -> Path:
    if as_list:
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------- template


def test_template_asks_for_a_box(tokenizer):
    text = tokenizer.decode(
        tokenize_prompt(tokenizer, MATH_TEMPLATE, "What is 2+2?"), skip_special_tokens=False
    )
    assert "What is 2+2?" in text
    assert "put your final answer within \\boxed{}." in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_format_boxed_completion_roundtrip():
    completion = format_boxed_completion("  Add them.  ", "\\frac{1}{2}")
    assert completion == "Add them.\n\nThe final answer is $\\boxed{\\frac{1}{2}}$."
    assert extract_boxed(completion) == "\\frac{1}{2}"
    assert format_boxed_completion("", "5") == "The final answer is $\\boxed{5}$."


def test_gold_answer_rules():
    assert [math_gold_answer(r) for r in MATH_ROWS] == [
        "2",
        "\\frac{1}{2}",
        "\\{1,2\\}",
        "\\text{Evelyn}",
    ]
    assert [math_gold_answer(r) for r in DEEPSCALER_ROWS] == ["60", "15", "20"]
    assert math_gold_answer({"problem": "p", "solution": "no box"}) is None


# ------------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("as_list", [True, False])
def test_math_dataset_local_json(tokenizer, tmp_path, as_list):
    path = _write(tmp_path / "math.json", MATH_ROWS, as_list=as_list)
    ds = math_dataset(tokenizer, source=str(path))
    assert len(ds) == 4 and ds.skipped_rows == 0
    assert [ds[i]["answer"] for i in range(4)] == [
        "2",
        "\\frac{1}{2}",
        "\\{1,2\\}",
        "\\text{Evelyn}",
    ]
    assert ds[1]["question"] == "Simplify $\\frac{2}{4}$."
    assert ds[3]["index"] == 3
    assert ds[0]["tokens"] == tokenize_prompt(tokenizer, MATH_TEMPLATE, "What is $1+1$?")
    sliced = math_dataset(tokenizer, source=str(path), split="train[1:3]")
    assert [sliced[i]["answer"] for i in range(2)] == ["\\frac{1}{2}", "\\{1,2\\}"]


def test_math_dataset_subject_list(tokenizer, tmp_path):
    """A list of ``name``s loads each configuration and concatenates them."""
    folder = tmp_path / "subjects"
    folder.mkdir()
    path = _write(folder / "train.jsonl", MATH_ROWS[:2], as_list=False)
    ds = math_dataset(tokenizer, source=str(path), name=["algebra", "geometry"])
    assert len(ds) == 4 and [ds[i]["index"] for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="name must be"):
        math_dataset(tokenizer, source=str(path), name=[])


def test_deepscaler_dataset(tokenizer, tmp_path):
    ds = deepscaler_dataset(tokenizer, source=str(_write(tmp_path / "d.json", DEEPSCALER_ROWS)))
    assert [ds[i]["answer"] for i in range(3)] == ["60", "15", "20"]
    custom = deepscaler_dataset(
        tokenizer,
        source=str(tmp_path / "d.json"),
        template={"user": "Q: {question}", "chat": False},
    )
    assert custom.template == PromptTemplate(user="Q: {question}", chat=False)


@pytest.mark.parametrize(
    "bad_row, field, what",
    [
        ({"solution": "\\boxed{1}"}, "problem", "is missing"),
        ({"problem": "  ", "answer": "1"}, "problem", "is empty"),
        ({"problem": 3, "answer": "1"}, "problem", "is a int"),
        ({"problem": "p"}, "answer", "is missing"),
        ({"problem": "p", "answer": ""}, "answer", "is empty"),
        ({"problem": "p", "answer": 1.5}, "answer", "is a float"),
        ({"problem": "p", "solution": "no box"}, "solution", "has no \\\\boxed"),
        ({"problem": "p", "solution": ["x"]}, "solution", "is a list"),
    ],
)
def test_invalid_rows_name_row_and_field(tokenizer, tmp_path, bad_row, field, what):
    rows = [MATH_ROWS[0], bad_row, MATH_ROWS[1]]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for build in (math_dataset, deepscaler_dataset):
        with pytest.raises(ValueError, match=rf"row 2 field '{field}' {what}"):
            build(tokenizer, source=str(path))
        ds = build(tokenizer, source=str(path), invalid_rows="skip")
        assert len(ds) == 2 and ds.skipped_rows == 1
        assert [ds[i]["index"] for i in range(2)] == [0, 2]


def test_errors_for_policy_empty_missing_and_long(tokenizer, tmp_path):
    path = _write(tmp_path / "m.json", MATH_ROWS)
    with pytest.raises(ValueError, match="invalid_rows must be one of"):
        math_dataset(tokenizer, source=str(path), invalid_rows="drop")
    with pytest.raises(ValueError, match="invalid_rows must be one of"):
        deepscaler_dataset(tokenizer, source=str(path), invalid_rows="drop")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        math_dataset(tokenizer, source=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="no usable rows"):
        math_dataset(
            tokenizer,
            source=str(_write(tmp_path / "bad.json", [{"problem": "p"}])),
            invalid_rows="skip",
        )
    with pytest.raises(ValueError, match="row 1 .* max_prompt_tokens=5"):
        math_dataset(tokenizer, source=str(path), max_prompt_tokens=5)
    longest = max(math_dataset(tokenizer, source=str(path)).prompt_lengths)
    short = math_dataset(
        tokenizer, source=str(path), max_prompt_tokens=longest - 1, invalid_rows="skip"
    )
    assert short.skipped_rows >= 1
    assert len(short) + short.skipped_rows == 4


# ------------------------------------------------------------------------------- real data


def test_real_math500_and_aime(tokenizer):
    math500 = math_dataset(
        tokenizer, source=str(shared_data("math/math500_test.json")), split="test"
    )
    assert len(math500) == 500 and math500[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    aime = deepscaler_dataset(tokenizer, source=str(shared_data("math/aime_train.json")))
    assert len(aime) == 975 and aime[0]["answer"] == "60"
    with pytest.raises(ValueError, match=r"row \d+ field 'answer' is missing"):
        math_dataset(tokenizer, source=str(shared_data("math/math_train.json")))
    train = math_dataset(
        tokenizer, source=str(shared_data("math/math_train.json")), invalid_rows="skip"
    )
    assert len(train) + train.skipped_rows == 7474 and train.skipped_rows < 10


# ------------------------------------------------------------------------------- configs

TRAIN_CONFIGS = ["grpo/qwen2_5_3B_math_full", "grpo/qwen2_5_3B_deepscaler_full"]


@pytest.mark.parametrize("name", TRAIN_CONFIGS)
def test_math_train_configs_validate_and_instantiate(name, tmp_path):
    pytest.importorskip("math_verify")
    cfg = load_config(name)
    validate_config(cfg, world_size=8)
    folder = config_json_alone(cfg, tmp_path)  # the model comes from its config.json
    cfg = load_config(name, [f"model_dir={folder}"])
    check_instantiates_offline(cfg, min_params=2.5e9)
    assert cfg.eval_dataset._component_ == "torchtune_grpo.datasets.math_dataset"


def test_eval_math500_config(tmp_path):
    pytest.importorskip("math_verify")
    from torchtune_grpo.rewards.build import build_reward_set

    cfg = load_config("grpo/eval_math500", ["checkpoint_dir=/x"])
    validate_config(cfg, schema=EVAL_KEYS)
    assert cfg.dataset.source == "HuggingFaceH4/MATH-500" and cfg.dataset.split == "test"
    # the model comes from the step folder's config.json (a Qwen2.5-3B one here)
    cfg = load_config("grpo/eval_math500", [f"checkpoint_dir={tmp_path / 'Qwen2.5-3B-Instruct'}"])
    config_json_alone(cfg, tmp_path)
    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 2.5e9
    rewards = build_reward_set(cfg.rewards)
    assert rewards.names == ["correctness"]


def test_math_configs_build_datasets_from_local_files(tokenizer):
    """The shipped dataset entries work on the local copies (the override the docs show)."""
    cfg = load_config("grpo/eval_math500", ["checkpoint_dir=/x"])
    source = str(shared_data("math/math500_test.json"))
    ds = tt_config.instantiate(cfg.dataset, tokenizer=tokenizer, source=source)
    assert len(ds) == 500
    cfg = load_config("grpo/qwen2_5_3B_deepscaler_full")
    ds = tt_config.instantiate(
        cfg.dataset,
        tokenizer=tokenizer,
        source=str(shared_data("math/aime_train.json")),
        max_prompt_tokens=None,
    )
    assert len(ds) == 975
