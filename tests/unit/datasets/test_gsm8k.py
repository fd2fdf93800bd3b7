"""Tests of prompt templates, local loading, the GSM8K dataset and prompt collation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.datasets import (
    GSM8K_TEMPLATE,
    PromptDataset,
    PromptTemplate,
    collate_prompts,
    extract_gsm8k_answer,
    format_reference_completion,
    gsm8k_dataset,
    load_rows,
    resolve_template,
    split_gsm8k_solution,
    tokenize_prompt,
)
from torchtune_grpo.quickstart.tiny import tiny_tokenizer
from torchtune_grpo.rewards.components import FormatReward, NumericCorrectness

REAL_GSM8K_TEST = Path(__file__).resolve().parents[3].parent / "shared/data/gsm8k/test.jsonl"

ROWS = [
    {"question": "Janet has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"},
    {"question": "A farm sells 1000 eggs.", "answer": "It sells 1,000.\n#### 1,000"},
    {"question": "What is 2 - 9?", "answer": "2 - 9 = -7\n#### -7 "},
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n####2.5"},
    {"question": "Q5", "answer": "r\n#### 6"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def small_file(tmp_path):
    return _write_jsonl(tmp_path / "gsm8k_small.jsonl", ROWS)


# ------------------------------------------------------------------------------- templates


def test_tokenize_prompt_chat_ends_after_assistant_header(tokenizer):
    template = PromptTemplate(user="Q: {question}")
    tokens = tokenize_prompt(tokenizer, template, "2+2?")
    header = [tokenizer.start_header_id, *tokenizer.encode("assistant", False, False)]
    header += [tokenizer.end_header_id, *tokenizer.encode("\n\n", False, False)]
    assert tokens[:1] == [tokenizer.bos_id]
    assert tokens[-len(header) :] == header
    assert tokenizer.eos_id not in tokens
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.endswith("Q: 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tokenize_prompt_system_and_prefix(tokenizer):
    tokens = tokenize_prompt(tokenizer, GSM8K_TEMPLATE, "How many?")
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert "How many?" in text and "<answer>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n<think>")


def test_tokenize_prompt_plain(tokenizer):
    plain = PromptTemplate(user="Q: {question}\nA:", assistant_prefix=" <think>", chat=False)
    tokens = tokenize_prompt(tokenizer, plain, "1+1")
    assert tokens == tokenizer.encode("Q: 1+1\nA: <think>", add_bos=True, add_eos=False)
    with_system = PromptTemplate(system="Be brief.", chat=False)
    tokens = tokenize_prompt(tokenizer, with_system, "1+1")
    assert tokenizer.decode(tokens) == "Be brief.\n\n1+1"


def test_tokenize_prompt_qwen_style_tokenizer(tmp_path):
    """Qwen 2.5 tokenizers take ``add_eos`` instead of ``add_end_tokens``; the turn stays open."""
    from torchtune.models.qwen2._tokenizer import bytes_to_unicode
    from torchtune.models.qwen2_5._tokenizer import Qwen2_5Tokenizer

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tok = Qwen2_5Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    text = tok.decode(tokenize_prompt(tok, GSM8K_TEMPLATE, "2+2?"), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    text = tok.decode(tokenize_prompt(tok, PromptTemplate(), "2+2?"), skip_special_tokens=False)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_resolve_template():
    assert resolve_template(None) is GSM8K_TEMPLATE
    assert resolve_template(None, default=PromptTemplate()) == PromptTemplate()
    cfg = OmegaConf.create({"user": "Solve: {question}", "assistant_prefix": "<think>"})
    assert resolve_template(cfg) == PromptTemplate(
        user="Solve: {question}", assistant_prefix="<think>"
    )
    assert resolve_template({"system": "s"}).system == "s"
    assert resolve_template("torchtune_grpo.datasets.GSM8K_TEMPLATE") is GSM8K_TEMPLATE
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['usr'\]"):
        resolve_template({"usr": "{question}"})
    with pytest.raises(ValueError, match=r"\{question\}"):
        resolve_template({"user": "no placeholder"})
    with pytest.raises(ValueError, match="literal braces"):
        resolve_template({"user": "{question} as {json}"})
    with pytest.raises(ValueError, match="does not import"):
        resolve_template("torchtune_grpo.datasets.NO_SUCH_TEMPLATE")
    with pytest.raises(ValueError, match="not a PromptTemplate"):
        resolve_template("torchtune_grpo.datasets.gsm8k_dataset")


def test_format_reference_completion_scores_full():
    completion = format_reference_completion(GSM8K_TEMPLATE, "3 + 2 = 5", "5")
    assert not completion.startswith("<think>")  # pre-filled by the prompt
    assert completion.endswith("<answer>5</answer>")
    assert FormatReward(prefix=GSM8K_TEMPLATE.assistant_prefix)([completion], ["5"]) == [1.0]
    assert NumericCorrectness()([completion], ["5"]) == [1.0]
    own_think = PromptTemplate(think_tag="think", answer_tag="answer")
    completion = format_reference_completion(own_think, "reasoning", "5")
    assert completion.startswith("<think>")
    assert FormatReward()([completion], ["5"]) == [1.0]
    plain = format_reference_completion(PromptTemplate(), "2 + 3 = 5", "5")
    assert plain.endswith("The final answer is 5.")
    assert NumericCorrectness(answer_tag=None)([plain], ["5"]) == [1.0]


# ---------------------------------------------------------------------------------- loading


def test_load_rows_local_and_slicing(small_file, tmp_path):
    assert len(load_rows(str(small_file))) == 5
    assert [r["question"] for r in load_rows(str(small_file), split="train[:2]")] == [
        ROWS[0]["question"],
        ROWS[1]["question"],
    ]
    assert len(load_rows(str(small_file), split="train[2:]")) == 3
    assert len(load_rows(str(small_file), split="test[-1:]")) == 1  # any split name, one file
    assert len(load_rows("json", data_files=str(small_file), split="train[:3]")) == 3
    # A folder with split-named files.
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", ROWS)
    _write_jsonl(folder / "test.jsonl", ROWS[:2])
    assert len(load_rows(str(folder), split="test")) == 2
    assert len(load_rows(str(folder), data_files="train.jsonl", split="train[1:]")) == 4


def test_load_rows_missing_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows("json", data_files=str(missing))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        gsm8k_dataset(None, source=str(missing))
    odd = tmp_path / "rows.txt"
    odd.write_text("x\n")
    with pytest.raises(ValueError, match="format"):
        load_rows(str(odd))


# ------------------------------------------------------------------------------------ GSM8K


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("a\n#### 18") == "18"
    assert extract_gsm8k_answer("a\n#### 1,000 ") == "1000"
    assert extract_gsm8k_answer("#### -7") == "-7"
    assert extract_gsm8k_answer("no marker") is None
    assert extract_gsm8k_answer("a ####   ") is None
    assert split_gsm8k_solution("r1\nr2\n#### 4") == ("r1\nr2", "4")


def test_gsm8k_dataset_items(tokenizer, small_file):
    ds = gsm8k_dataset(tokenizer, source=str(small_file))
    assert len(ds) == 5 and ds.skipped_rows == 0
    assert [ds[i]["answer"] for i in range(5)] == ["5", "1000", "-7", "2.5", "6"]
    item = ds[1]
    assert set(item) == {"tokens", "answer", "question", "index"}
    assert item["question"] == ROWS[1]["question"] and item["index"] == 1
    assert item["tokens"] == tokenize_prompt(tokenizer, GSM8K_TEMPLATE, ROWS[1]["question"])
    # Split slicing keeps the indices of the slice.
    ds = gsm8k_dataset(tokenizer, source=str(small_file), split="train[3:]")
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 1]
    assert [ds[i]["answer"] for i in range(len(ds))] == ["2.5", "6"]
    # A custom template from a mapping.
    ds = gsm8k_dataset(tokenizer, source=str(small_file), template={"user": "Q: {question}"})
    assert ds[0]["tokens"] == tokenize_prompt(
        tokenizer, PromptTemplate(user="Q: {question}"), ROWS[0]["question"]
    )


@pytest.mark.parametrize(
    ("bad_row", "field", "what"),
    [
        ({"question": "q", "answer": "no marker"}, "answer", "####"),
        ({"question": "", "answer": "#### 1"}, "question", "empty"),
        ({"question": "q"}, "answer", "missing"),
        ({"question": "q", "answer": "#### "}, "answer", "####"),
    ],
)
def test_gsm8k_invalid_rows(tokenizer, tmp_path, bad_row, field, what):
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], bad_row, ROWS[2]])
    with pytest.raises(ValueError, match=rf"row 3 field '{field}' .*{what}"):
        gsm8k_dataset(tokenizer, source=str(path))
    ds = gsm8k_dataset(tokenizer, source=str(path), invalid_rows="skip")
    assert len(ds) == 3 and ds.skipped_rows == 1
    assert [ds[i]["index"] for i in range(3)] == [0, 1, 3]


def test_gsm8k_non_string_fields(tokenizer, tmp_path):
    # A column of numbers (a table column has one type, so every row has a number here).
    path = _write_jsonl(tmp_path / "ints.jsonl", [{"question": 7, "answer": "#### 1"}] * 2)
    with pytest.raises(ValueError, match=r"row 1 field 'question' is a int, not a string"):
        gsm8k_dataset(tokenizer, source=str(path))


def test_gsm8k_max_prompt_tokens(tokenizer, tmp_path):
    long_row = {"question": "word " * 200, "answer": "#### 1"}
    path = _write_jsonl(tmp_path / "long.jsonl", [ROWS[0], long_row, ROWS[1]])
    limit = len(tokenize_prompt(tokenizer, GSM8K_TEMPLATE, ROWS[0]["question"])) + 10
    with pytest.raises(ValueError, match=r"row 2 \(field 'question'\) has \d+ prompt tokens"):
        gsm8k_dataset(tokenizer, source=str(path), max_prompt_tokens=limit)
    ds = gsm8k_dataset(tokenizer, source=str(path), max_prompt_tokens=limit, invalid_rows="skip")
    assert len(ds) == 2 and ds.skipped_rows == 1
    assert max(ds.prompt_lengths) <= limit


def test_gsm8k_empty_and_bad_policy(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "allbad.jsonl", [{"question": "q", "answer": "none"}] * 3)
    with pytest.raises(ValueError, match=r"no usable rows \(3 skipped\)"):
        gsm8k_dataset(tokenizer, source=str(path), invalid_rows="skip")
    with pytest.raises(ValueError, match="invalid_rows"):
        gsm8k_dataset(tokenizer, source=str(path), invalid_rows="drop")


def test_prompt_dataset_truncation_by_tokenizer(tmp_path):
    short_tok = tiny_tokenizer(tmp_path / "tok", max_seq_len=40)
    samples = [("short", "1", 0), ("a much longer question " * 3, "2", 1)]
    with pytest.raises(ValueError, match=r"row 2 .*max_seq_len=40"):
        PromptDataset(samples, short_tok, PromptTemplate())
    ds = PromptDataset(samples, short_tok, PromptTemplate(), invalid_rows="skip")
    assert len(ds) == 1 and ds.skipped_rows == 1


# ---------------------------------------------------------------------------------- collate


def test_collate_prompts_left_pads(tokenizer, small_file):
    ds = gsm8k_dataset(tokenizer, source=str(small_file), template={"user": "{question}"})
    items = [ds[0], ds[4], ds[2]]
    batch = collate_prompts(items, pad_id=-1)
    lengths = [len(item["tokens"]) for item in items]
    width = max(lengths)
    assert batch["tokens"].dtype == torch.long and batch["tokens"].shape == (3, width)
    assert batch["prompt_lengths"].tolist() == lengths
    assert batch["indices"].tolist() == [0, 4, 2]
    assert batch["answers"] == ["5", "6", "-7"]
    assert batch["questions"] == [ROWS[0]["question"], ROWS[4]["question"], ROWS[2]["question"]]
    for row, item in enumerate(items):
        pad = width - lengths[row]
        assert batch["tokens"][row, :pad].tolist() == [-1] * pad
        assert batch["tokens"][row, pad:].tolist() == item["tokens"]
    with pytest.raises(ValueError, match="empty"):
        collate_prompts([], pad_id=0)


def test_collate_with_dataloader(tokenizer, small_file):
    ds = gsm8k_dataset(tokenizer, source=str(small_file))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=2, collate_fn=lambda b: collate_prompts(b, tokenizer.pad_id)
    )
    batches = list(loader)
    assert [b["tokens"].shape[0] for b in batches] == [2, 2, 1]


# -------------------------------------------------------------------------------- real data


def test_real_gsm8k_test_split_reference_solutions_score(tokenizer):
    if not REAL_GSM8K_TEST.exists():
        pytest.skip(f"{REAL_GSM8K_TEST} not present")
    ds = gsm8k_dataset(tokenizer, source=str(REAL_GSM8K_TEST), split="test")
    assert len(ds) == 1319 and ds.skipped_rows == 0
    solutions = [json.loads(line)["answer"] for line in REAL_GSM8K_TEST.read_text().splitlines()]
    correctness = NumericCorrectness()
    fmt = FormatReward(prefix=GSM8K_TEMPLATE.assistant_prefix)
    gold_completions, wrong_completions, answers = [], [], []
    for i in range(len(ds)):
        item = ds[i]
        reasoning, final = split_gsm8k_solution(solutions[item["index"]])
        assert final == item["answer"]
        wrong = str(int(final) + 1) if final.lstrip("-").isdigit() else f"{float(final) + 1}"
        gold_completions.append(format_reference_completion(GSM8K_TEMPLATE, reasoning, final))
        wrong_completions.append(format_reference_completion(GSM8K_TEMPLATE, reasoning, wrong))
        answers.append(item["answer"])
    scores = correctness(gold_completions, answers)
    failing = [i for i, s in enumerate(scores) if s != 1.0]
    assert not failing, f"gold completions scored 0 at rows {failing[:10]}"
    assert correctness(wrong_completions, answers) == [0.0] * len(ds)
    assert fmt(gold_completions, answers) == [1.0] * len(ds)


def test_real_gsm8k_phrase_template_reference_solutions_score():
    """The plain-text template of ``grpo/smollm2_gsm8k_cpu``: the gold solution written in its
    layout scores 1 for correctness and format on every test row, gold + 1 scores 0."""
    from torchtune_grpo.datasets import GSM8K_PHRASE_TEMPLATE as T
    from torchtune_grpo.rewards.components import AnswerPhraseFormat

    if not REAL_GSM8K_TEST.exists():
        pytest.skip(f"{REAL_GSM8K_TEST} not present")
    rows = [json.loads(line) for line in REAL_GSM8K_TEST.read_text().splitlines()]
    correctness = NumericCorrectness(answer_tag=None, answer_phrase=T.answer_phrase)
    fmt = AnswerPhraseFormat(T.answer_phrase)
    gold, wrong, answers = [], [], []
    for row in rows:
        reasoning, final = split_gsm8k_solution(row["answer"])
        bad = str(int(final) + 1) if final.lstrip("-").isdigit() else f"{float(final) + 1}"
        gold.append(format_reference_completion(T, reasoning, final))
        wrong.append(format_reference_completion(T, reasoning, bad))
        answers.append(final)
    assert correctness(gold, answers) == [1.0] * len(rows)
    assert correctness(wrong, answers) == [0.0] * len(rows)
    assert fmt(gold, answers) == [1.0] * len(rows)
