"""Bad configs, bad data, non-finite updates and dead ranks: clear errors, nothing lost."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.recipes._helpers import (
    LENGTH_REWARD,
    quickstart_config,
    quickstart_overrides,
    recipe_env,
    train_in_process,
    train_metrics,
    tune_cmd,
)
from torchtune_grpo.checkpoints.saving import latest_step_checkpoint, load_recipe_state
from torchtune_grpo.training.recipe import GRPORecipe

pytestmark = pytest.mark.slow


def _setup(base, out, *overrides):
    recipe = GRPORecipe(quickstart_config(base, out, *overrides))
    recipe.setup()
    return recipe


def test_missing_input_files_name_the_key(base_model, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.path: .*nope\.model"):
        _setup(base_model, tmp_path, f"tokenizer.path={tmp_path}/nope.model")
    with pytest.raises(FileNotFoundError, match=r"checkpointer.checkpoint_files: .*gone"):
        _setup(base_model, tmp_path, "checkpointer.checkpoint_files=[gone.safetensors]")


def test_checkpoint_of_another_shape_names_the_parameter(base_model, tmp_path):
    # the folder's config.json already says so, before any weight loads
    with pytest.raises(ValueError, match=r"hidden_size 64 \(config.json\) vs 128, "
                                         r"num_attention_heads 4 \(config.json\) vs 8"):
        _setup(base_model, tmp_path / "a", "model.embed_dim=128", "model.num_heads=8")
    # a config.json that lies about the weights: the load names the parameter
    import json
    import shutil

    lying = tmp_path / "lying"
    shutil.copytree(base_model, lying)
    config = json.loads((lying / "config.json").read_text())
    config.update(hidden_size=128, num_attention_heads=8)
    (lying / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"cannot load the weights in {lying} .*: do its "
                                         r"config.json and weight files belong together"):
        _setup(lying, tmp_path / "b", "model.embed_dim=128", "model.num_heads=8")


def test_generation_beyond_context_is_rejected_before_loading(base_model, tmp_path):
    with pytest.raises(ValueError, match="'max_generated_tokens' .* above the model's max_seq_len"):
        _setup(base_model, tmp_path, "model.max_seq_len=16", "max_generated_tokens=12")


def test_bad_rows_error_or_are_skipped_and_counted(base_model, tmp_path):
    data = tmp_path / "tiny_gsm8k.jsonl"
    rows = [{"question": f"{a}+{a}?", "answer": f"double it #### {2 * a}"} for a in range(8)]
    rows.insert(3, {"question": "no answer here"})
    data.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = ["dataset._component_=torchtune_grpo.datasets.gsm8k_dataset",
               f"dataset.source={data}", "~dataset.split", "tokenizer.max_seq_len=1024",
               "model.max_seq_len=1024"]
    with pytest.raises(ValueError, match="row 4 field 'answer'"):  # rows counted from 1
        _setup(base_model, tmp_path / "a", *dataset)
    train_in_process(base_model, tmp_path / "b", *dataset, "dataset.invalid_rows=skip",
                     "num_steps=1", "batch_size=4", "group_size=2", "max_generated_tokens=3")
    assert train_metrics(tmp_path / "b")[-1]["data/skipped_rows"] == 1.0


def test_consecutive_non_finite_steps_stop_after_saving(base_model, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="consecutive steps had a non-finite"):
        train_in_process(base_model, out, "num_steps=10", "batch_size=4", "group_size=4",
                         "temperature=1.5", "optimizer._component_=torch.optim.SGD",
                         "optimizer.lr=1e30", "~optimizer.weight_decay", "clip_grad_norm=null",
                         "max_consecutive_skipped_steps=2", rewards=LENGTH_REWARD)
    saved = latest_step_checkpoint(out)
    assert saved is not None
    state = load_recipe_state(saved)
    assert state["skipped_steps"] >= 2 and state["step"] < 10


def test_a_dead_rank_ends_the_job_quickly_and_keeps_the_checkpoint(base_model, tmp_path):
    out = tmp_path / "run"
    args = quickstart_overrides(
        base_model, out, "num_steps=5", "batch_size=2", "save_every_n_steps=1",
        "model._component_=rank_biased_model.dying_rank_llama", "model.kill_at_forward=2",
        "distributed_timeout_s=60")
    start = time.time()
    proc = subprocess.run(tune_cmd("run", "--nproc_per_node", "2",
                                   "grpo_full_finetune_distributed", *args),
                          cwd=tmp_path, env=recipe_env(), capture_output=True, text=True,
                          timeout=300)
    elapsed = time.time() - start
    assert proc.returncode != 0
    assert elapsed < 200, f"took {elapsed:.0f}s to notice the dead rank"
    saved = latest_step_checkpoint(out)
    assert saved is not None and saved.name == "step_1"
    from safetensors.torch import load_file

    assert load_file(str(saved / "model-00001-of-00001.safetensors"))
    assert not (out / "step_2").exists()
