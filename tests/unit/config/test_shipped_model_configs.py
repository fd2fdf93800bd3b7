"""Every shipped config reads its model from a Hugging Face folder (``hf_model``,
``hf_tokenizer``, ``hf_checkpointer``): it builds offline from a ``config.json`` alone, fits
the hardware its header names, and one evaluation config serves every family."""

from __future__ import annotations

import re

import pytest
import torch
from torchtune import config as tt_config

from tests.conftest import check_instantiates_offline, config_json_alone
from torchtune_grpo.cli.memory_estimate import GIB, estimate_memory, intended_world_size
from torchtune_grpo.config.loading import list_shipped_configs, load_config, resolve_config_path
from torchtune_grpo.config.schema import EVAL_KEYS
from torchtune_grpo.config.validation import validate_config

HF = "torchtune_grpo.models."
#: The quickstart builds a tiny model from the config's own numbers, with the tokenizer files
#: ``tune-grpo prepare-quickstart`` writes: no model folder to read.
QUICKSTART = {n for n in list_shipped_configs() if "quickstart" in n}
FOLDER_CONFIGS = sorted(set(list_shipped_configs()) - QUICKSTART)
TRAINING = [n for n in FOLDER_CONFIGS if "eval" not in n.rsplit("/", 1)[-1]]
#: Configs that named torchtune's builders of one size (RoPE for 32k or 128k positions) before
#: they read the folder: their RoPE cache covers any prompt the tokenizer lets through plus the
#: completion, so no prompt stops a run that the builders ran.
CONVERTED = {"grpo/llama3_2_3B_full", "grpo/phi4_mini_full", "grpo/eval_gsm8k",
             "grpo/eval_math500", *(n for n in FOLDER_CONFIGS if "qwen2_5" in n)}
#: Thinking keys: only for families whose chat template has the switch.
THINKING = {"grpo/qwen3_0_6B_full_single_device", "grpo/qwen3_4B_full",
            "grpo/smollm3_3B_full", "grpo/eval_qwen3_gsm8k"}


def _learned_rewards(cfg) -> bool:
    return any("model_dir" in entry for entry in cfg.get("rewards") or [])


@pytest.mark.parametrize("name", FOLDER_CONFIGS)
def test_shipped_configs_read_the_model_from_its_folder(name):
    """Nothing about the model is written in the config but the folder: no builder of one
    size, no tokenizer file names, no weight-file names or model type."""
    cfg = load_config(name, ["checkpoint_dir=/ckpt"] if "eval" in name else [])
    folder = cfg.get("model_dir", cfg.get("checkpoint_dir"))
    assert cfg.model._component_ in (HF + "hf_model", HF + "lora_hf_model"), name
    assert cfg.model.model_dir == folder
    assert cfg.tokenizer._component_ == HF + "hf_tokenizer" and cfg.tokenizer.path == folder
    assert cfg.checkpointer._component_ == HF + "hf_checkpointer"
    assert cfg.checkpointer.checkpoint_dir == folder
    assert not {"checkpoint_files", "model_type"} & set(cfg.checkpointer), name
    # the RoPE cache holds what the tokenizer lets through; thinking keys only where the family
    # has the switch
    assert cfg.model.max_seq_len >= cfg.tokenizer.max_seq_len, name
    if name in CONVERTED:
        need = cfg.tokenizer.max_seq_len + cfg.max_generated_tokens
        assert cfg.model.max_seq_len >= need, (name, cfg.model.max_seq_len, need)
    thinking = "enable_thinking" in cfg.tokenizer
    assert thinking == (name in THINKING), name
    think_tags = [r.get("think_tag") for r in cfg.rewards if r.get("think_tag")]
    assert bool(think_tags) == thinking, name


@pytest.mark.parametrize("name", TRAINING)
def test_every_shipped_training_config_builds_from_a_config_json_alone(name, tmp_path):
    """Validated as shipped, then built on the meta device from the released config.json of
    the model its header downloads (no weights, no tokenizer): model, loss, rewards,
    optimizer and schedule."""
    cfg = load_config(name)
    validate_config(cfg, world_size=intended_world_size(name))
    if _learned_rewards(cfg):
        pytest.skip("its reward model folder is built in tests/unit/rewards/test_learned_rewards")
    if any("math_grading" in str(r.get("_component_")) for r in cfg.rewards):
        pytest.importorskip("math_verify")
    folder = config_json_alone(cfg, tmp_path)
    check_instantiates_offline(load_config(name, [f"model_dir={folder}"]), min_params=1e8)


# ---------------------------------------------------------------------------- sized to the card
#: Training configs for a GPU that state their estimate in the header (the examples that
#: ``inherit`` one of them state their reward model's share instead).
GPU_TRAINING = [n for n in TRAINING if load_config(n).device == "cuda"
                and not resolve_config_path(n).read_text().startswith("inherit")
                and "\ninherit:" not in resolve_config_path(n).read_text()]


