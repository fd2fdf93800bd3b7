"""Gemma 2, what is Gemma 2's own: each bug of torchtune 0.6.1's Gemma 2 reproduced as a broken
variant (soft-caps swapped, no attention cap, the final cap on the hidden state instead of the
logits, pre/post feed-forward norms swapped) moves the logits far beyond the parity tolerance;
the attention cap in every path (packed rows, the CPU decode fallback, a refused ``BlockMask``);
config refusals; vLLM names. The parity every family shares (logits, greedy decoding, packed
training forwards, save/reload, LoRA, FSDP2) is
``tests/unit/models/families/test_family_parity.py`` on the
Gemma 2 cases of :mod:`tests.unit.models.families._family_zoo` (caps small enough to bite,
``sliding_window``
8 shorter than the rows, ``query_pre_attn_scalar`` != and == ``head_dim``).
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
from torchtune_grpo.models import hf_architecture, hf_model_type  # noqa: E402
from torchtune_grpo.models import layers as gl  # noqa: E402

FAMILY = [case for case in CASES if case.architecture == "Gemma2ForCausalLM"]


@pytest.fixture(scope="module", params=FAMILY, ids=[case.name for case in FAMILY])
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per Gemma 2 case of the family zoo."""
    path = tmp_path_factory.mktemp("gemma2") / request.param.name
    return path, write_model(path, request.param), request.param


def _cap_hidden_state(model, cap):
    """torchtune 0.6.1: the final cap on the normalised hidden state, none on the logits."""
    norm = model.norm
    plain = type(norm).forward

    def forward(x):
        return torch.tanh(plain(norm, x) / cap) * cap

    norm.forward = forward
    model._build_head(None)


# ------------------------------------------------------------------------- (a) logits
@pytest.mark.parametrize("breakage", ["swap_caps", "no_attention_cap", "final_cap_on_hidden",
                                      "no_final_cap", "swap_ff_norms"])
def test_torchtune_bugs_are_caught(folder, tmp_path, breakage):
    """Each of torchtune's Gemma 2 bugs, reproduced, moves logits by far more than 1e-4."""
    path, ref, case = folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 5, 17], 40)
    assert logit_diff(model, ref, tokens, mask) <= 1e-4
    attn_cap = case.config["attn_logit_softcapping"]
    final_cap = case.config["final_logit_softcapping"]
    attentions = [layer.attn for layer in model.layers]
    assert all(isinstance(a, gl.SoftCappedAttention) for a in attentions)
    if breakage == "swap_caps":
        for attn in attentions:
            attn.softcap = final_cap
        model._build_head(attn_cap)
    elif breakage == "no_attention_cap":
        for attn in attentions:
            attn.softcap = 1e9  # tanh(x / 1e9) * 1e9 == x
    elif breakage == "final_cap_on_hidden":
        _cap_hidden_state(model, final_cap)
    elif breakage == "no_final_cap":
        model._build_head(None)
    else:  # torchtune's converter: pre_feedforward_layernorm <-> post_feedforward_layernorm
        for layer in model.layers:
            layer.mlp_norm, layer.mlp_scale = layer.mlp_scale, layer.mlp_norm
    assert logit_diff(model, ref, tokens, mask) > 0.05


def test_final_cap_reaches_every_request(folder, tmp_path):
    """Log-probs of a response (the chunked path) are log-softmax of the capped logits."""
    from torchtune_grpo.policy.head import ResponseLogProbs

    path, ref, _ = folder
    model, _ = built(path, tmp_path)
    tokens, _ = left_padded([0], 24)
    with torch.no_grad():
        want = ref(tokens).logits[:, 10:23].log_softmax(-1).gather(
            -1, tokens[:, 11:24, None])[..., 0]
        got, _ = model(tokens, output=ResponseLogProbs(targets=tokens[:, 11:24], start=10,
                                                       chunk_size=4))
    assert (got - want).abs().max().item() < 1e-4


# ------------------------------------------------------------------------- the attention cap
def test_packed_rows_use_the_capped_kernel():
    """Packed segments and shared-prefix blocks are computed by the module's capped kernel."""
    from torchtune_grpo.policy.packing import (
        PackedSegments,
        SharedPrefixSegments,
        install_packed_attention,
    )

    attn = gl.SoftCappedAttention(
        softcap=2.0, embed_dim=32, num_heads=2, num_kv_heads=2, head_dim=16,
        q_proj=torch.nn.Linear(32, 32), k_proj=torch.nn.Linear(32, 32),
        v_proj=torch.nn.Linear(32, 32), output_proj=torch.nn.Linear(32, 32))
    install_packed_attention(attn)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(1, 2, 13, 16, generator=gen) for _ in range(3))
    for mask in (PackedSegments((5, 8)), SharedPrefixSegments(((4, (3, 2)), (2, (2,))))):
        dense = gl._dense_segments(mask, q.device)[:, None]
        got = attn._attention_call(q, k, v, mask=mask, dropout_p=0.0, is_causal=False)
        want = gl.soft_capped_sdpa(q, k, v, dense, softcap=2.0)
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(got, want)
        assert (got - plain).abs().max() > 0.05  # the cap bites on these scores


