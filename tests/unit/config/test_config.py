"""Config lookup, overrides and validation: every mistake is named before a model loads."""

from __future__ import annotations

import re

import pytest
import torch
from torchtune import config as tt_config

from tests.conftest import check_instantiates_offline, config_json_alone
from torchtune_grpo.config.loading import list_shipped_configs, load_config, resolve_config_path
from torchtune_grpo.config.validation import (
    ConfigError,
    validate_async_config,
    validate_config,
)

REAL_CONFIGS = ["grpo/qwen2_5_3B_full", "grpo/llama3_2_3B_full"]


def test_shipped_names_resolve_and_real_paths_win(tmp_path, monkeypatch):
    assert "grpo/quickstart_cpu" in list_shipped_configs()
    for name in ("grpo/quickstart_cpu", "quickstart_cpu", "grpo/quickstart_cpu.yaml"):
        assert resolve_config_path(name).name == "quickstart_cpu.yaml"
    local = tmp_path / "grpo" / "quickstart_cpu.yaml"
    local.parent.mkdir()
    local.write_text("output_dir: mine\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("grpo/quickstart_cpu.yaml").resolve() == local.resolve()
    with pytest.raises(FileNotFoundError, match="quickstart_cpu"):
        resolve_config_path("grpo/no_such_config")


def test_overrides_apply():
    cfg = load_config("grpo/quickstart_cpu", ["group_size=4", "loss.kl_coeff=0.05"])
    assert cfg.group_size == 4 and cfg.loss.kl_coeff == 0.05
    with pytest.raises(ValueError, match="key=value"):
        load_config("grpo/quickstart_cpu", ["group_size"])


@pytest.mark.parametrize("name", None or ["grpo/quickstart_cpu", *REAL_CONFIGS])
def test_shipped_configs_validate(name):
    validate_config(load_config(name), world_size=1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["group_size=1"], "'group_size' must be in [2, 4096]"),
        (["kl_coef=0.1"], "unknown config key 'kl_coef'"),
        (["ppo_epochs=0"], "'ppo_epochs' must be >= 1"),
        (["temperature=0"], "'temperature' must be > 0"),
        (["~num_steps"], "missing required config key 'num_steps'"),
        (["loss._component_=torchtune_grpo.algorithm.loss.NoSuchLoss"], "NoSuchLoss"),
        (["optimizer._component_=torch.optim.Adamm"], "Adamm"),
        (["forward_batch_size=7"], "'forward_batch_size' (7) must divide"),
        (["dtype=fp16"], "'dtype' must be fp32 or bf16"),
        # found by the config fuzz (tests/recipes/config_fuzz.py): each used to pass
        # validation and fail later with a bare TypeError, RuntimeError or ValueError
        (["checkpointer.output_dir=true"], "config key checkpointer.output_dir: "),
        (["dataset.split=[train]"], "config key dataset.split: "),
        (["checkpointer.model_type=[LLAMA3_2]"], "config key checkpointer.model_type: "),
        (["model.num_kv_heads=-100"], "config key model.num_kv_heads must be >= 1"),
        (["tokenizer.max_seq_len=0"], "config key tokenizer.max_seq_len must be >= 1"),
        (["~metric_logger.log_dir"], "metric_logger.log_dir: torchtune.training.metric_logging"
                                     ".DiskLogger needs argument 'log_dir'"),
        (["eval.num_samples=oops"], "config key 'eval.num_samples' must be int, got 'oops'"),
        (['rewards=[{weight: 1.0}]'], "config key rewards[0] must be a mapping with "
                                      "`_component_`"),
        (["seed=-1"], "config key 'seed' must be in [0, 2**32)"),
        (["group_size=2147483648"], "config key 'group_size' must be in [2, 4096]"),
        (["model.max_seq_len=2147483648"], "config key model.max_seq_len must be <= 4194304"),
        (["loss.kl_coeff=-1.0"], "config key 'loss' (torchtune_grpo.algorithm.loss.GRPOLoss): "
                                 "kl_coeff must be finite and >= 0.0"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    cfg = load_config("grpo/quickstart_cpu", overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)


def test_global_batch_must_divide_across_ranks():
    cfg = load_config("grpo/quickstart_cpu", ["global_batch_size=9"])
    validate_config(cfg, world_size=1)
    with pytest.raises(ConfigError, match="does not divide across 2 ranks"):
        validate_config(cfg, world_size=2)


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_real_configs_instantiate_what_needs_no_download(name, tmp_path):
    """The model comes from the folder's config.json: a folder holding it alone is enough."""
    folder = config_json_alone(load_config(name), tmp_path)
    check_instantiates_offline(load_config(name, [f"model_dir={folder}"]), min_params=2.5e9)


def test_every_shipped_config_validates():
    from torchtune_grpo.config.schema import EVAL_KEYS

    for name in list_shipped_configs():
        if "eval" in name:
            validate_config(load_config(name, ["checkpoint_dir=/x"]), schema=EVAL_KEYS)
        elif "async" in name:
            validate_async_config(load_config(name), world_size=3)
        else:
            validate_config(load_config(name))


def test_inherit_merges_over_the_base(tmp_path):
    cfg = load_config("grpo/quickstart_cpu_dr_grpo")
    base = load_config("grpo/quickstart_cpu")
    assert cfg.loss.aggregation == "constant" and cfg.advantages.scale == "none"
    assert cfg.model == base.model and cfg.group_size == base.group_size
    assert cfg.loss.max_generated_tokens == base.max_generated_tokens
    child = tmp_path / "child.yaml"
    child.write_text("inherit: grpo/quickstart_cpu\noptimizer:\n  _component_: torch.optim.SGD\n"
                     "  lr: 0.1\n")
    cfg = load_config(str(child), ["group_size=4"])
    assert dict(cfg.optimizer) == {"_component_": "torch.optim.SGD", "lr": 0.1}
    assert cfg.group_size == 4
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"inherit: {loop}\n")
    with pytest.raises(ValueError, match="circular"):
        load_config(str(loop))


def test_activation_offloading_needs_cuda_and_checkpointing():
    cfg = load_config("grpo/quickstart_cpu", ["enable_activation_offloading=true"])
    with pytest.raises(ConfigError, match="enable_activation_offloading"):
        validate_config(cfg)
    cfg = load_config("grpo/qwen2_5_3B_full", ["enable_activation_offloading=true"])
    validate_config(cfg)


def test_eval_configs_check_sampling():
    from torchtune_grpo.config.schema import EVAL_KEYS

    with pytest.raises(ConfigError, match="num_samples=2"):
        validate_config(load_config("grpo/eval_quickstart", [
            "checkpoint_dir=/x", "num_samples=2", "temperature=1.0", "k=[4]"]), schema=EVAL_KEYS)
    with pytest.raises(ConfigError, match="needs 'temperature' > 0"):
        validate_config(load_config("grpo/eval_quickstart", [
            "checkpoint_dir=/x", "num_samples=4"]), schema=EVAL_KEYS)


def test_bf16_updates_are_not_lost():
    """The shipped bf16 optimizer moves weights by ~lr; plain AdamW leaves them unchanged."""
    cfg = load_config("grpo/qwen2_5_3B_full")
    # stochastic rounding draws from the global generator: seeded, so that the tests run before
    # this one do not decide it; 16384 weights make the mean's spread ~7% (about 210 roundings)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.ones(16384, dtype=torch.bfloat16)) for _ in range(2)]
    shipped = tt_config.instantiate(cfg.optimizer, params[:1])
    plain = torch.optim.AdamW(params[1:], lr=cfg.optimizer.lr, weight_decay=0.0)
    for _ in range(50):
        for p in params:
            p.grad = torch.ones_like(p)
        shipped.step()
        plain.step()
    assert torch.equal(params[1], torch.ones_like(params[1]))  # every update rounded away
    moved = (1 - params[0].float()).mean().item()
    assert moved == pytest.approx(50 * cfg.optimizer.lr, rel=0.3)


# ---------------------------------------------------------------------------- nested blocks
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["advantages.scael=none"],
         "unknown config key 'advantages.scael' (known: estimator, scale, eps). Did you mean "
         "'advantages.scale'?"),
        (["advantages.scale=groups"], "config key 'advantages': scale must be one of"),
        (["advantages.eps=-1"], "eps must be >= 0"),
        (["advantages.estimator=ppo"], "estimator must be one of ['grpo', 'rloo', 'reinforce_pp']"),
        (["advantages.estimator=rloo", "advantages.scale=group"],
         "scale='group' applies to estimator grpo only"),
        (["eval.tempreature=0.7"], "Did you mean 'eval.temperature'?"),
        (["eval.num_samples=4"], "num_samples > 1 needs 'temperature' > 0"),
        (["eval.seed=3"], "unknown config key 'eval.seed'"),
    ],
)
def test_nested_blocks_are_checked_like_the_top_level(overrides, message):
    """A typo under ``advantages:`` or ``eval:`` is an error naming the key, not a silent
    default (``advantages.scael=none`` used to leave group-scaled GRPO in place)."""
    cfg = load_config("grpo/quickstart_cpu", overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)


