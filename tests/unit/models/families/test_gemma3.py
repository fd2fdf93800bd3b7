"""Gemma 3 (text), what is Gemma 3's own: a broken variant of each guard (norm offset, norm
order, attention scale, window, embedding scale, RoPE bases), the compiled decode, config
refusals, vLLM names, the CPU decode fallback, bf16. The parity every family shares (logits,
greedy decoding, save/reload, LoRA) is ``tests/unit/models/families/test_family_parity.py``, on the
Gemma 3
cases of :mod:`tests.unit.models.families._family_zoo` (``sliding_window`` 8 shorter than the rows,
``query_pre_attn_scalar`` != ``head_dim``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")


from tests.unit.models.families._family_zoo import CASES, SMALL, write_model  # noqa: E402
from tests.unit.models.families.test_family_parity import left_padded, logit_diff  # noqa: E402
from tests.unit.models.families.test_family_parity import ours as built  # noqa: E402
from torchtune_grpo.models import hf_architecture, hf_model, hf_model_type  # noqa: E402
from torchtune_grpo.rollout.native import compile_decode_step, generate_trajectory  # noqa: E402
from torchtune_grpo.rollout.protocol import GenerationRequest  # noqa: E402

V = SMALL["vocab_size"]


FAMILY = [case for case in CASES if case.architecture.lower().startswith("gemma3")]


@pytest.fixture(scope="module", params=FAMILY, ids=[case.name for case in FAMILY])
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per gemma3 case of the family zoo."""
    path = tmp_path_factory.mktemp("gemma3") / request.param.name
    return path, write_model(path, request.param), request.param


# ------------------------------------------------------------------------- (a) logits
@pytest.mark.parametrize("breakage", ["norm_without_one", "swap_ff_norms", "head_dim_scale",
                                      "no_window", "no_embed_scale", "one_rope_base"])
def test_broken_variants_are_caught(folder, tmp_path, breakage):
    """The parity check discriminates each guard: breaking one moves logits by far more."""
    from torchtune_grpo.models import layers as gl

    path, ref, _ = folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 5, 17], 40)
    assert logit_diff(model, ref, tokens, mask) <= 1e-4
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
    assert logit_diff(model, ref, tokens, mask) > 0.05


# ------------------------------------------------------------------------- (b) greedy decoding
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_static_decode_matches_transformers(folder, tmp_path):
    """The compiled static decode (mask over the whole buffer, ``torch.compile``): the window
    is computed inside the graph, tokens still equal ``transformers.generate``."""
    path, ref, _ = folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 3, 9], 12, seed=2)
    eos, new = V - 1, 24
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=1,
        forward_batch_size=3, max_generated_tokens=new, temperature=0.0, top_k=None,
        stop_tokens=torch.tensor([eos]), pad_id=0),
        compiled_step=compile_decode_step(), packed_weights=False)
    with torch.no_grad():
        out = ref.generate(tokens, attention_mask=mask.long(), max_new_tokens=new,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    for ours_row, hf_row in zip(traj.response_tokens.tolist(), out[:, 12:].tolist()):
        n = min(len(ours_row), len(hf_row))
        assert n >= 16 and ours_row[:n] == hf_row[:n]


# ------------------------------------------------------------------------- (c) save / reload
# ------------------------------------------------------------------------- (d) LoRA
# ------------------------------------------------------------------------- config guards
def _config(**change):
    cfg = FAMILY[0].hf_config().to_dict()
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, ref, case = folder
    assert hf_model_type(path) == "GEMMA3"
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    kw = arch.builder_kwargs
    assert arch.family == "gemma3" and kw["head_dim"] == case.config["head_dim"]
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
    model, ckpt = built(path, tmp_path)
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
    model, _ = built(path, tmp_path)
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
    model, _ = built(path, tmp_path)
    ours, theirs = model.to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    tokens, _ = left_padded([0], 16)
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


def test_shipped_1b_config_validates_and_fits_eight_gpus(tmp_path):
    """``grpo/gemma3_1B_full``: validates, builds the 1.0B model offline, and its estimate fits
    an 80 GB GPU per rank on 8 ranks, with headroom (at most 70 GiB)."""
    from tests.conftest import check_instantiates_offline
    from torchtune_grpo.cli.memory_estimate import GIB, estimate_memory
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import validate_config

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    cfg = load_config("grpo/gemma3_1B_full", [f"model_dir={tmp_path}"])
    validate_config(cfg)
    check_instantiates_offline(cfg, min_params=0.95e9)
    estimate = estimate_memory(cfg, 8, name="gemma3_1B_full")
    assert estimate.peak_bytes < 70 * GIB, estimate.table()
