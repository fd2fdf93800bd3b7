"""Mistral and SmolLM3, what is their own: a broken variant of each guard (Mistral's window
removed or one key off, SmolLM3's RoPE on its no-RoPE layers), SmolLM3's sliding layers and
``no_rope_layer_interval``, which layers the CPU decode backend fuses, config refusals, vLLM
names, the published models' dimensions. The parity every family shares (logits, greedy
decoding, save/reload, LoRA) is ``tests/unit/models/families/test_family_parity.py``, on the
Mistral and
SmolLM3 cases of :mod:`tests.unit.models.families._family_zoo`.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.unit.models.families._family_zoo import BY_NAME, CASES, SMALL, write_model  # noqa: E402
from tests.unit.models.families.test_family_parity import left_padded, logit_diff  # noqa: E402
from tests.unit.models.families.test_family_parity import ours as built  # noqa: E402
from torchtune_grpo.models import hf_architecture, hf_model, hf_model_type  # noqa: E402
from torchtune_grpo.models.layers import SlidingWindowLayer  # noqa: E402

V = SMALL["vocab_size"]
FAMILY = [case for case in CASES if case.fast and case.architecture in (
    "MistralForCausalLM", "SmolLM3ForCausalLM")]
MODEL_TYPE = {"MistralForCausalLM": "MISTRAL_HF", "SmolLM3ForCausalLM": "SMOLLM3"}


@pytest.fixture(scope="module", params=FAMILY, ids=[case.name for case in FAMILY])
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``, one per fast Mistral / SmolLM3 zoo case."""
    path = tmp_path_factory.mktemp("fam") / request.param.name
    return path, write_model(path, request.param), request.param


@pytest.fixture(scope="module")
def window_folder(tmp_path_factory):
    """The Mistral case with ``sliding_window`` 8: ``(folder, transformers model)``."""
    path = tmp_path_factory.mktemp("mistral") / "window"
    return path, write_model(path, "mistral-untied-gqa-window_8")


@pytest.fixture(scope="module")
def smollm3_folder(tmp_path_factory):
    """The tied SmolLM3 case (layers 1 and 3 without RoPE): ``(folder, transformers model)``."""
    path = tmp_path_factory.mktemp("smollm3") / "nope"
    return path, write_model(path, "smollm3-tied-gqa-no_rope_layers")


# ------------------------------------------------------------------------- broken variants
@pytest.mark.parametrize("window", [None, 7, 9], ids=["no_window", "window_7", "window_9"])
def test_mistral_window_convention_is_caught(window_folder, tmp_path, window):
    """``transformers``' window of 8 keeps the query and the 7 keys before it: removing the
    window, or making it one key narrower or wider, moves the logits of 40-token rows by far
    more than the 1e-4 tolerance."""
    path, ref = window_folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 5, 17], 40)
    assert logit_diff(model, ref, tokens, mask) <= 1e-4
    layers = list(model.layers)
    assert all(isinstance(layer, SlidingWindowLayer) and layer.window == 8 for layer in layers)
    for layer in layers:
        layer.window = 10_000 if window is None else window
    diff = logit_diff(model, ref, tokens, mask)
    print(f"mistral window {window}: max |logit diff| = {diff:.3g}")
    assert diff > 0.05


@pytest.mark.parametrize("breakage", ["rope_everywhere", "rope_nowhere"])
def test_smollm3_rope_layers_are_caught(smollm3_folder, tmp_path, breakage):
    """RoPE on the layers ``no_rope_layers`` leaves without it (or on none) is caught."""
    path, ref = smollm3_folder
    model, _ = built(path, tmp_path)
    tokens, mask = left_padded([0, 5, 17], 40)
    assert logit_diff(model, ref, tokens, mask) <= 1e-4
    ropes = [layer.attn.pos_embeddings for layer in model.layers]
    assert [r is not None for r in ropes] == [True, False, True, False]
    for layer in model.layers:
        layer.attn.pos_embeddings = ropes[0] if breakage == "rope_everywhere" else None
    diff = logit_diff(model, ref, tokens, mask)
    print(f"smollm3 {breakage}: max |logit diff| = {diff:.3g}")
    assert diff > 0.05


