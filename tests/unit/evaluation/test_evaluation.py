"""Evaluation metrics against their definitions, and the evaluate() loop on a tiny model."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_grpo.evaluation.metrics as eval_metrics
from torchtune_grpo.datasets import addition_dataset
from torchtune_grpo.evaluation.evaluate import decode_prompt, evaluate
from torchtune_grpo.evaluation.metrics import majority_correct, pass_at_k
from torchtune_grpo.evaluation.results import RESULTS_FILE, SAMPLES_FILE, partial_samples_path
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.policy.model import token_rules
from torchtune_grpo.rewards.build import build_reward_set


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k))
    assert pass_at_k(n, 0, 1) == 0.0
    assert pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_hand_values_and_errors():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_vote():
    # answer 7 wins 2-1 and is wrong; with k=1 only the first (right) sample votes
    assert majority_correct([5, 7, 7], [True, False, False], 3) is False
    assert majority_correct([5, 7, 7], [True, False, False], 1) is True
    assert majority_correct([None, None, 5], [False, False, True], 3) is True
    assert majority_correct([None, None], [False, False], 2) is False
    assert majority_correct([3, 4], [False, True], 2) is False  # tie: first seen wins


def test_settings_validation():
    with pytest.raises(ValueError, match="temperature"):
        EvalSettings(num_samples=4, temperature=0.0)
    with pytest.raises(ValueError, match="k values"):
        EvalSettings(num_samples=2, temperature=1.0, k=[4])


def test_evaluate_writes_results_and_samples(tokenizer, tiny_model, tmp_path):
    dataset = addition_dataset(tokenizer, split="test", limit=12)
    rewards = build_reward_set([{
        "_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
        "answer_tag": None, "success": True,
    }])
    rules = token_rules(tokenizer, tiny_model, torch.device("cpu"))
    settings = EvalSettings(num_samples=4, temperature=1.0, k=[1, 2, 4],
                            max_generated_tokens=4, forward_batch_size=16)
    result = evaluate(tiny_model, tokenizer, dataset, rewards, settings,
                      device=torch.device("cpu"), logit_bias=rules.logit_bias,
                      allowed_tokens=rules.allowed, stop_tokens=rules.stop_tokens,
                      pad_id=rules.pad_id)
    assert len(result.samples) == 12
    assert [r["index"] for r in result.samples] == list(range(12))
    # metrics recomputed from the per-problem rows
    p1 = sum(sum(r["correct"]) / 4 for r in result.samples) / 12
    assert result.metrics["pass@1"] == pytest.approx(p1)
    assert result.metrics["pass@4"] == pytest.approx(
        sum(any(r["correct"]) for r in result.samples) / 12)
    assert {"maj@2", "maj@4", "reward/correctness"} <= set(result.metrics)
    result.write(tmp_path, dataset="addition", split="test", model_path="tiny")
    summary = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert summary["num_problems"] == 12 and summary["dataset"] == "addition"
    assert summary["sampling"]["num_samples"] == 4 and summary["metrics"] == result.metrics
    lines = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 12
    row = json.loads(lines[0])
    assert {"prompt", "completions", "extracted", "gold", "correct"} <= set(row)
    assert len(row["completions"]) == 4


# ---------------------------------------------------------------------------- prompt decoding
def write_hf_tokenizer(directory: Path) -> tuple[Path, Path]:
    """Write a ``tokenizers``-loadable byte-level BPE with the tiny tokenizer's ids.

    Byte ``b`` is id ``b`` (no merges) and the tiny tokenizer's Llama 3 special tokens follow
    at 256.., so it encodes text exactly as :func:`torchtune_grpo.quickstart.tiny.tiny_tokenizer`
    does and fits the quickstart model's 320-id vocabulary (269 ids). BOS is ``<|begin_of_text|>``;
    EOS is ``<|eot_id|>``, the token the quickstart model ends its answers with.

    Returns:
        ``(tokenizer.json, tokenizer_config.json)``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from torchtune.modules.transforms.tokenizers._gpt2 import bytes_to_unicode

    from torchtune_grpo.quickstart.tiny import tiny_special_tokens

    byte_chars = bytes_to_unicode()  # the byte -> printable character map of byte-level BPE
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted(tiny_special_tokens().items(), key=lambda kv: kv[1])
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name, _ in specials])
    assert [tok.token_to_id(name) for name, _ in specials] == [i for _, i in specials]
    directory.mkdir(parents=True, exist_ok=True)
    json_path, config_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
    tok.save(str(json_path))
    config_path.write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return json_path, config_path


