"""Model families that torchtune 0.6.1 lacks or gets wrong, built from torchtune's modules.

Each family is one module that gives, for :func:`torchtune_grpo.models.hf_model` and the
checkpointer, the same interface:

* ``ARCHITECTURE``: the HF class it builds (``config.json``'s ``architectures[0]``);
* ``check_config(cfg, *, where, heads, rope_scaling) -> dict``: refuses, in one line naming the
  field, what it does not compute, and returns the builder arguments beyond the common ones
  (``vocab_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``embed_dim``,
  ``intermediate_dim``, ``max_seq_len``, ``rope_base``, ``norm_eps``,
  ``tie_word_embeddings``); an entry ``final_logit_softcap`` (Gemma 2's
  ``final_logit_softcapping``) is not a builder argument: ``hf_architecture`` moves it into
  ``HFArchitecture.final_logit_softcap``, the policy's output head's soft-cap;
* ``build(**kwargs)`` and ``build_lora(lora_attn_modules, ..., **kwargs)``: the decoder, made
  by :func:`~torchtune_grpo.models.decoder.build_decoder` from a
  :class:`~torchtune_grpo.models.decoder.DecoderSpec`;
* ``NAMES``: its :class:`~torchtune_grpo.models.hf_weights.WeightNames` (HF <->
  torchtune weight names; ``NAMES.model_type`` is the checkpointer's ``model_type``).

:data:`FAMILY_MODULES` lists them; :func:`family_module` imports one on first use (nothing
here reads weights).

* :mod:`~torchtune_grpo.models.families.qwen3`: ``Qwen3ForCausalLM`` (dense Qwen3), per-head
  RMSNorm on queries and keys before RoPE.
* :mod:`~torchtune_grpo.models.families.gemma3`: ``Gemma3ForCausalLM`` (Gemma 3 text): Gemma
  norms, q/k norms before RoPE, sliding-window and global layers with their own RoPE bases.
* :mod:`~torchtune_grpo.models.families.gemma2`: ``Gemma2ForCausalLM`` (Gemma 2): Gemma norms,
  alternating sliding-window and global layers, attention-logit soft-cap in every attention
  path, final-logit soft-cap in the output head.
* :mod:`~torchtune_grpo.models.families.olmo2`: ``Olmo2ForCausalLM`` (OLMo 2): norms on the
  attention/MLP outputs instead of their inputs, q/k RMSNorm over the whole projection.
* :mod:`~torchtune_grpo.models.families.phi3`: ``Phi3ForCausalLM`` (Phi-3, Phi-4): fused
  ``qkv_proj``/``gate_up_proj`` weights split on load and stacked on save, partial rotary,
  LongRoPE within the original context, sliding window.
* :mod:`~torchtune_grpo.models.families.mistral`: ``MistralForCausalLM``: Llama-shaped, explicit
  ``head_dim``, an optional sliding window on every layer.
* :mod:`~torchtune_grpo.models.families.smollm3`: ``SmolLM3ForCausalLM``: Llama-shaped, some
  layers without RoPE (``no_rope_layers``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["FAMILY_MODULES", "HF_MODEL_TYPES", "family_for_model_type", "family_module"]

#: HF architecture -> the module that builds it.
FAMILY_MODULES: dict[str, str] = {
    "Qwen3ForCausalLM": "torchtune_grpo.models.families.qwen3",
    "Gemma2ForCausalLM": "torchtune_grpo.models.families.gemma2",
    "Gemma3ForCausalLM": "torchtune_grpo.models.families.gemma3",
    "Olmo2ForCausalLM": "torchtune_grpo.models.families.olmo2",
    "Phi3ForCausalLM": "torchtune_grpo.models.families.phi3",
    "MistralForCausalLM": "torchtune_grpo.models.families.mistral",
    "SmolLM3ForCausalLM": "torchtune_grpo.models.families.smollm3",
}
#: ``config.json``'s ``model_type`` -> architecture, for configs without ``architectures``.
HF_MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
#: The checkpointer ``model_type`` of each architecture (``NAMES.model_type``, known without
#: importing the module).
MODEL_TYPES: dict[str, str] = {
    "Qwen3ForCausalLM": "QWEN3",
    "Gemma2ForCausalLM": "GEMMA2",  # this package's, not torchtune's (wrong) GEMMA2 converter
    "Gemma3ForCausalLM": "GEMMA3",
    "Olmo2ForCausalLM": "OLMO2",
    "Phi3ForCausalLM": "PHI3",
    "MistralForCausalLM": "MISTRAL_HF",  # torchtune's MISTRAL permutes q/k for its own RoPE
    "SmolLM3ForCausalLM": "SMOLLM3",
}


def family_module(architecture: str) -> ModuleType:
    """The family module of ``architecture`` (one of :data:`FAMILY_MODULES`).

    Raises:
        KeyError: not a family of this package.
    """
    return importlib.import_module(FAMILY_MODULES[architecture])


def family_for_model_type(model_type: str) -> ModuleType | None:
    """The family module whose checkpointer ``model_type`` is ``model_type`` (``"QWEN3"``), or
    ``None`` for torchtune's own model types."""
    for arch, kind in MODEL_TYPES.items():
        if kind == str(model_type).upper():
            return family_module(arch)
    return None
