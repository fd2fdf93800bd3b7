"""Model families that torchtune 0.6.1 lacks or gets wrong, built from torchtune's modules.

Each family module gives ``ARCHITECTURE`` (the HF class it builds), ``check_config(cfg, *,
where, heads, rope_scaling) -> dict`` (refuses what it does not compute, in one line naming the
field, and returns the builder arguments beyond the common ones; ``final_logit_softcap`` goes to
the output head), ``build`` and ``build_lora`` (via
:func:`~torchtune_grpo.models.decoder.build_decoder`) and ``NAMES`` (its
:class:`~torchtune_grpo.models.hf_weights.WeightNames`). :data:`FAMILY_MODULES` lists them.
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
