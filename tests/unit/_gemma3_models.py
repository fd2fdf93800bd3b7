"""Tiny random Gemma 3 (text) folders written by ``transformers`` (the reference), never
downloaded.

Weights are wide (``initializer_range`` 0.2) and every Gemma RMSNorm weight (stored as an
offset from 1: q/k head norms, the four norms of each layer, the final norm) is drawn from
U(-0.5, 0.5), off its initial 0, so a norm that is missing, swapped with another, or computed
as ``x * w`` instead of ``x * (1 + w)`` changes the logits by far more than the tolerances.
``sliding_window`` is 8, shorter than the test sequences, and ``query_pre_attn_scalar`` differs
from ``head_dim``.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: Gemma 3 variants: layer kinds from ``layer_types`` or from ``sliding_window_pattern``.
CASES = {
    "tied_gqa_pattern": dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                             sliding_window_pattern=2, query_pre_attn_scalar=24),
    "untied_mha_layer_types_linear_rope": dict(
        num_key_value_heads=4, head_dim=16, tie_word_embeddings=False, query_pre_attn_scalar=20,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 4.0}),
}
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
             initializer_range=0.2, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
             sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def gemma3_config(case: str, **extra):
    """The ``transformers.Gemma3TextConfig`` of ``case`` (see :data:`CASES`)."""
    import transformers

    cfg = transformers.Gemma3TextConfig(**{**SMALL, **CASES[case], **extra})
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def write_gemma3(folder: Path, case: str = "tied_gqa_pattern", seed: int = 0,
                 tokenizer: bool = False):
    """Write a random ``Gemma3ForCausalLM`` (and, with ``tokenizer``, the ChatML test tokenizer)
    into ``folder`` with ``save_pretrained``.

    Returns:
        The ``transformers`` model in eval mode, float32.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(gemma3_config(case)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    if tokenizer:
        from tests.unit._learned_models import write_chat_tokenizer

        write_chat_tokenizer(Path(folder))
    return model