def test_nested_blocks_read_into_settings_with_defaults_in_one_place():
    from torchtune_grpo.config.schema import RECIPE_KEYS, with_defaults
    from torchtune_grpo.config.settings import AdvantageSettings, settings_from_config
    from torchtune_grpo.evaluation.settings import EvalSettings

    cfg = load_config("grpo/quickstart_cpu", ["advantages.scale=none"])
    validate_config(cfg)
    adv = settings_from_config(AdvantageSettings, cfg.advantages, "advantages")
    assert adv == AdvantageSettings(scale="none", eps=AdvantageSettings.eps)
    ev = settings_from_config(EvalSettings, {"max_generated_tokens": None, "num_samples": 2,
                                             "temperature": 1.0},
                              "eval", fallbacks={"max_generated_tokens": 7}, fixed={"seed": 5})
    assert (ev.max_generated_tokens, ev.num_samples, ev.seed) == (7, 2, 5)
    filled = with_defaults(load_config("grpo/quickstart_cpu", ["~ppo_epochs"]))
    assert filled.ppo_epochs == RECIPE_KEYS["ppo_epochs"].default
    assert set(RECIPE_KEYS) <= set(filled)


# ---------------------------------------------------------------------------- tools
CALCULATOR = {"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator"}


def _tools_override(*entries) -> str:
    import json

    return "tools=" + json.dumps(list(entries))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([_tools_override(CALCULATOR, {"max_digits": 3})],
         "config key 'tools[1]'._component_ is missing"),
        ([_tools_override({**CALCULATOR, "max_digits": 0})],
         "config key 'tools[0]'._component_='torchtune_grpo.rollout.tools.calculator.Calculator' "
         "could not be built: ValueError: Calculator max_digits must be a positive number"),
        ([_tools_override({"_component_": "torchtune_grpo.rollout.tools.calculator.Calculatr"})],
         "tools[0]._component_: module 'torchtune_grpo.rollout.tools.calculator' has no "
         "'Calculatr'"),
        ([_tools_override(CALCULATOR, CALCULATOR)], "config key 'tools[1]'.name='calculator'"),
        (['tools={"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator"}'],
         "config key 'tools' must be list|null"),
        ([_tools_override(CALCULATOR), 'tool_syntax={"call_opn": "["}'],
         "Did you mean 'tool_syntax.call_open'?"),
        ([_tools_override(CALCULATOR), 'tool_syntax={"call_close": ""}'],
         "call_close must not be empty"),
        (["max_tool_calls=-1"], "config key 'max_tool_calls' must be >= 0"),
    ],
)
def test_bad_tools_fail_validation_naming_the_entry(overrides, message):
    """``tools:`` entries are built at validation (``build_tools``): a bad one fails before
    any model loads, naming ``tools[i]`` and the key at fault."""
    cfg = load_config("grpo/quickstart_cpu", overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)
    assert str(info.value).count("\n  - ") == 1  # one problem, said once