# ------------------------------------------------------------------------- SmolLM3 sliding
def test_smollm3_sliding_layers_match_transformers(tmp_path):
    """``use_sliding_window`` with ``sliding_window`` 8: the default ``layer_types`` slide the
    layers without RoPE; logits (40-token rows) and 32 greedy tokens equal ``transformers``',
    and a layer without its window is caught."""
    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    path = tmp_path / "sliding"
    ref = write_model(path, BY_NAME["smollm3-untied-sliding_8"])
    model, _ = built(path, tmp_path)
    assert [getattr(layer, "window", None) for layer in model.layers] == [None, 8, None, 8]
    assert [layer.attn.pos_embeddings is None for layer in model.layers] == [False, True] * 2
    tokens, mask = left_padded([0, 5, 17], 40)
    diff = logit_diff(model, ref, tokens, mask)
    print(f"smollm3-untied-sliding_8: max |logit diff| vs transformers = {diff:.3g}")
    assert diff <= 1e-4
    prompt, prompt_mask = left_padded([0, 3, 9], 12, seed=2)
    traj = generate_trajectory(model, GenerationRequest(prompt, prompt_mask, group_size=1,
        forward_batch_size=3, max_generated_tokens=32, temperature=0.0, top_k=None,
        stop_tokens=torch.tensor([V - 1]), pad_id=0))
    with torch.no_grad():
        out = ref.generate(prompt, attention_mask=prompt_mask.long(), max_new_tokens=32,
                           do_sample=False, eos_token_id=V - 1, pad_token_id=0)
    for ours_row, row_mask, hf_row in zip(traj.response_tokens.tolist(),
                                          traj.response_mask.tolist(), out[:, 12:].tolist()):
        ids = [t for t, m in zip(ours_row, row_mask) if m]
        assert len(ids) >= 16 and ids == hf_row[: len(ids)]
    for layer in model.layers[1::2]:
        layer.window = 10_000
    assert logit_diff(model, ref, tokens, mask) > 0.05


def test_smollm3_no_rope_layer_interval_without_list():
    """Without ``no_rope_layers``, every ``no_rope_layer_interval``-th layer has no RoPE, and
    without ``layer_types`` those layers slide when ``use_sliding_window`` is on, as
    ``SmolLM3Config`` computes them."""
    cfg = _config("SmolLM3ForCausalLM", num_hidden_layers=7, no_rope_layer_interval=3)
    cfg.pop("no_rope_layers")
    cfg.pop("layer_types")
    kw = hf_architecture(cfg).builder_kwargs
    expected = transformers.SmolLM3Config(num_hidden_layers=7,
                                          no_rope_layer_interval=3).no_rope_layers
    assert kw["use_rope"] == [bool(f) for f in expected] == [True, True, False] * 2 + [True]
    assert kw["sliding_windows"] == [None] * 7
    cfg.update(use_sliding_window=True, sliding_window=8)  # the default layer_types slide
    kw = hf_architecture(cfg).builder_kwargs
    expected = transformers.SmolLM3Config(num_hidden_layers=7, no_rope_layer_interval=3,
                                          use_sliding_window=True, sliding_window=8).layer_types
    assert kw["sliding_windows"] == [8 if t == "sliding_attention" else None for t in expected]
    assert kw["sliding_windows"] == [None, None, 8] * 2 + [None]


# ------------------------------------------------------------------------- CPU decode
def test_cpu_decode_fuses_plain_layers_only(folder, tmp_path):
    """The fused CPU decode layer (stacked q/k/v, its attention calling the layer's RoPE, or
    none for a layer without) takes Mistral layers without a window and every SmolLM3 layer,
    no-RoPE ones included; sliding layers keep their own forward (the fused layer has no
    window). The greedy parity test (packed weights) shows the fused tokens are
    transformers'."""
    from torchtune_grpo.backends.cpu_decode import _fusable, packed_linear_weights

    path, _, case = folder
    model, _ = built(path, tmp_path)
    sliding = [isinstance(layer, SlidingWindowLayer) for layer in model.layers]
    assert sliding == [case.config.get("sliding_window") is not None] * len(sliding)
    assert [_fusable(layer, set()) for layer in model.layers] == [not s for s in sliding]
    with packed_linear_weights(model):
        fused = ["forward" in layer.__dict__ for layer in model.layers]
    assert fused == [not s for s in sliding]


# ------------------------------------------------------------------------- config guards
def _config(arch: str, **change):
    case = next(c for c in CASES if c.architecture == arch)
    cfg = case.hf_config().to_dict()
    cfg.update(change)
    return cfg


