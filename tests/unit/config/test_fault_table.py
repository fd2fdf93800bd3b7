"""The fault table of docs/reliability.md: every user mistake ends in one line, ``error: ...``,
with exit status 2 and no traceback, through the real entry points (the ``tune run`` recipes'
``recipe_main`` and ``tune-grpo``), mostly before any model loads. In-process: seconds each."""

from __future__ import annotations

import json
import sys

import grpo_eval
import grpo_full_finetune_distributed as train_recipe
import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtune_grpo.cli.main import main as tune_grpo
from torchtune_grpo.quickstart.prepare import prepare_quickstart

QUICK = ["eval_every_n_steps=null", "eval_at_start=false", "progress_bar=false",
         "batch_size=2", "group_size=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The quickstart model, untrained (random weights: only its files matter here)."""
    return prepare_quickstart(tmp_path_factory.mktemp("base"), warmup_steps=0)


def _run(entry, capsys, monkeypatch, *argv: str) -> tuple[int, list[str]]:
    """Run a recipe's ``recipe_main`` with ``argv``; its exit status and stderr lines."""
    monkeypatch.setattr(sys, "argv", ["recipe", *argv])
    with pytest.raises(SystemExit) as raised:
        entry.recipe_main()
    err = [line for line in capsys.readouterr().err.splitlines()
           if not line.startswith("Skipping import of cpp extensions")]
    return raised.value.code, err


def _train(capsys, monkeypatch, base, out, *overrides: str) -> tuple[int, list[str]]:
    return _run(train_recipe, capsys, monkeypatch, "--config", "grpo/quickstart_cpu",
                f"model_dir={base}", f"output_dir={out}", *QUICK, *overrides)


def _one_error(code: int, err: list[str], *parts: str) -> str:
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1, err
    assert not any("Traceback" in line for line in err), err
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nrewards: [1, 2\nnum_steps: 3\n")
    code, err = _run(train_recipe, capsys, monkeypatch, "--config", str(bad))
    _one_error(code, err, f"config {bad}, line 3, column", "not valid YAML")
    assert tune_grpo(["validate", "--config", str(bad)]) == 2
    assert "line 3, column" in capsys.readouterr().err


def test_a_truncated_weight_file_is_named_as_such(base, tmp_path, capsys, monkeypatch):
    cut = tmp_path / "cut"
    cut.mkdir()
    for item in base.iterdir():
        (cut / item.name).write_bytes(item.read_bytes())
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, err = _train(capsys, monkeypatch, cut, tmp_path / "run")
    _one_error(code, err, "model.safetensors is truncated:", "checkpointer.checkpoint_dir")


def test_data_errors_count_rows_from_1(base, tmp_path, capsys, monkeypatch):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"{a}+{a}?", "answer": f"#### {2 * a}"} for a in range(4)]
    rows.insert(2, {"question": "no answer here"})
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dataset = ["dataset._component_=torchtune_grpo.datasets.gsm8k_dataset",
               f"dataset.source={data}", "~dataset.split"]
    code, err = _train(capsys, monkeypatch, base, tmp_path / "a", *dataset)
    _one_error(code, err, "row 3 field 'answer' is missing")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _train(capsys, monkeypatch, base, tmp_path / "b",
                       *dataset[:1], f"dataset.source={empty}", "~dataset.split")
    _one_error(code, err, "is empty")


def test_device_cuda_without_cuda_is_an_error(base, tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = _train(capsys, monkeypatch, base, tmp_path / "run", "device=cuda")
    _one_error(code, err, "config key 'device' is 'cuda'", "no cuda device")


def test_another_architectures_folder_under_an_explicit_builder(base, tmp_path, capsys,
                                                                 monkeypatch):
    """The quickstart config builds a Llama 3.2 decoder itself; a folder that says Qwen3 (or
    that is a Llama of another size) stops before any weight loads, naming both sides."""
    other = tmp_path / "qwen3"
    other.mkdir()
    for item in base.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config,
                                                   "architectures": ["Qwen3ForCausalLM"]}))
    code, err = _train(capsys, monkeypatch, other, tmp_path / "a")
    _one_error(code, err, "holds a Qwen3ForCausalLM (config.json)",
               "torchtune.models.llama3_2.llama3_2 (model._component_, "
               "checkpointer.model_type=LLAMA3_2)")
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    code, err = _train(capsys, monkeypatch, other, tmp_path / "b")
    _one_error(code, err, "hidden_size 128 (config.json) vs 64",
               f"model._component_=torchtune_grpo.models.hf_model with model.model_dir={other}")
    # grpo_eval with the quickstart's eval config on that folder: before the tokenizer
    code, err = _run(grpo_eval, capsys, monkeypatch, "--config", "grpo/eval_quickstart",
                     f"checkpoint_dir={other}")
    _one_error(code, err, "hidden_size 128 (config.json) vs 64")