def test_tools_validate_and_default():
    from torchtune_grpo.config.schema import EVAL_KEYS, RECIPE_KEYS, with_defaults

    cfg = load_config("grpo/quickstart_cpu", [
        _tools_override({**CALCULATOR, "name": "calc"}), "max_tool_calls=2",
        'tool_syntax={"call_open": "[{name}:", "call_close": "]"}'])
    validate_config(cfg)
    filled = with_defaults(load_config("grpo/quickstart_cpu"))
    assert filled.tools is None and filled.tool_syntax is None
    assert filled.max_tool_calls == RECIPE_KEYS["max_tool_calls"].default == 4
    assert {"tools", "max_tool_calls", "tool_syntax"} <= set(EVAL_KEYS)


@pytest.mark.parametrize("generator", [
    "torchtune_grpo.rollout.vllm_engine.VLLMGenerator",
    "tests.unit.config.test_config.MyVLLM",  # a subclass is vLLM too
])
def test_tools_with_the_vllm_generator_are_rejected(generator):
    """vLLM runs no tool turns (yet): ``tools:`` with it is a config error (no vLLM needed)."""
    cfg = load_config("grpo/quickstart_cpu", [
        _tools_override(CALCULATOR), f"generator._component_={generator}"])
    with pytest.raises(ConfigError, match="config key 'tools' is not supported with "
                                          f"generator {generator}"):
        validate_config(cfg)
    del cfg.tools  # without tools the same generator validates
    validate_config(cfg)


def _my_vllm():
    from torchtune_grpo.rollout.vllm_engine import VLLMGenerator

    class MyVLLM(VLLMGenerator):
        """A user's subclass of the vLLM engine."""

    return MyVLLM