def test_architecture_and_model_type(folder):
    path, ref, case = folder
    assert hf_model_type(path) == MODEL_TYPE[case.architecture]
    arch = hf_architecture(json.loads((path / "config.json").read_text()))
    kw = arch.builder_kwargs
    assert arch.family == case.architecture.removesuffix("ForCausalLM").lower()
    head_dim = case.config.get("head_dim") or SMALL["hidden_size"] // SMALL["num_attention_heads"]
    assert kw["head_dim"] == head_dim == ref.model.layers[0].self_attn.head_dim
    assert kw["tie_word_embeddings"] == case.tied


def test_smollm3_ties_by_default():
    cfg = _config("SmolLM3ForCausalLM")
    cfg.pop("tie_word_embeddings")
    assert hf_architecture(cfg).builder_kwargs["tie_word_embeddings"] is True
    cfg = _config("MistralForCausalLM")
    cfg.pop("tie_word_embeddings")
    assert hf_architecture(cfg).builder_kwargs["tie_word_embeddings"] is False


_SCALING = [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_scaling type 'linear'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 15}, "head_dim 15"),
]


@pytest.mark.parametrize("arch, change, message", [
    *[("MistralForCausalLM", c, m) for c, m in _SCALING],
    ("MistralForCausalLM", {"sliding_window": 0}, "sliding_window 0"),
    ("MistralForCausalLM", {"layer_types": ["full_attention", "sliding_attention"] * 2},
     "layer_types is not supported"),
    *[("SmolLM3ForCausalLM", c, m) for c, m in _SCALING],
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers must list"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers must list"),
    ("SmolLM3ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"] * 2},
     "layer_types must list"),
    ("SmolLM3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"] * 2,
                            "sliding_window": 8}, "use_sliding_window=false"),
    ("SmolLM3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"] * 2,
                            "use_sliding_window": True, "sliding_window": None},
     "sliding_window None"),
    ("MistralForCausalLM", {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
     "is not supported"),
])
def test_unsupported_fields_stop_with_one_line(arch, change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf_architecture(_config(arch, **change), where="m/config.json")
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/config.json: ")


def test_unsupported_field_stops_before_weights(tmp_path):
    """hf_model and the checkpointer refuse from config.json alone (no weight file needed)."""
    (tmp_path / "config.json").write_text(json.dumps(_config("MistralForCausalLM",
                                                             mlp_bias=True)))
    with pytest.raises(ValueError, match="mlp_bias"):
        hf_model(str(tmp_path))
    with pytest.raises(ValueError, match="mlp_bias"):
        hf_model_type(tmp_path)


def test_vllm_weight_names(folder, tmp_path):
    """The vLLM engine's weight sync names every tensor as the HF folder does."""
    from safetensors.torch import load_file

    from torchtune_grpo.rollout.vllm_engine import hf_weight_items, torchtune_to_hf_converter

    path, _, _ = folder
    model, ckpt = built(path, tmp_path)
    convert = torchtune_to_hf_converter(ckpt._model_type.name, ckpt._config)
    ours = dict(hf_weight_items(model, convert))
    theirs = load_file(str(path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in theirs)


# ------------------------------------------------------------------------- published sizes
#: Mistral-7B-v0.3's and SmolLM3-3B's config.json dimensions (no download).
MISTRAL_7B_V03 = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
    rms_norm_eps=1e-5, rope_theta=1_000_000.0, sliding_window=None,
    tie_word_embeddings=False, vocab_size=32768, bos_token_id=1, eos_token_id=2)
SMOLLM3_3B = dict(
    architectures=["SmolLM3ForCausalLM"], model_type="smollm3", hidden_size=2048,
    intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=65536,
    rms_norm_eps=1e-6, rope_theta=5_000_000.0, rope_scaling=None, no_rope_layer_interval=4,
    use_sliding_window=False, sliding_window=None, attention_bias=False, mlp_bias=False,
    tie_word_embeddings=True, vocab_size=128256, pad_token_id=128004, bos_token_id=128000,
    eos_token_id=128012)


@pytest.mark.parametrize("cfg, params", [(MISTRAL_7B_V03, 7.248e9), (SMOLLM3_3B, 3.075e9)],
                         ids=["mistral-7b-v0.3", "smollm3-3b"])
def test_published_configs_build(tmp_path, cfg, params):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = hf_model(str(tmp_path), max_seq_len=1024)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) < 0.005e9, count
    no_rope = [i for i, layer in enumerate(model.layers) if layer.attn.pos_embeddings is None]
    assert no_rope == (list(range(3, 36, 4)) if cfg is SMOLLM3_3B else [])
    assert not any(isinstance(layer, SlidingWindowLayer) for layer in model.layers)
