"""``torchtune_grpo.models.hf_model``: any HF Llama/Qwen2 folder, built from config.json alone.

Each case writes a small random ``transformers`` model (the reference implementation) with
``save_pretrained``, builds the torchtune model from the folder with :func:`hf_model`, loads
the weights through :func:`hf_checkpointer` (model type derived) and compares the logits.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402

from torchtune_grpo.models import (  # noqa: E402
    hf_architecture,
    hf_checkpointer,  # noqa: E402
    hf_model,
    hf_model_type,
    lora_hf_model,
)
from torchtune_grpo.policy.decoder import PolicyDecoder  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)

CASES = {
    "llama_plain_rope_tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                             rope_theta=100000.0)),
    "llama_plain_rope_untied_mha": ("llama", dict(num_key_value_heads=4,
                                                  tie_word_embeddings=False)),
    "llama3_rope_scaling": ("llama", dict(
        num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500000.0,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_bias_tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_theta=1000000.0)),
    "qwen2_bias_untied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


def _write(folder, family: str, extra: dict) -> "transformers.PreTrainedModel":
    kwargs = {**SMALL, **extra}
    if family == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # random, not-small weights: errors in the mapping show up clearly
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, extra = CASES[case]
    ref = _write(tmp_path / "m", family, extra)
    model = hf_model(str(tmp_path / "m"))
    ckpt = hf_checkpointer(str(tmp_path / "m"), output_dir=str(tmp_path / "out"))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    model.eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=generator)
    with torch.no_grad():
        got = model(tokens)
        want = ref(tokens).logits
    assert want.abs().max() > 1.0  # not degenerate
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    tied = extra["tie_word_embeddings"]
    assert ("output.weight" in dict(model.named_parameters())) == (not tied)


def test_rope_scaling_changes_logits(tmp_path):
    """The llama3 case above is sensitive to the RoPE settings: plain RoPE gives other logits."""
    family, extra = CASES["llama3_rope_scaling"]
    _write(tmp_path / "m", family, extra)
    cfg_path = tmp_path / "m" / "config.json"
    scaled = hf_model(str(tmp_path / "m"))
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_scaling", None)
    cfg.get("rope_parameters", {}).update(rope_type="default")
    cfg_path.write_text(json.dumps(cfg))
    plain = hf_model(str(tmp_path / "m"))
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.arange(60)[None] % SMALL["vocab_size"]
    with torch.no_grad():
        assert (scaled(tokens) - plain(tokens)).abs().max() > 1e-3


def test_model_type_and_lora(tmp_path):
    _write(tmp_path / "llama", "llama", CASES["llama_plain_rope_tied"][1])
    _write(tmp_path / "qwen", "qwen2", CASES["qwen2_bias_untied"][1])
    assert hf_model_type(tmp_path / "llama") == "LLAMA3_2"
    assert hf_model_type(tmp_path / "qwen") == "QWEN2"
    for name in ("llama", "qwen"):
        base = hf_model(str(tmp_path / name))
        lora = lora_hf_model(str(tmp_path / name), lora_attn_modules=["q_proj", "v_proj"],
                             lora_rank=4, lora_alpha=8)
        assert isinstance(base, PolicyDecoder) and isinstance(lora, PolicyDecoder)
        # adapters start at zero: same function as the base with the same base weights
        missing = lora.load_state_dict(base.state_dict(), strict=False).missing_keys
        assert missing and all("lora" in k for k in missing)
        tokens = torch.arange(20)[None]
        with torch.no_grad():
            torch.testing.assert_close(lora(tokens), base(tokens))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
     "architectures=['FalconForCausalLM'] (model_type='falcon') is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"head_dim": 32}, "head_dim 32 differs"),
    ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
])
def test_unsupported_configs_are_named(change, message):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL,
           "num_key_value_heads": 2, **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as info:
        hf_architecture(cfg)
    if "architectures" in change:
        assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_model(str(tmp_path / "empty"))
