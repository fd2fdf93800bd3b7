"""`tune run grpo_eval` on a quickstart checkpoint, one and two processes, and with
torchtune's ``HuggingFaceBaseTokenizer``."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.recipes._helpers import quickstart_overrides, run_tune
from tests.unit.evaluation.test_evaluation import write_hf_tokenizer

pytestmark = pytest.mark.slow

HF_TOKENIZER = "torchtune.modules.transforms.tokenizers.HuggingFaceBaseTokenizer"


def test_eval_recipe_on_quickstart_checkpoint(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed",
              *quickstart_overrides(base_model, out, "num_steps=1")], cwd=tmp_path, threads=2)
    ckpt = out / "step_1"
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_quickstart", f"checkpoint_dir={ckpt}",
              "progress_bar=false", "dataset.limit=40"], cwd=tmp_path, threads=2)
    one = json.loads((ckpt / "eval_results.json").read_text())
    samples = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    assert one["num_problems"] == len(samples) == 40
    assert one["model_path"] == str(ckpt) and one["split"] == "test"
    assert one["metrics"]["pass@1"] == pytest.approx(
        sum(s["correct"][0] for s in samples) / 40)

    # two ranks split the problems and gather the same greedy results
    run_tune(["run", "--nproc_per_node", "2", "grpo_eval", "--config", "grpo/eval_quickstart",
              f"checkpoint_dir={ckpt}", "progress_bar=false", "dataset.limit=39"], cwd=tmp_path)
    two = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["index"] for s in two] == list(range(39))
    assert [s["completions"] for s in two] == [s["completions"] for s in samples[:39]]
    assert not list(ckpt.glob("eval_samples.rank*.partial.jsonl"))  # removed after the write


def test_periodic_eval_lands_in_step_checkpoints(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed", *quickstart_overrides(
        base_model, out, "num_steps=3", "eval_every_n_steps=2", "eval_at_start=true",
        "eval_dataset._component_=torchtune_grpo.datasets.addition_dataset",
        "eval_dataset.split=test", "eval_dataset.limit=16")], cwd=tmp_path, threads=2)
    for step in (2, 3):  # every 2 steps and at the end
        results = json.loads((out / f"step_{step}" / "eval_results.json").read_text())
        assert results["num_problems"] == 16 and results["step"] == step
    from torchtune_grpo.training.metrics import read_disk_log

    rows = {int(r["step"]): r for r in read_disk_log(out / "logs")}
    assert {"eval/pass@1"} <= set(rows[0]) and "eval/pass@1" in rows[2]


def test_eval_recipe_with_huggingface_base_tokenizer(base_model, tmp_path):
    """torchtune's ``HuggingFaceBaseTokenizer`` (whose ``decode`` takes no keyword) used to
    crash ``grpo_eval`` after the whole split was generated; now every problem is written,
    with its decoded prompt, and the completions are those of the tiktoken tokenizer."""
    import torch
    from omegaconf import OmegaConf

    from torchtune_grpo.config.loading import resolve_config_path
    from torchtune_grpo.datasets import addition_dataset
    from torchtune_grpo.evaluation.evaluate import evaluate
    from torchtune_grpo.evaluation.settings import EvalSettings
    from torchtune_grpo.policy.model import token_rules
    from torchtune_grpo.quickstart.prepare import load_quickstart_model
    from torchtune_grpo.rewards.build import build_reward_set

    ckpt = tmp_path / "ckpt"  # an HF folder: weights, config.json, tokenizer(_config).json
    shutil.copytree(base_model, ckpt)
    for name in ("tokenizer.model", "tokenizer.json"):
        (ckpt / name).unlink()
    write_hf_tokenizer(ckpt)
    cfg = OmegaConf.load(resolve_config_path("grpo/eval_quickstart"))
    cfg.tokenizer = {
        "_component_": HF_TOKENIZER,
        "tokenizer_json_path": "${checkpoint_dir}/tokenizer.json",
        "tokenizer_config_json_path": "${checkpoint_dir}/tokenizer_config.json",
    }
    config_path = tmp_path / "eval_hf.yaml"
    OmegaConf.save(cfg, config_path)
    limit = 24
    run_tune(["run", "grpo_eval", "--config", str(config_path), f"checkpoint_dir={ckpt}",
              "progress_bar=false", f"dataset.limit={limit}"], cwd=tmp_path, threads=2)

    results = json.loads((ckpt / "eval_results.json").read_text())
    rows = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    assert results["num_problems"] == len(rows) == limit
    assert [r["index"] for r in rows] == list(range(limit))
    assert results["metrics"]["pass@1"] == pytest.approx(
        sum(r["correct"][0] for r in rows) / limit)
    # HuggingFaceBaseTokenizer.decode() drops special tokens (BOS): the prompt is the question
    assert [r["prompt"] for r in rows] == [r["question"] for r in rows]
    assert not list(ckpt.glob("*.partial.jsonl")) and not list(ckpt.glob(".*.tmp"))

    # same ids, same model: the completions are those of the tiktoken tokenizer, in-process
    model, llama3_tokenizer = load_quickstart_model(base_model)
    rules = token_rules(llama3_tokenizer, model, torch.device("cpu"))
    reference = evaluate(
        model, llama3_tokenizer, addition_dataset(llama3_tokenizer, split="test", limit=limit),
        build_reward_set(cfg.rewards), EvalSettings(max_generated_tokens=5),
        device=torch.device("cpu"), logit_bias=rules.logit_bias, allowed_tokens=rules.allowed,
        stop_tokens=rules.stop_tokens, pad_id=rules.pad_id,
    )
    assert [r["completions"] for r in rows] == [r["completions"] for r in reference.samples]
    assert reference.samples[0]["prompt"] == "<|begin_of_text|>" + rows[0]["question"]
