"""Tiny random models of every supported family, written by ``transformers`` (the reference),
never downloaded: the cases of the family parity suite
(``tests/unit/models/families/test_family_parity.py``,
``tests/recipes/test_family_recipes.py``).

Each :class:`FamilyCase` names a ``transformers`` config class and its arguments. Weights are
wide (``initializer_range`` 0.2) and every norm weight is drawn off its initial value
(U(0.5, 1.5) for ``x * w`` norms, U(-0.5, 0.5) for Gemma's ``x * (1 + w)``), so that a norm
that is missing, swapped with another or applied at the wrong place changes the logits by far
more than the tolerances. Sliding windows (8) are shorter than the test rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Dimensions every case shares (a case may override them).
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2)


@dataclass(frozen=True)
class FamilyCase:
    """One tiny model.

    Attributes:
        name: the test id (``"qwen3-tied"``).
        architecture: the HF class (``"Qwen3ForCausalLM"``), ``transformers.<architecture>``.
        config_class: ``transformers.<config_class>`` (``"Qwen3Config"``).
        config: its arguments beyond :data:`SMALL`.
        gemma_norms: norm weights are offsets from 1 (drawn around 0, not around 1).
        tied: the output projection is the embedding table.
        fast: part of the fast tier's parity tests (one or two cases per family).
        reload_tol: largest |logit diff| between our model and transformers loading what we
            saved (1e-5; Llama: torchtune's interleaved RoPE on permuted q/k rows is the same
            rotation as HF's halves, rounded differently: 9e-6 measured with these weights).
    """

    name: str
    architecture: str
    config_class: str
    config: dict = field(default_factory=dict)
    gemma_norms: bool = False
    tied: bool = False
    fast: bool = True
    reload_tol: float = 1e-5

    def hf_config(self, **extra):
        """The ``transformers`` config of this case."""
        import transformers

        cfg = getattr(transformers, self.config_class)(**{**SMALL, **self.config, **extra})
        cfg.architectures = [self.architecture]
        return cfg


CASES: list[FamilyCase] = [
    # torchtune's own builders (llama3_2, qwen2) with its converters (q/k permuted)
    FamilyCase("llama-tied-gqa", "LlamaForCausalLM", "LlamaConfig",
               dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100_000.0,
                    rms_norm_eps=1e-5, num_hidden_layers=3),
               tied=True, reload_tol=5e-5),
    FamilyCase("qwen2-untied-qkv_bias", "Qwen2ForCausalLM", "Qwen2Config",
               dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1_000_000.0,
                    rms_norm_eps=1e-6, num_hidden_layers=3, use_sliding_window=False)),
    FamilyCase("qwen3-tied-gqa-head_dim_32", "Qwen3ForCausalLM", "Qwen3Config",
               dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    num_hidden_layers=3, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
               tied=True),
    FamilyCase("qwen3-untied-mha-head_dim_16", "Qwen3ForCausalLM", "Qwen3Config",
               dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                    num_hidden_layers=3, rope_theta=10_000.0, rms_norm_eps=1e-6)),
    FamilyCase("gemma3-tied-gqa-pattern", "Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    sliding_window_pattern=2, query_pre_attn_scalar=24, sliding_window=8,
                    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
               gemma_norms=True, tied=True),
    FamilyCase("gemma3-untied-layer_types-linear_rope", "Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                    query_pre_attn_scalar=20, sliding_window=8,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"],
                    rope_scaling={"rope_type": "linear", "factor": 4.0},
                    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
               gemma_norms=True),
    # attention cap 5 bites on these wide-init scores, final cap 8 on these logits (raw up to 9)
    FamilyCase("gemma2-tied-caps", "Gemma2ForCausalLM", "Gemma2Config",
               dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
                    final_logit_softcapping=8.0, rope_theta=10_000.0, rms_norm_eps=1e-6,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
               gemma_norms=True, tied=True),
    FamilyCase("gemma2-untied-layer_types-scalar_is_head_dim", "Gemma2ForCausalLM",
               "Gemma2Config",
               dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                    query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"],
                    attn_logit_softcapping=8.0, final_logit_softcapping=6.0,
                    rope_theta=100_000.0, rms_norm_eps=1e-6,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
               gemma_norms=True),
    FamilyCase("olmo2-untied-gqa", "Olmo2ForCausalLM", "Olmo2Config",
               dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500_000.0,
                    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    FamilyCase("phi3-untied-partial_rotary-window", "Phi3ForCausalLM", "Phi3Config",
               dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=8,
                    partial_rotary_factor=0.5, rope_theta=10_000.0, rms_norm_eps=1e-5,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    FamilyCase("phi4-tied-full_rotary", "Phi3ForCausalLM", "Phi3Config",
               dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=250_000.0,
                    rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1, bos_token_id=2),
               tied=True),
    FamilyCase("phi4_mini-tied-longrope-partial_rotary", "Phi3ForCausalLM", "Phi3Config",
               dict(num_key_value_heads=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
                    rope_scaling={"rope_type": "longrope", "factor": 32.0,
                                  "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                                  "long_factor": [4.0] * 6},
                    original_max_position_embeddings=256, rope_theta=10_000.0,
                    rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1, bos_token_id=2),
               tied=True, fast=False),
    FamilyCase("mistral-untied-gqa-window_8", "MistralForCausalLM", "MistralConfig",
               dict(num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False,
                    rope_theta=1_000_000.0, rms_norm_eps=1e-5, pad_token_id=0)),
    FamilyCase("mistral-untied-head_dim_32-no_window", "MistralForCausalLM", "MistralConfig",
               dict(num_key_value_heads=4, head_dim=32, sliding_window=None,
                    tie_word_embeddings=False, num_hidden_layers=3, rope_theta=10_000.0,
                    rms_norm_eps=1e-6)),
    FamilyCase("smollm3-tied-gqa-no_rope_layers", "SmolLM3ForCausalLM", "SmolLM3Config",
               dict(num_key_value_heads=2, no_rope_layers=[1, 0, 1, 0],
                    tie_word_embeddings=True, rope_theta=100_000.0, rms_norm_eps=1e-6,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2),
               tied=True),
    FamilyCase("smollm3-untied-sliding_8", "SmolLM3ForCausalLM", "SmolLM3Config",
               dict(num_key_value_heads=4, no_rope_layer_interval=2, use_sliding_window=True,
                    sliding_window=8, tie_word_embeddings=False, rope_theta=100_000.0,
                    rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2),
               fast=False),
]
BY_NAME = {case.name: case for case in CASES}


def write_model(folder: Path, case: FamilyCase | str, seed: int = 0, tokenizer: bool = False,
                **dims):
    """Write the random ``case`` (and, with ``tokenizer``, the ChatML test tokenizer) into
    ``folder`` with ``save_pretrained``; ``dims`` override config fields (vLLM's CPU attention
    needs ``head_dim >= 32``).

    Returns:
        The ``transformers`` model in eval mode, float32.
    """
    import transformers

    case = BY_NAME[case] if isinstance(case, str) else case
    torch.manual_seed(seed)
    model = getattr(transformers, case.architecture)(case.hf_config(**dims)).float().eval()
    low, high = (-0.5, 0.5) if case.gemma_norms else (0.5, 1.5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(low, high)
    model.save_pretrained(folder)
    if tokenizer:
        from tests.unit.rewards._learned_models import write_chat_tokenizer

        write_chat_tokenizer(Path(folder))
    return model