class _NoKeywordTokenizer:
    """``decode(ids)`` only, like torchtune's ``HuggingFaceBaseTokenizer``."""

    def decode(self, token_ids):
        return "".join(chr(i) for i in token_ids)


class _KeywordTokenizer:
    """Qwen 2 style: ``decode(ids, skip_special_tokens=False)``; id 0 is a special token."""

    def decode(self, token_ids, skip_special_tokens: bool = False):
        return "".join("" if i == 0 and skip_special_tokens else chr(i) for i in token_ids)


class _KwargsTokenizer:
    """``**kwargs`` that the tokenizer underneath would reject: not passed the keyword."""

    def decode(self, token_ids, **kwargs):
        if kwargs:
            raise TypeError(f"unexpected {sorted(kwargs)}")
        return "ok"


class _RaisingTokenizer:
    """Takes the keyword but cannot decode id 0 in a batch (like an undefined id)."""

    def decode(self, token_ids, skip_special_tokens: bool = True):
        if len(token_ids) > 1 and 0 in token_ids:
            raise KeyError(0)
        return "".join(chr(i) for i in token_ids if i)


def test_decode_prompt_for_every_tokenizer_kind(tokenizer, tmp_path):
    from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer

    ids = tokenizer.encode("3812+1111=", add_bos=True, add_eos=False)
    # torchtune's Llama 3 tokenizer: asked to keep its special tokens
    assert decode_prompt(tokenizer, ids) == "<|begin_of_text|>3812+1111="
    assert decode_prompt(tokenizer, torch.tensor(ids)) == "<|begin_of_text|>3812+1111="
    # torchtune's HuggingFaceBaseTokenizer: decode(ids) without keywords (drops specials)
    json_path, config_path = write_hf_tokenizer(tmp_path / "hf")
    hf = HuggingFaceBaseTokenizer(str(json_path), tokenizer_config_json_path=str(config_path))
    assert hf.encode("3812+1111=", add_eos=False) == ids
    assert decode_prompt(hf, ids) == "3812+1111="
    assert decode_prompt(_NoKeywordTokenizer(), [104, 105]) == "hi"
    assert decode_prompt(_KeywordTokenizer(), [0, 104]) == "\x00h"  # specials kept
    assert decode_prompt(_KwargsTokenizer(), [1]) == "ok"
    # never raises: undecodable ids are skipped, a tokenizer without decode gives ""
    assert decode_prompt(_RaisingTokenizer(), [104, 0, 105]) == "hi"
    assert decode_prompt(_NoKeywordTokenizer(), [104, -1]) == "h"  # chr(-1) raises
    assert decode_prompt(tokenizer, [*ids[:3], 300, ids[3]]) == "<|begin_of_text|>381"
    assert decode_prompt(object(), [1, 2]) == ""