def test_checkpoint_faults_nan_and_seed(base, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    code = None
    monkeypatch.setattr(sys, "argv", ["recipe", "--config", "grpo/quickstart_cpu",
                                      f"model_dir={base}", f"output_dir={out}", *QUICK,
                                      "num_steps=1"])
    with pytest.raises(SystemExit) as raised:
        train_recipe.recipe_main()
    assert raised.value.code in (0, None)
    capsys.readouterr()
    code, err = _train(capsys, monkeypatch, base, out, "num_steps=2", "seed=1",
                       "resume_from_checkpoint=true")
    _one_error(code, err, "seed was 0 in")
    assert "the config says 1; that changes the prompts and samples" in err[0]
    (weights,) = (out / "step_1").glob("model-*.safetensors")
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    code, err = _train(capsys, monkeypatch, base, out, "num_steps=2",
                       "resume_from_checkpoint=true")
    _one_error(code, err, "refusing to load", "NaN or infinite")


def test_tune_grpo_errors_are_one_line(tmp_path, capsys):
    assert tune_grpo(["plot", str(tmp_path / "nope")]) == 2
    assert tune_grpo(["validate", "--config", "grpo/quickstart_cpu", "num_stepz=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "Did you mean 'num_steps'?" in err[1]


def _copy(folder, target):
    target.mkdir()
    for item in folder.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    return target


def test_a_truncated_tokenizer_file_is_named_before_it_is_read(base, tmp_path, capsys,
                                                                monkeypatch):
    """torchtune's tokenizer builder raised a bare JSONDecodeError naming no file; now the
    recipes parse the tokenizer files the config names (and those of the model folder) first."""
    cut = _copy(base, tmp_path / "cut")
    tokenizer = cut / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:-40])
    code, err = _train(capsys, monkeypatch, cut, tmp_path / "run")
    line = _one_error(code, err, f"tokenizer.special_tokens_path: {tokenizer} is not valid JSON (",
                      "truncated or damaged", "download the model again")
    assert line.count("tokenizer.json") == 1  # named once, under the first key that names it
    code, err = _run(grpo_eval, capsys, monkeypatch, "--config", "grpo/eval_quickstart",
                     f"checkpoint_dir={cut}")
    _one_error(code, err, f"{tokenizer} is not valid JSON (", "download the model again")
    (cut / "CHECKPOINT_COMPLETE").write_text("1\n")  # a step folder: what to do differs
    code, err = _run(grpo_eval, capsys, monkeypatch, "--config", "grpo/eval_quickstart",
                     f"checkpoint_dir={cut}")
    _one_error(code, err, f"{tokenizer} is not valid JSON (", "use another step_N folder, or "
               "copy the damaged model files from the run's base model folder")
    (cut / "CHECKPOINT_COMPLETE").unlink()
    # a model folder's other tokenizer files are copied into every step folder: checked too
    tokenizer.write_bytes((base / "tokenizer.json").read_bytes())
    (cut / "tokenizer_config.json").write_text('{"eos_token": ')
    code, err = _train(capsys, monkeypatch, cut, tmp_path / "run")
    _one_error(code, err, f"checkpointer.checkpoint_dir: {cut / 'tokenizer_config.json'} is not "
               "valid JSON (")


def test_an_index_naming_a_missing_shard_names_the_file(base, tmp_path, capsys, monkeypatch):
    """A sharded folder lacking a shard the index names: the recipe listed the parameters the
    model then missed; now it names the file, as ``tune-grpo check-step`` does."""
    sharded = _copy(base, tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    (sharded / "model-00002-of-00002.safetensors").unlink()
    every_shard = ["checkpointer._component_=torchtune_grpo.models.hf_checkpointer",
                   "~checkpointer.checkpoint_files"]
    code, err = _train(capsys, monkeypatch, sharded, tmp_path / "run", *every_shard)
    _one_error(code, err, f"checkpointer.checkpoint_dir: {sharded}/model-00002-of-00002."
               "safetensors is missing (named by model.safetensors.index.json)")
    code, err = _run(grpo_eval, capsys, monkeypatch, "--config", "grpo/eval_quickstart",
                     f"checkpoint_dir={sharded}")
    _one_error(code, err, "model-00002-of-00002.safetensors is missing (named by model.")
    assert tune_grpo(["check-step", str(sharded)]) == 1
    assert ("model-00002-of-00002.safetensors is missing (named by model.safetensors.index."
            "json)") in capsys.readouterr().out


def _odd_reward(on_error: str) -> str:
    return "rewards=" + json.dumps([{"_component_": "tests.recipes.components.odd_answer_fails",
                                     "success": True, "success_threshold": 3.0,
                                     "on_error": on_error}])


def test_a_reward_component_that_raises_is_one_line(base, tmp_path, capsys, monkeypatch):
    code, err = _train(capsys, monkeypatch, base, tmp_path / "run", "num_steps=1",
                       _odd_reward("raise"))
    _one_error(code, err, "reward component 'odd_answer_fails' raised ValueError: odd answer",
               "on_error: zero", "TUNE_GRPO_DEBUG=1")


def test_reward_failures_scored_zero_are_counted_on_the_console(base, tmp_path, capsys,
                                                                  monkeypatch, caplog):
    code, err = _train(capsys, monkeypatch, base, tmp_path / "run", "num_steps=2",
                       "batch_size=4", "group_size=4", _odd_reward("zero"))
    assert code in (0, None), err
    warned = [r.getMessage() for r in caplog.records
              if "reward components failed and scored 0" in r.getMessage()]
    assert len(warned) == 2, warned  # one line per step, each counting the failed samples
    counts = [int(line.split("odd_answer_fails on ")[1].split()[0]) for line in warned]
    assert all(0 < n < 16 and n % 4 == 0 for n in counts), warned


def test_missing_files_say_download_only_when_the_folder_is_absent(base, tmp_path, capsys,
                                                                   monkeypatch):
    """A folder that is there but laid out otherwise gets the keys to set and `tune-grpo init`,
    not "download the model"."""
    other = tmp_path / "other"
    _copy(base, other)
    (other / "tokenizer.model").unlink()
    code, err = _train(capsys, monkeypatch, other, tmp_path / "a", "num_steps=1")
    line = _one_error(code, err, f"input files not found in the model folder {other}",
                      f"tokenizer.path: {other}/tokenizer.model does not exist",
                      f"tune-grpo init {other}")
    assert "download" not in line
    code, err = _train(capsys, monkeypatch, tmp_path / "absent", tmp_path / "b", "num_steps=1")
    _one_error(code, err, f"the model folder {tmp_path / 'absent'} does not exist (download "
               "the model")
