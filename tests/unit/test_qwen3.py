"""Qwen3 (dense) against ``transformers``: logits, greedy decoding, save/reload, LoRA, configs.

Every case writes a tiny random ``Qwen3ForCausalLM`` with ``save_pretrained``
(:mod:`tests.unit._qwen3_models`: wide weights, every norm scale off 1) and builds ours from the
folder with :func:`hf_model` and :func:`hf_checkpointer` (model type derived from config.json).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt  # noqa: E402

from tests.unit._qwen3_models import CASES, SMALL, write_qwen3  # noqa: E402
from torchtune_grpo.algorithm.trajectory import attention_mask, position_ids  # noqa: E402
from torchtune_grpo.backends.cpu_decode import _fusable, packed_linear_weights  # noqa: E402
from torchtune_grpo.models import hf_architecture, hf_model, hf_model_type, lora_hf_model  # noqa: E402
from torchtune_grpo.rollout.native import generate_trajectory  # noqa: E402
from torchtune_grpo.training.checkpointing import hf_checkpointer  # noqa: E402

V = SMALL["vocab_size"]


@pytest.fixture(scope="module", params=sorted(CASES))
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per case of :data:`CASES`."""
    path = tmp_path_factory.mktemp("qwen3") / request.param
    return path, write_qwen3(path, request.param, tokenizer=False), request.param


def _ours(path, tmp_path, **kwargs):
    model = hf_model(str(path), **kwargs)
    ckpt = hf_checkpointer(str(path), output_dir=str(tmp_path / "ckpt_out"))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval(), ckpt


def _left_padded(starts: list[int], length: int, seed: int = 1):
    """``tokens [n, length]`` with row ``i`` padded (id 0) before ``starts[i]``, its mask."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (len(starts), length), generator=generator)
    mask = torch.arange(length)[None] >= torch.tensor(starts)[:, None]
    return tokens.masked_fill(~mask, 0), mask


def _hf_logits(ref, tokens, mask):
    with torch.no_grad():
        return ref(tokens, attention_mask=mask.long(), position_ids=position_ids(mask)).logits


def _break_norm_order(model) -> None:
    """torchtune 0.6.1's order: q/k norms after RoPE (MultiHeadAttention's q_norm/k_norm)."""
    for layer in model.layers:
        attn = layer.attn
        attn.q_norm, attn.k_norm = attn.q_proj.norm, attn.k_proj.norm
        attn.q_proj, attn.k_proj = attn.q_proj.proj, attn.k_proj.proj


# ------------------------------------------------------------------------- (a) logits
def test_logits_match_transformers_left_padded(folder, tmp_path):
    path, ref, case = folder
    model, _ = _ours(path, tmp_path)
    tokens, mask = _left_padded([0, 5, 17], 40)
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    want = _hf_logits(ref, tokens, mask)
    diff = (got - want).abs()[mask].max().item()
    print(f"{case}: max |logit diff| vs transformers = {diff:.3g}")
    assert want[mask].abs().max() > 3.0  # not degenerate
    assert diff <= 1e-4
    tied = CASES[case]["tie_word_embeddings"]
    assert ("output.weight" in dict(model.named_parameters())) == (not tied)
    assert model.layers[0].attn.q_proj.norm.scale.shape == (CASES[case]["head_dim"],)


def test_norm_after_rope_is_caught(folder, tmp_path):
    """The parity test above discriminates: the torchtune order moves logits by far more."""
    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    _break_norm_order(model)
    tokens, mask = _left_padded([0, 5, 17], 40)
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    assert (got - _hf_logits(ref, tokens, mask)).abs()[mask].max() > 0.1


# ------------------------------------------------------------------------- (b) greedy decoding
@pytest.mark.parametrize("packed", [True, False], ids=["packed_weights", "plain_linear"])
def test_greedy_generation_matches_transformers(folder, tmp_path, packed):
    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, mask = _left_padded([0, 3, 9], 12, seed=2)
    eos, new = V - 1, 64
    traj = generate_trajectory(
        model, tokens, mask, group_size=1, forward_batch_size=3, max_generated_tokens=new,
        temperature=0.0, top_k=None, stop_tokens=torch.tensor([eos]), pad_id=0,
        packed_weights=packed)
    with torch.no_grad():
        out = ref.generate(tokens, attention_mask=mask.long(), max_new_tokens=new,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    theirs = out[:, tokens.shape[1]:].tolist()
    for row, (ours_row, row_mask, hf_row) in enumerate(zip(
            traj.response_tokens.tolist(), traj.response_mask.tolist(), theirs)):
        ours_ids = [t for t, m in zip(ours_row, row_mask) if m]
        hf_ids = hf_row[: hf_row.index(eos) + 1] if eos in hf_row else hf_row
        assert len(ours_ids) >= 8, row
        assert ours_ids == hf_ids[: len(ours_ids)], row
        assert len(ours_ids) == len(hf_ids) or ours_ids[-1] == eos and hf_ids[-1] == eos, row


def test_cpu_decode_falls_back_to_plain_layers(folder, tmp_path):
    """The fused CPU decode layer does not cover the q/k head norms: Qwen3 layers keep their
    own forward, their inner linears decode on packed weights (the plain path)."""
    path, _, _ = folder
    model, _ = _ours(path, tmp_path)
    assert not any(_fusable(layer, set()) for layer in model.layers)
    with packed_linear_weights(model) as count:
        assert count == 7 * len(model.layers) + 1  # q, k, v, o, gate, up, down + output
        assert all("forward" not in layer.__dict__ for layer in model.layers)
        assert "forward" in model.layers[0].attn.q_proj.proj.__dict__


def test_packed_training_forward_matches_padded(folder, tmp_path):
    """Training-time log-probs with the rows packed end to end equal the padded rectangle's."""
    from torchtune_grpo.policy.forward import micro_batch_logprobs

    path, _, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, prompt_mask = _left_padded([0, 4, 7], 10, seed=4)
    response = torch.randint(1, V, (3, 6), generator=torch.Generator().manual_seed(5))
    response_mask = torch.arange(6)[None] < torch.tensor([6, 3, 5])[:, None]
    full = torch.cat([tokens, response], dim=1)
    with torch.no_grad():
        padded, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, trim=False)
        packed, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, pack=True)
    assert padded[response_mask].abs().max() > 1.0
    torch.testing.assert_close(packed[response_mask], padded[response_mask], atol=1e-5,
                               rtol=1e-5)


