"""Gemma 3 (text) through the recipe: a tiny random ``Gemma3ForCausalLM`` folder written by
``transformers`` (:mod:`tests.unit._gemma3_models`: sliding window 8, shorter than the prompts;
with the ChatML test tokenizer) trained with the HF-folder config ``grpo/smollm2_arithmetic_cpu``
(``model_dir=...``), its step folder loaded back by ``transformers``; and a LoRA step.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes._helpers import LENGTH_REWARD, assert_not_degenerate
from tests.unit._gemma3_models import write_gemma3
from torchtune_grpo.training.config import load_config

transformers = pytest.importorskip("transformers")

CONFIG = "grpo/smollm2_arithmetic_cpu"
SHORT = ["num_steps=1", "batch_size=2", "group_size=4", "max_generated_tokens=8",
         "save_every_n_steps=1", "progress_bar=false", "eval_every_n_steps=null",
         "eval_at_start=false", "temperature=1.0", "optimizer.lr=1e-3", "model.max_seq_len=256",
         "tokenizer.max_seq_len=256", "optimizer.fused=false", "forward_batch_size=4",
         "dataset.limit=32"]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tied, GQA Gemma 3 folder (sliding/global layers alternating) with a tokenizer."""
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    write_gemma3(path, "tied_gqa_pattern", tokenizer=True)
    return path


def _train(model_dir, out, *extra):
    from torchtune_grpo.training.recipe import GRPORecipe

    cfg = load_config(CONFIG, [f"model_dir={model_dir}", f"output_dir={out}", *SHORT, *extra])
    cfg.rewards = LENGTH_REWARD
    recipe = GRPORecipe(cfg)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    return recipe


def _check_in_transformers(recipe, step_dir, tol: float) -> None:
    """``transformers`` loads ``step_dir``; its logits equal the trained policy's (rows of 24
    and 17 real tokens, longer than the window)."""
    from torchtune_grpo.algorithm.trajectory import attention_mask, position_ids

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(step_dir), dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    tokens = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.arange(24)[None] >= torch.tensor([0, 7])[:, None]
    recipe.model.eval()
    with torch.no_grad():
        ours = recipe.model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
        theirs = loaded(tokens, attention_mask=mask.long(),
                        position_ids=position_ids(mask)).logits
    diff = (ours - theirs).abs()[mask].max().item()
    print(f"{step_dir}: max |logit diff| trained policy vs transformers = {diff:.3g}")
    assert theirs.abs().max() > 1.0 and diff <= tol


def test_one_step_saves_a_folder_transformers_loads(gemma3_dir, tmp_path):
    out = tmp_path / "full"
    recipe = _train(gemma3_dir, out)
    step = out / "step_1"
    assert (step / "CHECKPOINT_COMPLETE").is_file()
    (moved,) = assert_not_degenerate(out, weights=(gemma3_dir, step))
    assert any("pre_feedforward_layernorm" in k for k in moved)
    config = json.loads((step / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (step / "tokenizer.json").is_file()
    _check_in_transformers(recipe, step, tol=1e-5)


def test_lora_trains_and_merged_save_loads(gemma3_dir, tmp_path):
    out = tmp_path / "lora"
    recipe = _train(gemma3_dir, out, "model._component_=torchtune_grpo.models.lora_hf_model",
                    "model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj]",
                    "model.apply_lora_to_mlp=true", "model.lora_rank=4", "model.lora_alpha=8",
                    "optimizer.lr=1e-2")
    assert recipe.is_lora
    step = out / "step_1"
    (moved,) = assert_not_degenerate(out, weights=(gemma3_dir, step))
    assert not any("norm" in k or "embed" in k for k in moved)
    assert any("q_proj" in k for k in moved)
    assert (step / "adapter_model.safetensors").is_file()
    _check_in_transformers(recipe, step, tol=1e-4)