@pytest.mark.parametrize("name", GPU_TRAINING)
def test_header_states_the_estimate_and_the_card_is_mostly_used(name):
    """The header's ``Memory:`` figure is what ``tune-grpo estimate-memory --config NAME``
    prints (to 0.1 GiB; a model not downloaded is sized from its known shape), and the
    8 x 80 GB configs use most of the card with headroom for fragmentation: 55-70 GiB."""
    header = resolve_config_path(name).read_text().split("\n\n")[0]
    match = re.search(r"# Memory: ([0-9.]+) GiB per rank", header)
    assert match, f"{name}: no '# Memory: X GiB per rank' line in the header"
    assert f"`tune-grpo estimate-memory --config {name}`" in header.replace("\n# ", " ")
    estimate = estimate_memory(load_config(name), intended_world_size(name), name=name)
    assert abs(float(match.group(1)) - estimate.peak_gib) <= 0.1, (
        f"{name}: header says {match.group(1)} GiB, the estimate is {estimate.peak_gib:.2f}")
    if "Hardware: one node of 8 x 80 GB" in header:
        assert intended_world_size(name) == 8
        assert 55 * GIB <= estimate.peak_bytes <= 70 * GIB, estimate.table()
        # the rollout decodes all of a rank's rows at once (rollout_batch_size null on CUDA)
        rows = estimate.settings["rows"]
        assert estimate.settings["generation_rows"] == rows >= 128, name


# ---------------------------------------------------------------------------- new families
@pytest.mark.parametrize("name, repo, layers, budget_share", [
    ("grpo/phi4_mini_full", "microsoft/Phi-4-mini-instruct", 32, 70 / 80),
    ("grpo/smollm3_3B_full", "HuggingFaceTB/SmolLM3-3B", 36, 70 / 80),
])
def test_phi4_mini_and_smollm3_configs(name, repo, layers, budget_share, tmp_path):
    """Header as the other 8-GPU configs (download, run, eval, hardware, memory), the model
    built from the family's config.json, and the estimate inside an 80 GB GPU with headroom."""
    text = resolve_config_path(name).read_text()
    header = text.split("\n\n")[0]
    assert f"tune download {repo} --output-dir" in header
    assert f"tune run --nproc_per_node 8 grpo_full_finetune_distributed --config {name}" in header
    assert "tune run grpo_eval --config grpo/eval_" in header
    assert "Hardware: one node of 8 x 80 GB GPUs" in header
    assert f"tune-grpo estimate-memory --config {name}" in header
    assert intended_world_size(name) == 8
    cfg = load_config(name)
    folder = config_json_alone(cfg, tmp_path)
    built = load_config(name, [f"model_dir={folder}"])
    with torch.device("meta"):
        model = tt_config.instantiate(built.model)
    assert len(model.layers) == layers
    estimate = estimate_memory(built, 8, name=name)
    assert estimate.peak_bytes < budget_share * 80 * GIB, estimate.table()
    # the eval config the header names serves the trained folder
    eval_name = re.search(r"grpo_eval --config (grpo/\S+)", header).group(1)
    evaluated = load_config(eval_name, [f"checkpoint_dir={folder}"])
    with torch.device("meta"):
        assert len(tt_config.instantiate(evaluated.model).layers) == layers
    assert ("enable_thinking" in evaluated.tokenizer) == ("enable_thinking" in cfg.tokenizer)


def test_phi4_mini_config_keeps_longrope_in_range():
    """LongRoPE is computed with its short factors only up to 4096 positions: a longer
    model.max_seq_len would stop the run (docs/models.md, Phi-3 and Phi-4)."""
    cfg = load_config("grpo/phi4_mini_full")
    assert cfg.model.max_seq_len <= 4096
    assert "enable_thinking" not in cfg.tokenizer  # Phi-4-mini's template has no such switch


# ---------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("eval_name", ["grpo/eval_gsm8k", "grpo/eval_math500"])
def test_one_eval_config_serves_every_family(eval_name, tmp_path):
    """A step folder of any family (its config.json, tokenizer and chat template) evaluates
    under the same config: the model from its config.json, the tokenizer from its files (a
    Qwen 2.5, a Llama 3 and a ChatML tokenizer folder, built as in test_hf_tokenizer)."""
    from tests.unit.models.test_hf_tokenizer import BUILDERS
    from torchtune_grpo.datasets._prompt import GSM8K_TEMPLATE, tokenize_prompt

    validate_config(load_config(eval_name, ["checkpoint_dir=/x"]), schema=EVAL_KEYS)
    families = {"qwen2_5": "Qwen2.5-3B-Instruct", "llama3": "Llama-3.2-3B-Instruct",
                "chatml": "SmolLM2-135M-Instruct", "phi": "Phi-4-mini-instruct",
                "gemma3": "gemma-3-1b-it", "smollm3": "SmolLM3-3B", "qwen3": "Qwen3-4B"}
    for style, folder_name in families.items():
        step = tmp_path / folder_name
        cfg = load_config(eval_name, [f"checkpoint_dir={step}"])
        config_json_alone(cfg, tmp_path)
        with torch.device("meta"):
            model = tt_config.instantiate(cfg.model)
        assert sum(p.numel() for p in model.parameters()) > 1e8, style
        if style in BUILDERS:
            BUILDERS[style](step)
            tok = tt_config.instantiate(cfg.tokenizer)
            ids = tokenize_prompt(tok, GSM8K_TEMPLATE, "What is 1 + 1?")
            text = tok.decode(ids, skip_special_tokens=False)
            assert "What is 1 + 1?" in text and text.endswith("<think>"), style
