"""OLMo 2 and Phi-3/Phi-4, what is their own: a broken variant of each guard moves the logits
far beyond the parity tolerance, config refusals in one line, the fused Phi-3 weights' round
trip and vLLM names, the CPU decode backend's fused layer (taken for full-attention Phi-3
layers, declined by OLMo 2's post-norm layers). The parity every family shares is
``tests/unit/models/families/test_family_parity.py`` on the cases of
:mod:`tests.unit.models.families._family_zoo`.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402

from tests.unit.models.families._family_zoo import BY_NAME, SMALL, write_model  # noqa: E402
from tests.unit.models.families.test_family_parity import hf_logits, left_padded  # noqa: E402
from tests.unit.models.families.test_family_parity import ours as built  # noqa: E402
from torchtune_grpo.backends.cpu_decode import _fusable, packed_linear_weights  # noqa: E402
from torchtune_grpo.models import hf_architecture, hf_model  # noqa: E402
from torchtune_grpo.models.layers import HalfRoPE  # noqa: E402
from torchtune_grpo.policy.positions import attention_mask, position_ids  # noqa: E402

V = SMALL["vocab_size"]
OLMO2 = "olmo2-untied-gqa"
PHI3 = "phi3-untied-partial_rotary-window"
PHI4 = "phi4-tied-full_rotary"
LONGROPE = "phi4_mini-tied-longrope-partial_rotary"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``name -> (folder, transformers model)``, written on first use."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp("olmophi") / name
            made[name] = (path, write_model(path, name))
        return made[name]

    return get


def _diff(model, ref) -> float:
    tokens, mask = left_padded([0, 5, 17], 40)
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    return (got - hf_logits(ref, tokens, mask)).abs()[mask].max().item()


# ------------------------------------------------------------------------- OLMo 2 guards
class _PerHeadNorm(nn.Module):
    """The wrong OLMo 2 q/k norm: RMS over each head's channels (the scale kept)."""

    def __init__(self, norm: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        heads = y.unflatten(-1, (-1, self.head_dim))
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return normed.flatten(-2) * self.norm.scale


def _olmo2_per_head(model) -> None:
    for layer in model.layers:
        for proj in (layer.attn.q_proj, layer.attn.k_proj):
            proj.norm = _PerHeadNorm(proj.norm, layer.attn.head_dim)


def _olmo2_pre_norms(model) -> None:
    for layer in model.layers:
        layer.sa_norm, layer.sa_scale = layer.sa_scale, nn.Identity()
        layer.mlp_norm, layer.mlp_scale = layer.mlp_scale, nn.Identity()


@pytest.mark.parametrize("breaks", [_olmo2_per_head, _olmo2_pre_norms],
                         ids=["qk_norm_per_head", "norms_before"])
def test_olmo2_guards_are_caught(folders, tmp_path, breaks):
    path, ref = folders(OLMO2)
    model, _ = built(path, tmp_path)
    assert _diff(model, ref) <= 1e-4
    breaks(model)
    diff = _diff(model, ref)
    print(f"{breaks.__name__}: max |logit diff| = {diff:.3g}")
    assert diff > 0.1


def test_olmo2_cpu_decode_falls_back_to_plain_layers(folders, tmp_path):
    """The fused CPU decode layer needs pre-norms and no residual scales: OLMo 2 layers keep
    their own forward, their inner linears decode on packed weights."""
    path, _ = folders(OLMO2)
    model, _ = built(path, tmp_path)
    assert not any(_fusable(layer, set()) for layer in model.layers)
    with packed_linear_weights(model) as count:
        assert count == 7 * len(model.layers) + 1
        assert all("forward" not in layer.__dict__ for layer in model.layers)
        assert "forward" in model.layers[0].attn.q_proj.proj.__dict__


# ------------------------------------------------------------------------- Phi-3 guards
def _wrong_split_order(model, path) -> None:
    """Load the fused tensors split as [k; q; v] and [up; gate] (the parts' order swapped)."""
    from safetensors.torch import load_file

    from torchtune_grpo.models.families.phi3 import PHI3_NAMES
    from torchtune_grpo.models.hf_weights import Fused, WeightNames

    config = json.loads((path / "config.json").read_text())
    qkv = PHI3_NAMES.fused["self_attn.qkv_proj.weight"]
    gate_up = PHI3_NAMES.fused["mlp.gate_up_proj.weight"]
    swapped = WeightNames(
        family="x", model_type="PHI3", global_names=PHI3_NAMES.global_names,
        layer_names=PHI3_NAMES.layer_names, tied_by_default=False, not_part="x",
        fused={"self_attn.qkv_proj.weight": Fused(
                   (qkv.parts[2], qkv.parts[1], qkv.parts[0]),  # v and q swapped
                   lambda c: tuple(reversed(qkv.rows(c)))),
               "mlp.gate_up_proj.weight": Fused(gate_up.parts[::-1], gate_up.rows)})
    state = swapped.hf_to_tune(load_file(str(path / "model.safetensors")), config=config,
                               tie_word_embeddings=bool(config.get("tie_word_embeddings")))
    model.load_state_dict(state)


def _full_rotation(model, path) -> None:
    rope = model.layers[0].attn.pos_embeddings
    full = HalfRoPE(rope.dim, rope.max_seq_len, rope.base, freq_factors=None,
                    attention_factor=rope.attention_factor)
    for layer in model.layers:
        layer.attn.pos_embeddings = full


def _no_longrope(model, path) -> None:
    rope = model.layers[0].attn.pos_embeddings
    plain = HalfRoPE(rope.dim, rope.max_seq_len, rope.base, rotary_dim=rope.rotary_dim)
    for layer in model.layers:
        layer.attn.pos_embeddings = plain


def _no_attention_factor(model, path) -> None:
    rope = model.layers[0].attn.pos_embeddings
    plain = HalfRoPE(rope.dim, rope.max_seq_len, rope.base, rotary_dim=rope.rotary_dim,
                     freq_factors=rope.freq_factors)
    for layer in model.layers:
        layer.attn.pos_embeddings = plain


def _no_window(model, path) -> None:
    for layer in model.layers:
        layer.window = 10**6


@pytest.mark.parametrize("case, breaks", [
    (PHI3, _wrong_split_order), (PHI4, _wrong_split_order), (PHI3, _full_rotation),
    (LONGROPE, _full_rotation), (LONGROPE, _no_longrope), (LONGROPE, _no_attention_factor),
    (PHI3, _no_window),
], ids=["phi3-split_order", "phi4-split_order", "phi3-full_rotation",
        "longrope-full_rotation", "longrope-plain_rope", "longrope-no_attention_factor",
        "phi3-no_window"])
def test_phi3_guards_are_caught(folders, tmp_path, case, breaks):
    path, ref = folders(case)
    model, _ = built(path, tmp_path)
    assert _diff(model, ref) <= 1e-4
    breaks(model, path)
    diff = _diff(model, ref)
    print(f"{case} {breaks.__name__}: max |logit diff| = {diff:.3g}")
    assert diff > 0.1


def test_longrope_case_matches_and_decodes_fused(folders, tmp_path):
    """The LongRoPE case (not in the fast parity tier): logits, and greedy decoding through
    the CPU decode backend's fused layers (partial rotary and LongRoPE inside them) equal
    transformers'."""
    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    path, ref = folders(LONGROPE)
    model, _ = built(path, tmp_path)
    print(f"{LONGROPE}: max |logit diff| vs transformers = {_diff(model, ref):.3g}")
    assert _diff(model, ref) <= 1e-4
    assert all(_fusable(layer, set()) for layer in model.layers)
    tokens, mask = left_padded([0, 3, 9], 12, seed=2)
    eos = V - 1
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=1,
        forward_batch_size=3, max_generated_tokens=48, temperature=0.0, top_k=None,
        stop_tokens=torch.tensor([eos]), pad_id=0),
        packed_weights=True)
    with torch.no_grad():
        out = ref.generate(tokens, attention_mask=mask.long(), max_new_tokens=48,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    for ours_row, row_mask, hf_row in zip(traj.response_tokens.tolist(),
                                          traj.response_mask.tolist(),
                                          out[:, tokens.shape[1]:].tolist()):
        ours_ids = [t for t, m in zip(ours_row, row_mask) if m]
        assert len(ours_ids) >= 16 and ours_ids == hf_row[: len(ours_ids)]


def test_phi3_cpu_decode_fuses_full_attention_layers(folders, tmp_path):
    """Full-attention Phi-3 layers are plain torchtune layers: the fused decode layer takes
    them (the parity suite's greedy test then decodes through it); sliding-window layers
    decode through their own forward."""
    path, _ = folders(PHI4)
    model, _ = built(path, tmp_path)
    with packed_linear_weights(model) as count:
        assert count == 7 * len(model.layers) + 1  # + the tied output
        assert all("forward" in layer.__dict__ for layer in model.layers)
    windowed, _ = built(folders(PHI3)[0], tmp_path / "w")
    assert not any(_fusable(layer, set()) for layer in windowed.layers)


# ------------------------------------------------------------------------- fused weights
@pytest.mark.parametrize("case", [PHI3, PHI4])
def test_fused_save_round_trip_is_bitwise(folders, tmp_path, case):
    """Load splits qkv_proj/gate_up_proj into torchtune's parts; save stacks them back: the
    written file equals the HF folder's, name for name, bit for bit."""
    from safetensors.torch import load_file

    path, _ = folders(case)
    model, ckpt = built(path, tmp_path)
    state = ckpt.load_checkpoint()[training.MODEL_KEY]
    assert "layers.0.attn.q_proj.weight" in state and "layers.0.mlp.w3.weight" in state
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)
    theirs = load_file(str(path / "model.safetensors"))
    written = load_file(str(tmp_path / "ckpt_out" / "epoch_0"
                            / "model-00001-of-00001.safetensors"))
    assert written.keys() == theirs.keys()
    assert all(written[k].equal(theirs[k]) for k in theirs)


