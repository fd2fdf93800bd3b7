"""``tune-grpo ls`` and ``tune-grpo validate``: each config's recipe is read from its keys, so
an eval or asynchronous config is listed once, under its recipe, and validated against its own
tree."""

from __future__ import annotations

import shutil

import pytest

from torchtune_grpo.cli.main import config_table, device_kind, main
from torchtune_grpo.config.loading import list_shipped_configs, load_config, resolve_config_path
from torchtune_grpo.config.schema import (
    ASYNC_KEYS,
    ASYNC_RECIPE,
    EVAL_KEYS,
    EVAL_RECIPE,
    RECIPE_KEYS,
    TRAINING_RECIPES,
    keys_for,
    recipes_for,
)

TRAINING = ", ".join(TRAINING_RECIPES)


@pytest.fixture(scope="module")
def table():
    return config_table()


def test_ls_lists_each_config_once_with_its_device_and_recipes(table, capsys):
    assert [name for name, _, _ in table] == list_shipped_configs()  # each once, in order
    rows = {name: (device, recipes) for name, device, recipes in table}
    assert rows["grpo/quickstart_cpu"] == ("CPU", TRAINING)
    assert rows["grpo/qwen2_5_3B_full"] == ("GPU", TRAINING)
    assert rows["grpo/quickstart_cpu_async"] == ("CPU", ASYNC_RECIPE)
    assert rows["grpo/eval_quickstart"] == ("CPU", EVAL_RECIPE)
    assert rows["grpo/eval_gsm8k"] == ("GPU", EVAL_RECIPE)
    for name, device, _ in table:  # the config's own device key (inherited ones included)
        assert device == device_kind(load_config(name).get("device", "cuda")), name

    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["CONFIG", "DEVICE", "RECIPES"]
    assert len(lines) == 1 + len(table)
    assert [line.split()[0] for line in lines[1:]] == list_shipped_configs()
    # aligned: every column starts at the header's offset
    for column in ("DEVICE", "RECIPES"):
        start = lines[0].index(column)
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in lines[1:])


def test_device_kind():
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:1", "CUDA", "mps")] == [
        "CPU", "GPU", "GPU", "GPU", "MPS"]


def test_the_recipe_is_read_from_the_keys_not_the_name(tmp_path):
    """A renamed copy keeps its recipe; a ``checkpoint_dir: ???`` still marks an eval config."""
    plain = tmp_path / "mine.yaml"
    shutil.copyfile(resolve_config_path("grpo/eval_quickstart"), plain)
    cfg = load_config(str(plain))
    assert "checkpoint_dir" not in cfg  # ``???``: omegaconf's ``in`` does not see it
    assert keys_for(cfg) == (EVAL_KEYS, None) and recipes_for(cfg) == (EVAL_RECIPE,)
    only = tmp_path / "only.yaml"  # nothing but ``checkpoint_dir: ???`` says grpo_eval
    only.write_text("checkpoint_dir: ???\nseed: 0\n")
    assert recipes_for(load_config(str(only))) == (EVAL_RECIPE,)
    # num_samples / k without any training key: an eval config that forgot checkpoint_dir
    assert recipes_for(load_config(str(plain), ["~checkpoint_dir"])) == (EVAL_RECIPE,)
    # a training config with a stray top-level ``k`` stays a training config
    assert recipes_for(load_config("grpo/quickstart_cpu", ["k=[1]"])) == TRAINING_RECIPES
    assert keys_for(load_config("grpo/quickstart_cpu", ["rollout_ranks=1"])) == (
        RECIPE_KEYS, ASYNC_KEYS)


def test_validate_checks_an_eval_config_against_the_eval_tree(capsys):
    assert main(["validate", "--config", "grpo/eval_gsm8k", "checkpoint_dir=/x"]) == 0
    assert capsys.readouterr().out.strip() == (
        "grpo/eval_gsm8k: config is well-formed for grpo_eval")
    # without checkpoint_dir: that one key, none of the training tree's
    assert main(["validate", "--config", "grpo/eval_gsm8k"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: invalid config: missing required config key "
                          "'checkpoint_dir'") and len(err.splitlines()) == 1
    assert err.count("config key") == 1
    for wrong in ("num_samples", "output_dir", "group_size", "temperature", "optimizer"):
        assert f"'{wrong}'" not in err
    # the eval tree's own checks run: k beyond num_samples
    assert main(["validate", "--config", "grpo/eval_gsm8k", "checkpoint_dir=/x", "k=[4]"]) == 2
    assert "config key 'k'" in capsys.readouterr().err


def test_validate_checks_an_async_config_on_its_world(capsys):
    assert main(["validate", "--config", "grpo/quickstart_cpu_async"]) == 0
    assert capsys.readouterr().out.strip() == ("grpo/quickstart_cpu_async: config is well-formed "
                                               f"for {ASYNC_RECIPE} on 3 processes")
    assert main(["validate", "--config", "grpo/quickstart_cpu_async", "--world-size", "1"]) == 2
    assert "config key 'rollout_ranks' (1) must be below" in capsys.readouterr().err
    assert main(["validate", "--config", "grpo/quickstart_cpu_async",
                 "dynamic_sampling={max_batches: 2}"]) == 2
    assert "not supported by the asynchronous recipe" in capsys.readouterr().err


def test_validate_a_training_config(capsys):
    assert main(["validate", "--config", "grpo/quickstart_cpu"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"grpo/quickstart_cpu: config is well-formed for {' or '.join(TRAINING_RECIPES)} on "
        "1 process")
    assert main(["validate", "--config", "grpo/quickstart_cpu", "--world-size", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"for {TRAINING_RECIPES[0]} on 2 processes")


def test_every_shipped_config_validates_through_the_cli(table, capsys):
    for name, _, recipes in table:
        extra = ["checkpoint_dir=/x"] if recipes == EVAL_RECIPE else []
        assert main(["validate", "--config", name, *extra]) == 0, capsys.readouterr().err
