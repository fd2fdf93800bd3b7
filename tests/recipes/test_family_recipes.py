"""Every supported family through the recipes (issue 45, items 3c-3e): a tiny random folder
of each (the first case per architecture of :mod:`tests.unit.models.families._family_zoo`, with the
ChatML test
tokenizer) trained with the HF-folder config ``grpo/smollm2_arithmetic_cpu`` (``model_dir=...``,
nothing else about the model), its step folder loaded back by ``transformers``; LoRA; two FSDP2
ranks; ``tune run`` training and ``grpo_eval`` (Qwen3, the most used family).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes._helpers import (
    LENGTH_REWARD,
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    launch,
    metrics,
    run_in_process,
    run_tune,
    train_metrics,
)
from tests.unit.models.families._family_zoo import CASES, write_model
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.models.families import FAMILY_MODULES

transformers = pytest.importorskip("transformers")

CONFIG = "grpo/smollm2_arithmetic_cpu"
SHORT = ["num_steps=1", "batch_size=2", "group_size=4", "max_generated_tokens=8",
         "save_every_n_steps=1", "progress_bar=false", "eval_every_n_steps=null",
         "eval_at_start=false", "temperature=1.0", "optimizer.lr=1e-3", "model.max_seq_len=256",
         "tokenizer.max_seq_len=256", "optimizer.fused=false", "forward_batch_size=4",
         "dataset.limit=32"]


#: One case per architecture (the zoo's first).
FAMILIES = [case for case in {c.architecture: c for c in reversed(CASES)}.values()
            if case.architecture in FAMILY_MODULES][::-1]  # Llama/Qwen2: the other recipe tests
#: The families whose whole GRPO step also runs on two ranks here (slow tier); every family's
#: sharded forward and backward is checked in the fast tier (test_family_parity.py).
TWO_RANKS = [pytest.param(case, id=case.architecture) for case in FAMILIES
             if case.architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")]


@pytest.fixture(scope="module", params=FAMILIES, ids=[case.architecture for case in FAMILIES])
def family_dir(request, tmp_path_factory):
    """``(folder, case)``: a tiny folder of the family, with the ChatML test tokenizer."""
    path = tmp_path_factory.mktemp("family") / request.param.name
    write_model(path, request.param, tokenizer=True)
    return path, request.param


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tied, ``head_dim`` 32 (not hidden/heads = 16) Qwen3 folder with a tokenizer."""
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"
    write_model(path, "qwen3-tied-gqa-head_dim_32", tokenizer=True)
    return path


def _train(model_dir, out, *extra):
    from torchtune_grpo.training.recipe import GRPORecipe

    cfg = load_config(CONFIG, [f"model_dir={model_dir}", f"output_dir={out}", *SHORT, *extra])
    cfg.rewards = LENGTH_REWARD
    return run_in_process(GRPORecipe(cfg))


def _check_in_transformers(recipe, step_dir, tol: float) -> None:
    """``transformers`` loads ``step_dir``; its logits equal the trained policy's (rows of 24
    and 17 real tokens, longer than a sliding window of 8)."""
    from torchtune_grpo.policy.positions import attention_mask, position_ids

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(step_dir), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 300, (2, 24), generator=generator)
    mask = torch.arange(24)[None] >= torch.tensor([0, 7])[:, None]
    recipe.model.eval()
    with torch.no_grad():
        ours = recipe.model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
        theirs = loaded(tokens, attention_mask=mask.long(),
                        position_ids=position_ids(mask)).logits
    diff = (ours - theirs).abs()[mask].max().item()
    print(f"{step_dir}: max |logit diff| trained policy vs transformers = {diff:.3g}")
    assert theirs.abs().max() > 1.0 and diff <= tol


def test_one_step_saves_a_folder_transformers_loads(family_dir, tmp_path):
    """(c) One GRPO step; the step folder is the family's HF folder, every norm trained."""
    folder, case = family_dir
    out = tmp_path / "full"
    recipe = _train(folder, out)
    step = out / "step_1"
    assert (step / "CHECKPOINT_COMPLETE").is_file()
    (moved,) = assert_not_degenerate(out, weights=(folder, step))
    norms = {k for k in _weight_names(folder) if "norm" in k}
    assert norms and norms <= set(moved), sorted(norms - set(moved))[:3]
    assert json.loads((step / "config.json").read_text())["architectures"] == [case.architecture]
    assert (step / "tokenizer.json").is_file()
    _check_in_transformers(recipe, step, tol=1e-5)