@pytest.mark.parametrize("case", [OLMO2, PHI3])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_merged"])
def test_vllm_weight_names(folders, tmp_path, case, lora):
    """The vLLM weight sync (tensor by tensor, or a LoRA policy merged at once) names and
    stacks every tensor as the HF folder does."""
    from safetensors.torch import load_file

    from torchtune_grpo.models import lora_hf_model
    from torchtune_grpo.rollout.vllm_engine import hf_weight_items, torchtune_to_hf_converter

    path, _ = folders(case)
    model, ckpt = built(path, tmp_path)
    if lora:
        model = lora_hf_model(str(path), ["q_proj", "k_proj", "v_proj"], True, lora_rank=2,
                              lora_alpha=4)
        model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=False)
    convert = torchtune_to_hf_converter(ckpt._model_type.name, ckpt._config)
    ours = dict(hf_weight_items(model, convert, {"rank": 2, "alpha": 4} if lora else None))
    theirs = load_file(str(path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in theirs)


def test_fused_tensor_with_a_part_missing_is_refused():
    from torchtune_grpo.models.families.phi3 import PHI3_NAMES

    with pytest.raises(ValueError, match="qkv_proj"):
        PHI3_NAMES.tune_to_hf({"layers.0.attn.q_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="rows"):
        PHI3_NAMES.hf_to_tune({"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(5, 2)},
                              tie_word_embeddings=False, config={"intermediate_size": 2})


def test_peft_adapter_of_part_of_a_fused_module(tmp_path, folders):
    """LoRA on q and v only: the PEFT qkv_proj adapter has rank 2r, a zero block for k, and
    ``rank_pattern``/``alpha_pattern`` keep ``alpha / r``; DoRA on only some parts has no PEFT
    form: the merged weights and the ``.pt`` adapter only."""
    from torchtune_grpo.models.families.phi3 import PHI3_NAMES

    path, _ = folders(PHI3)
    config = json.loads((path / "config.json").read_text())
    q, kv = PHI3_NAMES.fused["self_attn.qkv_proj.weight"].rows(config)[:2]
    lora = {f"layers.0.attn.{p}_proj.lora_{x}.weight": torch.randn(n if x == "b" else 2,
                                                                  2 if x == "b" else 64)
            for p, n in (("q", q), ("v", kv)) for x in "ab"}
    peft = PHI3_NAMES.tune_to_peft_adapter(lora, config)
    a = peft["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"]
    b = peft["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (q + 2 * kv, 4)
    delta = b @ a
    torch.testing.assert_close(delta[:q], lora["layers.0.attn.q_proj.lora_b.weight"]
                               @ lora["layers.0.attn.q_proj.lora_a.weight"])
    assert not delta[q : q + kv].any()
    cfg = PHI3_NAMES.peft_adapter_config(
        {"r": 2, "lora_alpha": 4, "peft_type": "LORA",
         "target_modules": ["q_proj", "v_proj", "output_proj"]}, None)
    assert cfg["target_modules"] == ["o_proj", "qkv_proj"]
    assert cfg["rank_pattern"] == {"qkv_proj": 4} and cfg["alpha_pattern"] == {"qkv_proj": 8}
    dora = {**lora, "layers.0.attn.q_proj.magnitude": torch.ones(q),
            "layers.0.attn.v_proj.magnitude": torch.ones(kv)}
    assert PHI3_NAMES.tune_to_peft_adapter(dora, config) is None


# ------------------------------------------------------------------------- config guards
def _config(name: str, **change):
    cfg = BY_NAME[name].hf_config().to_dict()
    cfg.update(change)
    return cfg


@pytest.mark.parametrize("name, change, message", [
    (OLMO2, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    (OLMO2, {"attention_bias": True}, "attention_bias=true"),
    (OLMO2, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (PHI3, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic'"),
    (PHI3, {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                             "long_factor": [1.0]}}, "short_factor must list 4"),
    (PHI3, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (PHI3, {"resid_pdrop": 0.1}, "resid_pdrop=0.1"),
    (PHI3, {"embd_pdrop": 0.1}, "embd_pdrop=0.1"),
    (PHI3, {"head_dim": 32}, "head_dim 32"),
    (PHI3, {"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1"),
])
def test_unsupported_fields_stop_with_one_line(name, change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf_architecture(_config(name, **change), where="m/config.json")
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/config.json: ")


def test_longrope_beyond_original_context_is_refused(tmp_path):
    """Phi-3-mini-128k style: max_position_embeddings 131072, original 4096. Building with the
    default context is refused in one line; with max_seq_len 4096 the attention factor comes
    from the ratio (sqrt(1 + ln 32 / ln 4096))."""
    cfg = _config(LONGROPE, max_position_embeddings=131072,
                  original_max_position_embeddings=4096)
    del cfg["rope_parameters"]["factor"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="set model.max_seq_len to at most 4096") as info:
        hf_model(str(tmp_path))
    assert "\n" not in str(info.value)
    model = hf_model(str(tmp_path), max_seq_len=64)
    rope = model.layers[0].attn.pos_embeddings
    assert rope.rotary_dim == 12 and rope.freq_factors == (1.0, 1.5, 2.0, 3.0, 5.0, 8.0)
    assert rope.attention_factor == pytest.approx((1 + 5 / 12) ** 0.5)


def test_transformers4_style_phi4_mini_config():
    """Phi-4-mini's config.json as on the Hub (transformers 4 keys: top-level
    partial_rotary_factor, rope_scaling type longrope, a window longer than any context)."""
    cfg = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
               intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
               num_hidden_layers=32, vocab_size=200064, max_position_embeddings=131072,
               original_max_position_embeddings=4096, partial_rotary_factor=0.75,
               rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=262144,
               tie_word_embeddings=True, pad_token_id=199999, resid_pdrop=0.0,
               embd_pdrop=0.0, hidden_act="silu",
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                             "long_factor": [2.0] * 48})
    kw = hf_architecture(cfg, max_seq_len=4096).builder_kwargs
    assert kw["rotary_dim"] == 96 and kw["rope_original_max"] == 4096
    assert kw["tie_word_embeddings"] is True and kw["pad_id"] == 199999
    assert kw["rope_attention_factor"] == pytest.approx((1 + 5 / 12) ** 0.5)
