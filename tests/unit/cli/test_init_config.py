"""``tune-grpo init MODEL_DIR``: a working training and eval config for any supported folder,
with the family's keys only (thinking where the chat template takes it, a few-shot prompt for a
base model), and one-line errors."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.models.families._family_zoo import write_model
from torchtune_grpo.cli.init_config import write_configs
from torchtune_grpo.cli.main import main as tune_grpo
from torchtune_grpo.errors import UserError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_model(root / "llama", "llama-tied-gqa", tokenizer=True)
    write_model(root / "qwen3", "qwen3-tied-gqa-head_dim_32", tokenizer=True)
    # a thinking template: the folder's own, with Qwen3's switch
    template = root / "qwen3" / "chat_template.jinja"
    template.write_text("{%- if enable_thinking is defined and not enable_thinking %}"
                        "{%- endif %}" + template.read_text())
    write_model(root / "base", "gemma3-tied-gqa-pattern")  # no tokenizer files: no template
    return root


def _load(path):
    return yaml.safe_load(path.read_text())


def test_a_cpu_config_for_a_chat_model_trains_and_its_eval_config_validates(folders, tmp_path):
    from tests.recipes._helpers import quickstart_config, run_in_process, train_metrics
    from torchtune_grpo.config.schema import EVAL_KEYS
    from torchtune_grpo.config.validation import validate_config
    from torchtune_grpo.training.recipe import GRPORecipe

    train, evaluation = write_configs(folders / "llama", task="arithmetic",
                                      out=tmp_path / "my.yaml", device="cpu")
    assert (train.name, evaluation.name) == ("my.yaml", "my_eval.yaml")
    cfg = _load(train)
    assert cfg["model"]["_component_"] == "torchtune_grpo.models.hf_model"
    assert cfg["tokenizer"]["_component_"] == "torchtune_grpo.models.hf_tokenizer"
    assert (cfg["device"], cfg["dtype"], cfg["optimizer"]["_component_"]) == (
        "cpu", "fp32", "torch.optim.AdamW")
    assert "enable_thinking" not in cfg["tokenizer"]
    assert "think_tag" not in cfg["rewards"][0]
    header = train.read_text().split("\noutput_dir:")[0]
    assert "LlamaForCausalLM" in header and "Memory: about" in header
    out = tmp_path / "run"
    recipe = GRPORecipe(quickstart_config(
        folders / "llama", out, "num_steps=1", "batch_size=2", "group_size=2",
        "forward_batch_size=4", config=str(train)))
    run_in_process(recipe)
    assert (out / "step_1").is_dir() and len(train_metrics(out)) == 1
    from torchtune_grpo.config.loading import load_config

    validate_config(load_config(str(evaluation)), schema=EVAL_KEYS)
    assert _load(evaluation)["checkpoint_dir"] == str((folders / "llama").resolve())


def test_thinking_keys_only_where_the_template_takes_them(folders, tmp_path):
    train, _ = write_configs(folders / "qwen3", task="gsm8k", out=tmp_path / "q.yaml",
                             device="cuda")
    cfg = _load(train)
    assert cfg["tokenizer"]["enable_thinking"] is True
    assert cfg["rewards"][0]["think_tag"] == "think"
    assert (cfg["dtype"], cfg["optimizer"]["_component_"]) == ("bf16", "torchtune_grpo.optim.AdamW")
    assert "--nproc_per_node 8" in train.read_text()
    other, _ = write_configs(folders / "llama", task="gsm8k", out=tmp_path / "l.yaml",
                             device="cuda")
    assert "think" not in other.read_text().split("\noutput_dir:")[1]


def test_a_base_model_gets_a_few_shot_prompt_or_one_line(folders, tmp_path):
    train, _ = write_configs(folders / "base", task="arithmetic", out=tmp_path / "b.yaml",
                             device="cpu")
    cfg = _load(train)
    assert cfg["dataset"]["template"] == "torchtune_grpo.datasets.EQUATION_FEW_SHOT_TEMPLATE"
    assert cfg["tokenizer"]["stop_strings"] == ["\n"]
    with pytest.raises(UserError, match="has no chat template .*--task arithmetic"):
        write_configs(folders / "base", task="gsm8k", out=tmp_path / "g.yaml", device="cpu")


def test_errors_are_one_line_and_nothing_is_overwritten(folders, tmp_path, capsys):
    assert tune_grpo(["init", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: MODEL_DIR: ") and "download" in err[0]
    (tmp_path / "empty").mkdir()
    assert tune_grpo(["init", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    out = tmp_path / "mine.yaml"
    out.write_text("my work\n")
    assert tune_grpo(["init", str(folders / "llama"), "--out", str(out)]) == 2
    assert "already exist" in capsys.readouterr().err and out.read_text() == "my work\n"
    assert tune_grpo(["init", str(folders / "llama"), "--out", str(out), "--task", "bogus"]) == 2
    assert tune_grpo(["init", str(folders / "llama"), "--out", str(out), "--overwrite",
                      "--device", "cpu"]) == 0
    assert out.read_text().startswith("# GRPO on gsm8k for llama")
