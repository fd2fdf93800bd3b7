"""Gemma 3 (text) against ``transformers``: logits, greedy decoding, save/reload, LoRA, configs.

Every case writes a tiny random ``Gemma3ForCausalLM`` with ``save_pretrained``
(:mod:`tests.unit._gemma3_models`: wide weights, every norm weight off 0, ``sliding_window`` 8
shorter than the sequences, ``query_pre_attn_scalar`` != ``head_dim``) and builds ours from the
folder with :func:`hf_model` and :func:`hf_checkpointer` (model type derived from config.json).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt  # noqa: E402

from tests.unit._gemma3_models import CASES, SMALL, gemma3_config, write_gemma3  # noqa: E402
from torchtune_grpo.algorithm.trajectory import attention_mask, position_ids  # noqa: E402
from torchtune_grpo.models import hf_architecture, hf_model, hf_model_type, lora_hf_model  # noqa: E402
from torchtune_grpo.rollout.native import generate_trajectory  # noqa: E402
from torchtune_grpo.training.checkpointing import hf_checkpointer  # noqa: E402

V = SMALL["vocab_size"]


@pytest.fixture(scope="module", params=sorted(CASES))
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per case of :data:`CASES`."""
    path = tmp_path_factory.mktemp("gemma3") / request.param
    return path, write_gemma3(path, request.param), request.param


def _ours(path, tmp_path, **kwargs):
    model = hf_model(str(path), **kwargs)
    ckpt = hf_checkpointer(str(path), output_dir=str(tmp_path / "ckpt_out"))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval(), ckpt


def _left_padded(starts: list[int], length: int, seed: int = 1):
    """``tokens [n, length]`` with row ``i`` padded (id 0) before ``starts[i]``, its mask."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (len(starts), length), generator=generator)
    mask = torch.arange(length)[None] >= torch.tensor(starts)[:, None]
    return tokens.masked_fill(~mask, 0), mask


def _hf_logits(ref, tokens, mask):
    with torch.no_grad():
        return ref(tokens, attention_mask=mask.long(), position_ids=position_ids(mask)).logits


def _logit_diff(model, ref, tokens, mask) -> float:
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    return (got - _hf_logits(ref, tokens, mask)).abs()[mask].max().item()


# ------------------------------------------------------------------------- (a) logits
def test_logits_match_transformers_left_padded(folder, tmp_path):
    """Rows of 40, 35 and 23 real tokens: every one longer than the sliding window (8)."""
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


def test_no_mask_forward_matches(folder, tmp_path):
    """Without a mask (plain causal), the sliding layers build their own windowed mask."""
    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, mask = _left_padded([0, 0], 30, seed=3)
    with torch.no_grad():
        got = model(tokens)
        want = ref(tokens).logits
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("breakage", ["norm_without_one", "swap_ff_norms", "head_dim_scale",
                                      "no_window", "no_embed_scale", "one_rope_base"])
def test_broken_variants_are_caught(folder, tmp_path, breakage):
    """The parity check discriminates each guard: breaking one moves logits by far more."""
    from torchtune_grpo.models.families import layers as gl

    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, mask = _left_padded([0, 5, 17], 40)
    assert _logit_diff(model, ref, tokens, mask) <= 1e-4
    if breakage == "norm_without_one":
        for module in model.modules():
            if isinstance(module, gl.GemmaRMSNorm):
                module.scale.data += 1.0  # pretend it were x * w: off by the missing 1
    elif breakage == "swap_ff_norms":
        for layer in model.layers:
            layer.mlp_norm, layer.mlp_scale = layer.mlp_scale, layer.mlp_norm
    elif breakage == "head_dim_scale":
        for layer in model.layers:
            layer.attn.q_proj.factor = 1.0
    elif breakage == "no_window":
        for layer in model.layers:
            if isinstance(layer, gl.SlidingWindowLayer):
                layer.window = 10_000
    elif breakage == "no_embed_scale":
        model.tok_embeddings.scale = 1.0
    else:
        for layer in model.layers:
            layer.attn.pos_embeddings = model.layers[1].attn.pos_embeddings
    assert _logit_diff(model, ref, tokens, mask) > 0.05


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
        assert len(ours_ids) >= 16, row  # well past the window of 8
        assert ours_ids == hf_ids[: len(ours_ids)], row
        assert len(ours_ids) == len(hf_ids) or ours_ids[-1] == eos and hf_ids[-1] == eos, row


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_static_decode_matches_transformers(folder, tmp_path):
    """The compiled static decode (mask over the whole buffer, ``torch.compile``): the window
    is computed inside the graph, tokens still equal ``transformers.generate``."""
    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, mask = _left_padded([0, 3, 9], 12, seed=2)
    eos, new = V - 1, 24
    traj = generate_trajectory(
        model, tokens, mask, group_size=1, forward_batch_size=3, max_generated_tokens=new,
        temperature=0.0, top_k=None, stop_tokens=torch.tensor([eos]), pad_id=0,
        compile_decode=True, packed_weights=False)
    with torch.no_grad():
        out = ref.generate(tokens, attention_mask=mask.long(), max_new_tokens=new,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    for ours_row, hf_row in zip(traj.response_tokens.tolist(), out[:, 12:].tolist()):
        n = min(len(ours_row), len(hf_row))
        assert n >= 16 and ours_row[:n] == hf_row[:n]


def test_packed_training_forward_matches_padded(folder, tmp_path):
    """Training log-probs with rows packed end to end (segments longer than the window) equal
    the padded rectangle's."""
    from torchtune_grpo.policy.forward import micro_batch_logprobs

    path, _, _ = folder
    model, _ = _ours(path, tmp_path)
    tokens, prompt_mask = _left_padded([0, 4, 7], 14, seed=4)
    response = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(5))
    response_mask = torch.arange(6)[None] < torch.tensor([6, 3, 5])[:, None]
    full = torch.cat([tokens, response], dim=1)
    with torch.no_grad():
        padded, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, trim=False)
        packed, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, pack=True)
    assert padded[response_mask].abs().max() > 1.0
    torch.testing.assert_close(packed[response_mask], padded[response_mask], atol=1e-5,
                               rtol=1e-5)


