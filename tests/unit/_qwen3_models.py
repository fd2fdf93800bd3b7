"""Tiny random Qwen3 folders written by ``transformers`` (the reference), never downloaded.

Weights are wide (``initializer_range`` 0.2) and every RMSNorm scale (the q/k head norms, both
layer norms, the final norm) is drawn from U(0.5, 1.5), off its initial 1, so a norm that is
missing, swapped with another or applied at the wrong place (after RoPE instead of before)
changes the logits by far more than the tolerances.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit._learned_models import write_chat_tokenizer

#: Qwen3 variants: ``head_dim`` 32 differs from ``hidden_size / num_attention_heads`` = 16.
CASES = {
    "tied_gqa_head_dim_32": dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "untied_mha_head_dim_16": dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                                   rope_theta=10_000.0),
}
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
             initializer_range=0.2, rope_theta=1_000_000.0)


def qwen3_config(case: str, **extra):
    """The ``transformers.Qwen3Config`` of ``case`` (see :data:`CASES`)."""
    import transformers

    return transformers.Qwen3Config(**{**SMALL, **CASES[case], **extra})


def write_qwen3(folder: Path, case: str = "tied_gqa_head_dim_32", seed: int = 0,
                tokenizer: bool = True):
    """Write a random ``Qwen3ForCausalLM`` (and, with ``tokenizer``, the ChatML test tokenizer)
    into ``folder`` with ``save_pretrained``.

    Returns:
        The ``transformers`` model in eval mode, float32.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(qwen3_config(case)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    if tokenizer:
        write_chat_tokenizer(Path(folder))
    return model
