"""Qwen3 (dense), what is Qwen3's own: the norm-order guard, the CPU decode fallback, sharded
bf16 folders, config refusals, vLLM names, the shipped config. The parity every family shares
(logits, greedy decoding, save/reload, LoRA) is
``tests/unit/models/families/test_family_parity.py``, on the
Qwen3 cases of :mod:`tests.unit.models.families._family_zoo`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402

from tests.unit.models.families._family_zoo import CASES, SMALL, write_model  # noqa: E402
from tests.unit.models.families.test_family_parity import hf_logits, left_padded  # noqa: E402
from tests.unit.models.families.test_family_parity import ours as built  # noqa: E402
from torchtune_grpo.backends.cpu_decode import _fusable, packed_linear_weights  # noqa: E402
from torchtune_grpo.models import (  # noqa: E402
    hf_architecture,
    hf_checkpointer,  # noqa: E402
    hf_model,
    hf_model_type,
)
from torchtune_grpo.policy.positions import attention_mask, position_ids  # noqa: E402

V = SMALL["vocab_size"]


FAMILY = [case for case in CASES if case.architecture.lower().startswith("qwen3")]


@pytest.fixture(scope="module", params=FAMILY, ids=[case.name for case in FAMILY])
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per qwen3 case of the family zoo."""
    path = tmp_path_factory.mktemp("qwen3") / request.param.name
    return path, write_model(path, request.param), request.param


def _break_norm_order(model) -> None:
    """torchtune 0.6.1's order: q/k norms after RoPE (MultiHeadAttention's q_norm/k_norm)."""
    for layer in model.layers:
        attn = layer.attn
        attn.q_norm, attn.k_norm = attn.q_proj.norm, attn.k_proj.norm
        attn.q_proj, attn.k_proj = attn.q_proj.proj, attn.k_proj.proj


# ------------------------------------------------------------------------- (a) logits
def test_norm_after_rope_is_caught(folder, tmp_path):
    """The parity test above discriminates: the torchtune order moves logits by far more."""
    path, ref, _ = folder
    model, _ = built(path, tmp_path)
    _break_norm_order(model)
    tokens, mask = left_padded([0, 5, 17], 40)
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    assert (got - hf_logits(ref, tokens, mask)).abs()[mask].max() > 0.1


# ------------------------------------------------------------------------- (b) greedy decoding
def test_cpu_decode_fuses_qwen3_layers(folder, tmp_path):
    """The fused CPU decode layer covers the q/k head norms (run after the stacked q|k|v
    product): every Qwen3 layer decodes as one function, its linears inside the stacked
    weights; a layer with a LoRA query projection keeps its own forward."""
    path, _, _ = folder
    model, _ = built(path, tmp_path)
    assert all(_fusable(layer, set()) for layer in model.layers)
    with packed_linear_weights(model) as count:
        assert count == 7 * len(model.layers) + 1  # q, k, v, o, gate, up, down + output
        assert all("forward" in layer.__dict__ for layer in model.layers)
        assert "forward" not in model.layers[0].attn.q_proj.proj.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    adapters = {id(model.layers[0].attn.q_proj.proj)}  # as packed_linear_weights sees LoRA
    assert not _fusable(model.layers[0], adapters) and _fusable(model.layers[1], adapters)