# ------------------------------------------------------------------------- (c) save / reload
def test_save_reload_in_transformers(folder, tmp_path):
    path, ref, case = folder
    model, ckpt = _ours(path, tmp_path)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(0.01 * torch.randn_like(param))
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=1)
    out = tmp_path / "ckpt_out" / "epoch_1"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.pre_feedforward_layernorm.weight" in index
    assert ("lm_head.weight" in index) == (not CASES[case]["tie_word_embeddings"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    tokens, mask = _left_padded([0, 6], 30)
    diff = _logit_diff(model, loaded.eval(), tokens, mask)
    print(f"{case}: save/reload max |logit diff| = {diff:.3g}")
    assert diff <= 1e-5
    again, _ = _ours(out, tmp_path / "again")
    for key, value in again.state_dict().items():
        assert value.equal(model.state_dict()[key]), key


# ------------------------------------------------------------------------- (d) LoRA
def test_lora_merged_save_loads_in_transformers(folder, tmp_path):
    path, ref, _ = folder
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
    with torch.no_grad():
        base = lora(tokens, **run)
        assert (base - _hf_logits(ref, tokens, mask)).abs()[mask].max() <= 1e-4
        for name, param in lora.named_parameters():
            if "lora_b" in name:
                param.normal_(0, 0.2)
        adapted = lora(tokens, **run)
    assert (adapted - base).abs()[mask].max() > 0.1
    state = {k: v.clone() for k, v in lora.state_dict().items()}
    adapter = get_adapter_state_dict(state)
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
    from safetensors.torch import load_file

    names = {n for n, _ in merged.named_modules()}
    peft = load_file(str(out / "adapter_model.safetensors"))
    assert len(peft) == len(adapter)
    for key in peft:
        assert key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] in names, key


# ------------------------------------------------------------------------- config guards
def _config(**change):
    cfg = gemma3_config("tied_gqa_pattern").to_dict()
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, ref, case = folder
    assert hf_model_type(path) == "GEMMA3"
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    kw = arch.builder_kwargs
    assert arch.family == "gemma3" and kw["head_dim"] == CASES[case]["head_dim"]
    assert kw["layer_types"] == list(ref.config.layer_types)
    assert kw["sliding_window"] == 8 and kw["local_rope_base"] == 10_000.0


def test_sliding_window_pattern_without_layer_types():
    cfg = _config(sliding_window_pattern=3)
    cfg.pop("layer_types")
    kw = hf_architecture(cfg).builder_kwargs
    assert kw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"]


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6,
                                             "factor": 2.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_type 'yarn'"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "out of scope"),
])
def test_unsupported_fields_stop_with_one_line(change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf_architecture(_config(**change), where="m/config.json")
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/config.json: ")


def test_vllm_weight_names(folder, tmp_path):
    """The vLLM engine's weight sync names every Gemma 3 tensor as the HF folder does."""
    from safetensors.torch import load_file

    from torchtune_grpo.rollout.vllm_engine import hf_weight_items, torchtune_to_hf_converter

    path, _, _ = folder
    model, ckpt = _ours(path, tmp_path)
    convert = torchtune_to_hf_converter(ckpt._model_type.name, ckpt._config)
    ours = dict(hf_weight_items(model, convert))
    theirs = load_file(str(path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in theirs)


def test_cpu_decode_falls_back_to_plain_layers(folder, tmp_path):
    """The fused CPU decode layer has no step for Gemma's norms: Gemma layers keep their own
    forward (the window included), their inner linears decode on packed weights."""
    from torchtune_grpo.backends.cpu_decode import _fusable, packed_linear_weights

    path, _, _ = folder
    model, _ = _ours(path, tmp_path)
    assert not any(_fusable(layer, set()) for layer in model.layers)
    with packed_linear_weights(model):
        assert all("forward" not in layer.__dict__ for layer in model.layers)


#: Gemma 3 1B's config.json dimensions (no download).
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=None,
    vocab_size=262144, max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None, attn_logit_softcapping=None, rms_norm_eps=1e-6,
    pad_token_id=0, eos_token_id=[1, 106], bos_token_id=2)


def test_gemma3_1b_config_builds(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    with torch.device("meta"):
        model = hf_model(str(tmp_path), max_seq_len=1024)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds.count("SlidingWindowLayer") == 22 and kinds[5] == "TransformerSelfAttentionLayer"
    params = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < params < 1.05e9, params  # 1.0B, tied


def test_bf16_embedding_and_norms_bitwise(folder, tmp_path):
    """In bf16 the scaled embedding (factor rounded to bf16) and the float32 Gemma norms give
    exactly transformers' values."""
    import copy

    path, ref, _ = folder
    model, _ = _ours(path, tmp_path)
    ours, theirs = model.to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    tokens, _ = _left_padded([0], 16)
    with torch.no_grad():
        emb = ours.tok_embeddings(tokens)
        assert emb.dtype == torch.bfloat16
        assert emb.equal(theirs.model.embed_tokens(tokens))
        x = torch.randn(2, 5, SMALL["hidden_size"], dtype=torch.bfloat16)
        pairs = [(ours.layers[0].sa_norm, theirs.model.layers[0].input_layernorm),
                 (ours.layers[0].sa_scale, theirs.model.layers[0].post_attention_layernorm),
                 (ours.layers[0].mlp_norm, theirs.model.layers[0].pre_feedforward_layernorm),
                 (ours.layers[0].mlp_scale, theirs.model.layers[0].post_feedforward_layernorm),
                 (ours.norm, theirs.model.norm)]
        for mine, hf in pairs:
            assert mine(x).equal(hf(x))