# ---------------------------------------------------------------------------- partial samples
def _setup(tokenizer, model, limit=10):
    dataset = addition_dataset(tokenizer, split="test", limit=limit)
    rewards = build_reward_set([{
        "_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
        "answer_tag": None, "success": True,
    }])
    rules = token_rules(tokenizer, model, torch.device("cpu"))
    kwargs = dict(device=torch.device("cpu"), logit_bias=rules.logit_bias,
                  allowed_tokens=rules.allowed, stop_tokens=rules.stop_tokens,
                  pad_id=rules.pad_id)
    # 3 prompts per micro-batch: the rows of several micro-batches reach the partial file
    settings = EvalSettings(num_samples=2, temperature=1.0, k=[1, 2],
                            max_generated_tokens=3, forward_batch_size=6)
    return dataset, rewards, settings, kwargs


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_partial_samples_then_atomic_final_files(tokenizer, tiny_model, tmp_path):
    dataset, rewards, settings, kwargs = _setup(tokenizer, tiny_model)
    tmp_path = tmp_path / "ckpt"
    tmp_path.mkdir()
    (tmp_path / RESULTS_FILE).write_text("{}")  # an earlier evaluation of the folder
    result = evaluate(tiny_model, tokenizer, dataset, rewards, settings,
                      partial_dir=tmp_path, **kwargs)
    partial = partial_samples_path(tmp_path, 0)
    assert result.partial_files == [partial] and partial.name == "eval_samples.rank0.partial.jsonl"
    assert _read_jsonl(partial) == result.samples  # every row, as scored, before any writing
    paths = result.write(tmp_path, dataset="addition")
    assert paths == [tmp_path / RESULTS_FILE, tmp_path / SAMPLES_FILE]
    assert json.loads(paths[0].read_text())["num_problems"] == 10
    assert _read_jsonl(paths[1]) == result.samples
    assert sorted(p.name for p in tmp_path.iterdir()) == [RESULTS_FILE, SAMPLES_FILE]


def test_failing_metric_keeps_every_scored_problem(tokenizer, tiny_model, tmp_path, monkeypatch):
    dataset, rewards, settings, kwargs = _setup(tokenizer, tiny_model)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a broken metric")

    monkeypatch.setattr(eval_metrics, "majority_correct", broken)  # where compute_metrics looks
    partial = partial_samples_path(tmp_path, 0)
    with pytest.raises(RuntimeError, match="a broken metric") as info:
        evaluate(tiny_model, tokenizer, dataset, rewards, settings, partial_dir=tmp_path,
                 **kwargs)
    assert str(partial) in str(info.value)
    rows = _read_jsonl(partial)
    assert [r["position"] for r in rows] == list(range(10))
    assert all(r["prompt"].endswith(r["question"]) and len(r["completions"]) == 2 for r in rows)
    assert not (tmp_path / RESULTS_FILE).exists() and not (tmp_path / SAMPLES_FILE).exists()


def test_unserialisable_rows_fail_the_write_not_the_samples(tokenizer, tiny_model, tmp_path):
    """A success reward whose extracted answers JSON cannot hold (a ``Fraction``): metrics
    work, ``grpo_eval``'s write fails naming the partial file, which holds every problem."""
    import grpo_eval

    dataset, rewards, settings, kwargs = _setup(tokenizer, tiny_model)
    tmp_path = tmp_path / "ckpt"
    success = next(e.fn for e in rewards.entries if e.name == rewards.success_name)
    success.extract_answer = lambda text: Fraction(len(text), 3)
    result = evaluate(tiny_model, tokenizer, dataset, rewards, settings, partial_dir=tmp_path,
                      **kwargs)
    assert "maj@2" in result.metrics
    cfg = OmegaConf.create({"checkpoint_dir": str(tmp_path), "dataset": {
        "_component_": "torchtune_grpo.datasets.addition_dataset", "split": "test"}})
    partial = partial_samples_path(tmp_path, 0)
    with pytest.raises(ValueError, match="Fraction is not JSON serializable") as info:
        grpo_eval.write_results(result, cfg)
    assert str(partial) in str(info.value) and "index=" in str(info.value)
    rows = _read_jsonl(partial)
    assert [r["position"] for r in rows] == list(range(10))
    assert rows[0]["extracted"] == [str(x) for x in result.samples[0]["extracted"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [partial.name]  # nothing half-written