# ------------------------------------------------------------------------- save / reload
def test_sharded_bf16_folder_round_trip(folder, tmp_path):
    """A folder in several safetensors shards loads; saving writes as many shards (an index
    naming every tensor) in the weights' dtype, and transformers loads it."""
    from safetensors import safe_open

    path, ref, _ = folder
    sharded = tmp_path / "sharded"
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)  # the fixture's model stays float32
    ref_bf16.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    ckpt = hf_checkpointer(str(sharded), output_dir=str(tmp_path / "ckpt_out"))
    state = ckpt.load_checkpoint()[training.MODEL_KEY]
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    with training.set_default_dtype(torch.bfloat16):
        hf_model(str(sharded)).load_state_dict(state)  # every name and shape fits the model
    ckpt.save_checkpoint({training.MODEL_KEY: state}, epoch=2)
    out = tmp_path / "ckpt_out" / "epoch_2"
    written = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(written) == len(shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(written)
    for name in written:
        with safe_open(str(out / name), "pt") as f:
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
            assert all(index[k] == name for k in f.keys())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert loaded.dtype == torch.bfloat16
    for key, value in loaded.state_dict().items():  # a tied lm_head is the embedding
        assert value.equal(ref_bf16.state_dict()[key]), key


# ------------------------------------------------------------------------- (d) LoRA
# ------------------------------------------------------------------------- config guards
def _config(**change):
    cfg = FAMILY[0].hf_config().to_dict()
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, _, case = folder
    assert hf_model_type(path) == "QWEN3"
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    assert arch.family == "qwen3" and arch.builder_kwargs["head_dim"] == case.config["head_dim"]
    assert arch.builder_kwargs["tie_word_embeddings"] == case.tied


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_scaling type 'linear'"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "layer_types holds 'sliding_attention'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "out of scope"),
    ({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl"},
     "out of scope"),
])
def test_unsupported_fields_stop_with_one_line(change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf_architecture(_config(**change), where="m/config.json")
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/config.json: ")
    if message == "out of scope":
        assert "Qwen3ForCausalLM" in text and "LlamaForCausalLM" in text


def test_unsupported_field_stops_before_weights(tmp_path):
    """hf_model and the checkpointer refuse from config.json alone (no weight file needed)."""
    (tmp_path / "config.json").write_text(json.dumps(_config(use_sliding_window=True)))
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_model(str(tmp_path))
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_model_type(tmp_path)


def test_moe_weights_are_refused_by_name(tmp_path):
    from torchtune_grpo.models.families.qwen3 import QWEN3_NAMES

    with pytest.raises(ValueError, match="mlp.experts.0.up_proj.weight"):
        QWEN3_NAMES.hf_to_tune({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(1)},
                         tie_word_embeddings=False)


def test_vllm_weight_names(folder, tmp_path):
    """The vLLM engine's weight sync names every Qwen3 tensor as the HF folder does."""
    from safetensors.torch import load_file

    from torchtune_grpo.rollout.vllm_engine import hf_weight_items, torchtune_to_hf_converter

    path, _, _ = folder
    model, ckpt = built(path, tmp_path)
    convert = torchtune_to_hf_converter(ckpt._model_type.name, ckpt._config)
    ours = dict(hf_weight_items(model, convert))
    theirs = load_file(str(path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in theirs)


# ------------------------------------------------------------------------- the shipped config
#: Qwen3-0.6B's config.json dimensions (the model the shipped config names; no download here).
QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=128,
    hidden_act="silu", hidden_size=1024, intermediate_size=3072, max_position_embeddings=40960,
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-6,
    rope_scaling=None, rope_theta=1_000_000, sliding_window=None, use_sliding_window=False,
    tie_word_embeddings=True, vocab_size=151936, torch_dtype="bfloat16")
CONFIG = Path(__file__).resolve().parents[4] / "configs/grpo/qwen3_0_6B_full_single_device.yaml"


def test_shipped_config_validates_and_fits_its_gpu(tmp_path):
    from tests.conftest import check_instantiates_offline
    from torchtune_grpo.cli.memory_estimate import GIB, estimate_memory, model_dims
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import validate_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    cfg = load_config(str(CONFIG), [f"model_dir={tmp_path}"])
    validate_config(cfg)
    check_instantiates_offline(cfg, min_params=5e8)
    dims = model_dims(cfg.model)
    assert (dims.head_dim, dims.num_heads, dims.embed_dim) == (128, 16, 1024)
    assert cfg.tokenizer.enable_thinking is True
    assert cfg.rewards[0].think_tag == "think"
    header = CONFIG.read_text().split("\n\n")[0]
    assert "Hardware: 1 x 24 GB" in header
    estimate = estimate_memory(cfg, 1, name="qwen3_0_6B")
    assert estimate.peak_bytes < 0.75 * 24 * GIB, estimate.table()


#: Qwen3-4B's config.json dimensions (no download here).
QWEN3_4B = {**QWEN3_0_6B, "hidden_size": 2560, "intermediate_size": 9728,
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8}


def test_shipped_4b_config_validates_and_fits_eight_gpus(tmp_path):
    """``grpo/qwen3_4B_full``: validates, builds a 4.0B model offline, and its estimate fits an
    80 GB GPU per rank on 8 ranks, with headroom (at most 70 GiB)."""
    from tests.conftest import check_instantiates_offline
    from torchtune_grpo.cli.memory_estimate import GIB, estimate_memory, model_dims
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import validate_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    cfg = load_config("grpo/qwen3_4B_full", [f"model_dir={tmp_path}"])
    validate_config(cfg)
    check_instantiates_offline(cfg, min_params=3.9e9)
    assert model_dims(cfg.model).num_layers == 36
    estimate = estimate_memory(cfg, 8, name="qwen3_4B_full")
    assert estimate.peak_bytes < 70 * GIB, estimate.table()