MyVLLM = _my_vllm()


def test_list_entry_and_null_node_overrides():
    """``rewards.0.weight=...`` sets one list entry and ``eval_dataset=null`` the whole node
    (torchtune's parser alone fails on the first and sets ``eval_dataset._component_`` on the
    second); ordinary overrides still go through torchtune's parser."""
    from torchtune_grpo.config.loading import load_config

    cfg = load_config("grpo/smollm2_gsm8k_cpu", [
        "rewards.1.weight=0.5", "rewards.0.fallback=none", "eval_dataset=null",
        "batch_size=3", "tokenizer=torchtune_grpo.models.hf_tokenizer"])
    assert cfg.rewards[1].weight == 0.5 and cfg.rewards[0].fallback == "none"
    assert cfg.eval_dataset is None and cfg.batch_size == 3
    assert cfg.tokenizer._component_ == "torchtune_grpo.models.hf_tokenizer"
    validate_config(cfg)
    with pytest.raises(ValueError, match=r"rewards is a list of 2 entries; '5' is not an index"):
        load_config("grpo/smollm2_gsm8k_cpu", ["rewards.5.weight=1"])


@pytest.mark.parametrize("override, message", [
    ("optimizer.lr=-1e-3", "'optimizer.lr' must be a finite number >= 0"),
    ("optimizer.weight_decay=-0.1", "'optimizer.weight_decay' must be a finite number >= 0"),
    ("optimizer.betas=[0.9,1.5]", "'optimizer.betas' must be two numbers in [0, 1)"),
    ("optimizer.eps=0", "'optimizer.eps' must be > 0"),
    # found by the slow-tier config fuzz: a mapping reached torch.optim as a TypeError
    ("optimizer.lr={bogus: 1}", "'optimizer.lr' must be a number, got dict"),
    ("optimizer.weight_decay=[0.1]", "'optimizer.weight_decay' must be a number, got list"),
])
def test_optimizer_values_out_of_range_are_rejected(override, message):
    from torchtune_grpo.config.loading import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(load_config("grpo/quickstart_cpu", [override]))
    validate_config(load_config("grpo/quickstart_cpu", ["optimizer.lr=0.0"]))  # a control run


def test_a_moved_component_path_names_its_new_home():
    """A config copied from an earlier release (``training.checkpointing.hf_checkpointer``)
    stops before anything loads, naming the path to write instead."""
    cfg = load_config("grpo/smollm2_arithmetic_cpu", [
        "checkpointer._component_=torchtune_grpo.training.checkpointing.hf_checkpointer"])
    with pytest.raises(ConfigError, match=r"checkpointer\._component_: 'torchtune_grpo\.training"
                                          r"\.checkpointing\.hf_checkpointer' is now "
                                          r"'torchtune_grpo\.models\.hf_checkpointer'"):
        validate_config(cfg, world_size=1)


def test_packed_forward_with_compile_is_an_error_naming_both_keys():
    """Neither key silently overrides the other: the pair set by the user is refused, each alone
    is fine, and unset ``packed_forward`` means packed unless compiled."""
    from torchtune_grpo.config.schema import with_defaults
    from torchtune_grpo.training.parts import packed_forward

    with pytest.raises(ConfigError) as info:
        validate_config(load_config("grpo/quickstart_cpu",
                                    ["compile=true", "packed_forward=true"]))
    assert "'packed_forward'" in str(info.value) and "'compile'" in str(info.value)
    for overrides, packed in [([], True), (["compile=true"], False),
                              (["compile=true", "packed_forward=false"], False),
                              (["packed_forward=true"], True), (["packed_forward=false"], False)]:
        cfg = load_config("grpo/quickstart_cpu", overrides)
        validate_config(cfg)
        assert packed_forward(with_defaults(cfg)) is packed, overrides


def test_the_conflict_stops_the_recipe_in_one_line_before_anything_loads(
        tmp_path, capsys, monkeypatch):
    import sys

    import grpo_full_finetune_single_device as entry

    monkeypatch.setattr(sys, "argv", ["recipe", "--config", "grpo/quickstart_cpu",
                                      f"model_dir={tmp_path / 'no_model'}",
                                      f"output_dir={tmp_path / 'out'}", "compile=true",
                                      "packed_forward=true"])
    with pytest.raises(SystemExit) as raised:
        entry.recipe_main()
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("error: ")]
    assert raised.value.code == 2
    assert len(errors) == 1 and "'packed_forward' and 'compile'" in errors[0], errors
    assert not (tmp_path / "out").exists()