def _weight_names(folder) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.extend(f.keys())
    return names


def test_lora_trains_and_merged_save_loads(family_dir, tmp_path):
    """(d) LoRA on every attention and MLP projection; the merged step folder loads in
    ``transformers`` with the adapted policy's logits."""
    folder, _ = family_dir
    out = tmp_path / "lora"
    recipe = _train(folder, out, "model._component_=torchtune_grpo.models.lora_hf_model",
                    "model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj]",
                    "model.apply_lora_to_mlp=true", "model.lora_rank=4", "model.lora_alpha=8",
                    "optimizer.lr=1e-2")
    assert recipe.is_lora
    step = out / "step_1"
    (moved,) = assert_not_degenerate(out, weights=(folder, step))
    assert not any("norm" in k or "embed" in k for k in moved)  # only adapted weights moved
    assert any("q_proj" in k or "qkv_proj" in k for k in moved)  # Phi-3: fused q|k|v
    assert (step / "adapter_model.safetensors").is_file()
    _check_in_transformers(recipe, step, tol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family_dir", TWO_RANKS, indirect=True)
def test_two_ranks_first_step_equals_one(family_dir, tmp_path):
    """(e) FSDP2 on two gloo ranks: the first step's loss and grad norm of one process."""
    folder, _ = family_dir

    def first_step(name: str, nproc: int):
        out = tmp_path / name
        run_tune([*launch(nproc), "--config", CONFIG, f"model_dir={folder}",
                  f"output_dir={out}", *SHORT, "num_steps=1", "global_batch_size=4",
                  "batch_size=null", "forward_batch_size=4", "loss.aggregation=token_mean",
                  "loss.entropy_coeff=0.01", LENGTH_REWARD_OVERRIDE], cwd=tmp_path)
        return out

    one, two = first_step("one", 1), first_step("two", 2)
    assert_not_degenerate(one, two, weights=(folder, one / "step_1"))
    (a,), (b,) = metrics(one), metrics(two)
    print({k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
    assert a["grad_norm"] > 0
    assert b["reward/mean"] == a["reward/mean"]
    assert b["response_length/mean"] == a["response_length/mean"]
    for key in ("loss", "grad_norm", "entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_tune_run_trains_and_evaluates(qwen3_dir, tmp_path):
    """The user's commands: ``tune run grpo_full_finetune_distributed --config ...
    model_dir=<Qwen3 folder>`` and ``tune run grpo_eval checkpoint_dir=<step folder>``."""
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed", "--config", CONFIG,
              f"model_dir={qwen3_dir}", f"output_dir={out}", *SHORT, "num_steps=2",
              LENGTH_REWARD_OVERRIDE], cwd=tmp_path, threads=2)
    assert [r["step"] for r in train_metrics(out)] == [1, 2]
    step = out / "step_2"
    run_tune(["run", "grpo_eval", "--config", "grpo/eval_smollm2_arithmetic",
              f"checkpoint_dir={step}", "max_generated_tokens=8", "progress_bar=false",
              "dataset.limit=8"], cwd=tmp_path, threads=2)
    result = json.loads((step / "eval_results.json").read_text())
    assert result["num_problems"] == 8 and "pass@1" in result["metrics"]


def test_unsupported_field_is_one_line_before_any_weight(qwen3_dir, tmp_path):
    """``use_sliding_window: true`` stops ``tune run`` with one ``error:`` line (exit 2) that
    names the field, before any weight is read (the folder has none)."""
    import shutil
    import subprocess

    from tests.recipes._helpers import recipe_env, tune_cmd

    folder = tmp_path / "sliding"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(qwen3_dir / name, folder / name)
    config = json.loads((qwen3_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    proc = subprocess.run(
        tune_cmd("run", "grpo_full_finetune_distributed", "--config", CONFIG,
                 f"model_dir={folder}", f"output_dir={tmp_path / 'out'}", *SHORT),
        cwd=tmp_path, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "use_sliding_window=true is not supported" in errors[0]
    assert "Traceback" not in proc.stderr
