"""The typed config tree: every key is a dataclass field, and the defaults, the checks and the
key tables are read from the fields."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from torchtune_grpo.config.loading import load_config
from torchtune_grpo.config.schema import (
    ASYNC_KEYS,
    EVAL_KEYS,
    RECIPE_KEYS,
    REQUIRED,
    AsyncConfig,
    EvalConfig,
    RecipeConfig,
    keys_for,
    with_defaults,
)
from torchtune_grpo.config.settings import (
    AdvantageSettings,
    Component,
    HealthSettings,
    key,
    keys_of,
    type_name,
    value_fits,
)
from torchtune_grpo.config.validation import ConfigError, validate_config
from torchtune_grpo.evaluation.settings import EvalSettings


def test_key_tables_are_the_fields_of_the_trees():
    for tree, table in ((RecipeConfig, RECIPE_KEYS), (AsyncConfig, ASYNC_KEYS),
                        (EvalConfig, EVAL_KEYS)):
        hints = typing.get_type_hints(tree)
        assert list(table) == [f.name for f in dataclasses.fields(tree)]
        for name, spec in table.items():
            assert spec.hint == hints[name] and not isinstance(spec.hint, str), name
            assert spec.doc, f"{tree.__name__}.{name} has no meaning"
    assert RECIPE_KEYS["batch_size"].type == "int|null"
    assert RECIPE_KEYS["generator"].type == "component|null"
    assert RECIPE_KEYS["resume_from_checkpoint"].type == "bool|str"
    assert (RECIPE_KEYS["rewards"].type, RECIPE_KEYS["tools"].type) == ("list", "list|null")
    assert RECIPE_KEYS["advantages"].settings is AdvantageSettings
    assert RECIPE_KEYS["run_health"].default == {} and RECIPE_KEYS["seed"].settings is None
    assert RECIPE_KEYS["group_size"].default is REQUIRED


def test_eval_tree_shares_the_training_keys_it_names():
    """A key of ``grpo_eval`` that training has too keeps its type, default and meaning; the
    sampling keys take their defaults from ``EvalSettings``."""
    shared = ("seed", "device", "dtype", "model", "tokenizer", "checkpointer", "dataset",
              "rewards", "top_k", "progress_bar", "model_dir", "max_tool_calls", "tool_syntax")
    for name in shared:
        assert EVAL_KEYS[name] == RECIPE_KEYS[name], name
    assert EVAL_KEYS["k"].default == EvalSettings().k
    assert EVAL_KEYS["num_samples"].default == EvalSettings.num_samples
    assert EVAL_KEYS["temperature"].doc != RECIPE_KEYS["temperature"].doc


@dataclass(frozen=True, kw_only=True)
class _Tiny:
    """A two-key tree: what validation and the defaults do follows from its fields alone."""

    steps: int = key(REQUIRED, "How many.", lambda v: None if v >= 1 else "must be >= 1")
    head: Component | None = key(None, "A component.")
    health: HealthSettings | None = key({}, "A nested block.")
    tags: list[str] = key(["a"], "Some tags.")


def test_validation_and_defaults_follow_the_tree():
    keys = keys_of(_Tiny)

    def problems(**values) -> str:
        with pytest.raises(ConfigError) as info:
            validate_config(OmegaConf.create(values), schema=keys)
        return str(info.value)

    validate_config(OmegaConf.create({"steps": 2}), schema=keys)
    assert "missing required config key 'steps': How many." in problems()
    assert "unknown config key 'stepz'. Did you mean 'steps'?" in problems(steps=1, stepz=1)
    assert "config key 'steps' must be int, got 'x'" in problems(steps="x")
    assert "config key 'steps' must be >= 1 (got 0)" in problems(steps=0)
    assert "config key 'head' must be component|null, got {'a': 1}" in problems(
        steps=1, head={"a": 1})
    assert "config key 'health.windw'" in problems(steps=1, health={"windw": 2})
    assert "config key 'tags' must be list, got 'a'" in problems(steps=1, tags="a")
    filled = with_defaults(OmegaConf.create({"steps": 3}), keys)
    assert OmegaConf.to_container(filled) == {"steps": 3, "head": None, "health": {},
                                              "tags": ["a"]}
    first, second = _Tiny(steps=1), _Tiny(steps=1)
    assert first.tags == ["a"] and first.tags is not second.tags  # a copy for every use


def test_a_non_finite_float_is_a_type_error():
    for value in ("nan", "inf"):
        cfg = load_config("grpo/quickstart_cpu", [f"temperature={value}"])
        cfg.temperature = float(value)
        with pytest.raises(ConfigError, match="config key 'temperature' must be float"):
            validate_config(cfg)


def test_value_fits_components_settings_and_omegaconf_nodes():
    assert value_fits(Component, {"_component_": "a.b"})
    assert not value_fits(Component, {"a": 1}) and not value_fits(Component, "a.b")
    assert value_fits(HealthSettings | None, OmegaConf.create({"window": 2}))
    assert not value_fits(HealthSettings | None, [1])
    assert value_fits(list[Component], OmegaConf.create([{"_component_": "a.b"}]))
    assert not value_fits(int | None, True)
    assert type_name(dict[str, str] | None) == "dict|null"


def test_the_recipe_sets_the_eval_seed_not_the_block():
    cfg = load_config("grpo/quickstart_cpu", ["eval={seed: 3}"])
    with pytest.raises(ConfigError, match=r"unknown config key 'eval\.seed' \(known: "
                                          r"num_samples, temperature, top_k, k, "
                                          r"max_generated_tokens, forward_batch_size\)"):
        validate_config(cfg)


def test_keys_for_reads_the_recipe_from_the_config():
    assert keys_for(load_config("grpo/quickstart_cpu")) == (RECIPE_KEYS, None)
    assert keys_for(load_config("grpo/quickstart_cpu_async")) == (RECIPE_KEYS, ASYNC_KEYS)
    assert keys_for(load_config("grpo/eval_quickstart", ["checkpoint_dir=/x"])) == (
        EVAL_KEYS, None)


def test_the_tree_has_no_string_types():
    """No key is typed by a string such as ``"int|null"``: its type is an annotation."""
    import torchtune_grpo.config.schema as schema

    source = open(schema.__file__).read()
    assert '"int|null"' not in source and "Key(\"" not in source
    for spec in (*RECIPE_KEYS.values(), *ASYNC_KEYS.values(), *EVAL_KEYS.values()):
        assert not isinstance(spec.hint, str)