# ------------------------------------------------------------------------- save / reload
def test_save_reload_in_transformers(folder, tmp_path):
    path, ref, case = folder
    model, ckpt = _ours(path, tmp_path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.01 * torch.randn_like(param))
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=1)
    out = tmp_path / "ckpt_out" / "epoch_1"
    assert (out / "model-00001-of-00001.safetensors").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_norm.weight" in index
    assert ("lm_head.weight" in index) == (not CASES[case]["tie_word_embeddings"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokens, mask = _left_padded([0, 6], 30)
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    assert (got - _hf_logits(loaded.eval(), tokens, mask)).abs()[mask].max() <= 1e-5
    # and the reload through our checkpointer is bitwise the saved state
    again, _ = _ours(out, tmp_path / "again")
    for key, value in again.state_dict().items():
        assert value.equal(model.state_dict()[key]), key


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
def test_lora_merged_save_loads_in_transformers(folder, tmp_path):
    path, ref, case = folder
    kw = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
              apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8)
    lora = lora_hf_model(str(path), **kw)
    ckpt = hf_checkpointer(str(path), output_dir=str(tmp_path / "out"))
    missing = lora.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY],
                                   strict=False).missing_keys
    assert missing and all("lora" in k for k in missing)
    lora.eval()
    tokens, mask = _left_padded([0, 4], 24)
    run = dict(mask=attention_mask(mask), input_pos=position_ids(mask))
    with torch.no_grad():  # adapters start at zero: the base model's logits
        base = lora(tokens, **run)
        assert (base - _hf_logits(ref, tokens, mask)).abs()[mask].max() <= 1e-4
        for name, param in lora.named_parameters():
            if "lora_b" in name:
                param.normal_(0, 0.2)
        adapted = lora(tokens, **run)
    assert (adapted - base).abs()[mask].max() > 0.1
    state = {k: v.clone() for k, v in lora.state_dict().items()}
    adapter = get_adapter_state_dict(state)
    assert any("q_proj.proj.lora_a" in k for k in adapter)
    ckpt.save_checkpoint({
        training.MODEL_KEY: get_merged_lora_ckpt(state, rank=4, alpha=8),
        training.ADAPTER_KEY: adapter,
        training.ADAPTER_CONFIG: {"r": 4, "lora_alpha": 8, "peft_type": "LORA",
                                  "target_modules": ["q_proj", "k_proj", "v_proj",
                                                     "output_proj", "w1", "w2", "w3"]},
    }, epoch=1)
    out = tmp_path / "out" / "epoch_1"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert (adapted - _hf_logits(merged.eval(), tokens, mask)).abs()[mask].max() <= 1e-4
    # the PEFT adapter names the modules of the HF model
    from safetensors.torch import load_file

    names = {n for n, _ in merged.named_modules()}
    peft = load_file(str(out / "adapter_model.safetensors"))
    assert len(peft) == len(adapter)
    for key in peft:
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        assert module in names, key
    config = json.loads((out / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"}


# ------------------------------------------------------------------------- config guards
def _config(**change):
    cfg = transformers.Qwen3Config(**{**SMALL, **CASES["tied_gqa_head_dim_32"]}).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, _, case = folder
    assert hf_model_type(path) == "QWEN3"
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    assert arch.family == "qwen3" and arch.builder_kwargs["head_dim"] == CASES[case]["head_dim"]
    assert arch.builder_kwargs["tie_word_embeddings"] == CASES[case]["tie_word_embeddings"]


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
    model, ckpt = _ours(path, tmp_path)
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
CONFIG = Path(__file__).resolve().parents[2] / "configs/grpo/qwen3_0_6B_full_single_device.yaml"


def test_shipped_config_validates_and_fits_its_gpu(tmp_path):
    from tests.conftest import check_instantiates_offline
    from torchtune_grpo.training.config import load_config
    from torchtune_grpo.training.memory_estimate import GIB, estimate_memory, model_dims
    from torchtune_grpo.training.validation import validate_config

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