def test_capped_kernel_matches_sdpa_without_a_cap():
    """With a cap far above the scores the eager kernel is SDPA (bool, additive, causal)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bool_mask = torch.rand(2, 1, 6, 6, generator=gen) > 0.3
    bool_mask[..., 0] = True
    additive = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, float("-inf"))
    for kwargs in (dict(attn_mask=bool_mask), dict(attn_mask=additive), dict(is_causal=True)):
        torch.testing.assert_close(gl.soft_capped_sdpa(q, k, v, softcap=1e9, **kwargs),
                                   sdpa(q, k, v, **kwargs))
    empty = torch.zeros(1, 1, 6, 6, dtype=torch.bool)  # no key at all: zeros, as SDPA
    assert gl.soft_capped_sdpa(q, k, v, empty, softcap=5.0).eq(0).all()


def test_block_mask_is_refused(folder, tmp_path):
    """Flex attention's BlockMask has no soft-cap here: refused, never silently uncapped."""
    path, _, _ = folder
    model, _ = built(path, tmp_path)
    attn = model.layers[0].attn
    q = torch.zeros(1, attn.num_heads, 4, attn.head_dim)
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        attn._attention_call(q, q, q, mask=object(), dropout_p=0.0, is_causal=False)


def test_cpu_decode_falls_back_to_plain_layers(folder, tmp_path):
    """The fused CPU decode layer computes SDPA: no Gemma 2 layer is fused, and a layer that is
    plain but for a soft-capped attention is not either; the decode-step shortcut declines."""
    from torchtune.modules import (
        FeedForward,
        MultiHeadAttention,
        RMSNorm,
        TransformerSelfAttentionLayer,
    )

    from torchtune_grpo.backends.cpu_decode import (
        _fusable,
        attend_decode_step,
        packed_linear_weights,
    )
    from torchtune_grpo.policy.kv_cache import SpanKVCache

    path, _, _ = folder
    model, _ = built(path, tmp_path)
    assert not any(_fusable(layer, set()) for layer in model.layers)
    with packed_linear_weights(model):
        assert all("forward" not in layer.__dict__ for layer in model.layers)
    lin = torch.nn.Linear
    dims = dict(embed_dim=32, num_heads=2, num_kv_heads=2, head_dim=16)

    def projections():
        return dict(q_proj=lin(32, 32, bias=False), k_proj=lin(32, 32, bias=False),
                    v_proj=lin(32, 32, bias=False), output_proj=lin(32, 32, bias=False))

    attn = gl.SoftCappedAttention(softcap=5.0, **dims, **projections())
    layer = TransformerSelfAttentionLayer(
        attn=attn, mlp=FeedForward(gate_proj=lin(32, 64, bias=False),
                                   down_proj=lin(64, 32, bias=False),
                                   up_proj=lin(32, 64, bias=False)),
        sa_norm=RMSNorm(32), mlp_norm=RMSNorm(32))
    assert not _fusable(layer, set())
    plain = MultiHeadAttention(**dims, **projections())  # the control: the shortcut runs
    for module, runs in ((plain, True), (attn, False)):
        cache = SpanKVCache(torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), rows=1)
        cache.length = 3
        module.kv_cache, module.cache_enabled = cache, True
        out = attend_decode_step(module, torch.randn(1, 1, 96),
                                 mask=torch.ones(1, 1, 4, dtype=torch.bool), input_pos=None)
        assert (out is not None) is runs


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_static_decode_matches_transformers(folder, tmp_path):
    """The compiled static decode (mask over the whole buffer, ``torch.compile``) runs the
    capped kernel inside the graph: tokens still equal ``transformers.generate``."""
    from torchtune_grpo.rollout.native import compile_decode_step, generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    path, ref, _ = folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 3, 9], 12, seed=2)
    eos, new = SMALL["vocab_size"] - 1, 24
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


# ------------------------------------------------------------------------- config guards
def _config(**change):
    cfg = FAMILY[0].hf_config().to_dict()
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, ref, case = folder
    assert hf_model_type(path) == "GEMMA2"
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    kw = arch.builder_kwargs
    assert arch.family == "gemma2" and kw["head_dim"] == case.config["head_dim"]
    assert kw["layer_types"] == list(ref.config.layer_types)
    assert kw["sliding_window"] == 8 and "final_logit_softcap" not in kw
    assert kw["attn_softcap"] == case.config["attn_logit_softcapping"]
    assert arch.final_logit_softcap == case.config["final_logit_softcapping"]


def test_default_layer_types_slide_on_even_layers():
    """``Gemma2Config``'s default: layer 0 slides, layer 1 is global, and so on."""
    cfg = _config()
    cfg.pop("layer_types")
    kw = hf_architecture(cfg).builder_kwargs
    assert kw["layer_types"] == transformers.Gemma2Config(num_hidden_layers=4).layer_types
    assert kw["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_null_caps_build_plain_attention_and_head():
    from torchtune.modules import MultiHeadAttention

    from torchtune_grpo.models.builders import _decoder, _policy

    arch = hf_architecture(_config(attn_logit_softcapping=None, final_logit_softcapping=None))
    assert arch.final_logit_softcap is None and arch.builder_kwargs["attn_softcap"] is None
    model = _policy(_decoder(arch), arch)
    assert all(type(layer.attn) is MultiHeadAttention for layer in model.layers)
    assert model.head.final_logit_softcap is None
    missing = _config()
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        missing.pop(key)
    arch = hf_architecture(missing)  # absent: Gemma2Config's defaults, 50 and 30
    assert (arch.builder_kwargs["attn_softcap"], arch.final_logit_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_scaling type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping=0.0"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_unsupported_fields_stop_with_one_line(change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf_architecture(_config(**change), where="m/config.json")
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/config.json: ")


def test_vllm_weight_names(folder, tmp_path):
    """The vLLM engine's weight sync names every Gemma 2 tensor as the HF folder does."""
    from safetensors.torch import load_file

    from torchtune_grpo.rollout.vllm_engine import hf_weight_items, torchtune_to_hf_converter

    path, _, _ = folder
    model, ckpt = built(path, tmp_path)
    convert = torchtune_to_hf_converter(ckpt._model_type.name, ckpt._config)
    ours = dict(hf_weight_items(model, convert))
    theirs = load_file(str(path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in theirs)
