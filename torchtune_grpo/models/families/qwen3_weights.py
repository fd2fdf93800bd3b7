"""Qwen3 weights: HF <-> torchtune names, and a checkpointer for HF Qwen3 folders.

torchtune 0.6.1 has no Qwen3 model type, and its Qwen2 converter rejects the ``q_norm`` /
``k_norm`` weights. :class:`Qwen3HFCheckpointer` reads and writes HF folders as torchtune's
``FullModelHFCheckpointer`` does (the same files, shard names, index, adapter files and copied
config/tokenizer files), with this family's names:

============================================== ===========================================
HF (``Qwen3ForCausalLM``)                      torchtune (:mod:`~.families.qwen3`)
============================================== ===========================================
``model.embed_tokens.weight``                  ``tok_embeddings.weight``
``model.layers.{i}.self_attn.q_proj.weight``   ``layers.{i}.attn.q_proj.proj.weight``
``model.layers.{i}.self_attn.q_norm.weight``   ``layers.{i}.attn.q_proj.norm.scale``
``model.layers.{i}.self_attn.k_proj.weight``   ``layers.{i}.attn.k_proj.proj.weight``
``model.layers.{i}.self_attn.k_norm.weight``   ``layers.{i}.attn.k_proj.norm.scale``
``model.layers.{i}.self_attn.v_proj.weight``   ``layers.{i}.attn.v_proj.weight``
``model.layers.{i}.self_attn.o_proj.weight``   ``layers.{i}.attn.output_proj.weight``
``model.layers.{i}.mlp.gate_proj.weight``      ``layers.{i}.mlp.w1.weight``
``model.layers.{i}.mlp.down_proj.weight``      ``layers.{i}.mlp.w2.weight``
``model.layers.{i}.mlp.up_proj.weight``        ``layers.{i}.mlp.w3.weight``
``model.layers.{i}.input_layernorm.weight``    ``layers.{i}.sa_norm.scale``
``model.layers.{i}.post_attention_layernorm``  ``layers.{i}.mlp_norm.scale``
``model.norm.weight``                          ``norm.scale``
``lm_head.weight`` (untied only)               ``output.weight``
============================================== ===========================================

Tensors keep their values, shapes and dtype (Qwen3's rotary embedding rotates halves, as
torchtune's Qwen2 RoPE does, so no q/k permutation is needed).
"""

from __future__ import annotations

from typing import Any

from torchtune_grpo.models.families.hf_weights import HFFamilyCheckpointer, WeightNames

__all__ = [
    "Qwen3HFCheckpointer",
    "QWEN3_NAMES",
    "qwen3_hf_to_tune",
    "qwen3_tune_to_hf",
    "qwen3_tune_to_peft_adapter",
]

_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # suffix after model.layers.{i}. -> suffix after layers.{i}.
    "self_attn.q_proj.weight": "attn.q_proj.proj.weight",
    "self_attn.q_norm.weight": "attn.q_proj.norm.scale",
    "self_attn.k_proj.weight": "attn.k_proj.proj.weight",
    "self_attn.k_norm.weight": "attn.k_proj.norm.scale",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}

#: This family's names (:class:`~torchtune_grpo.models.families.hf_weights.WeightNames`).
QWEN3_NAMES = WeightNames(
    family="Qwen3", model_type="QWEN3", global_names=_GLOBAL, layer_names=_LAYER,
    tied_by_default=False, not_part="part of a dense Qwen3ForCausalLM (no biases, no experts)")
#: HF -> torchtune names (:meth:`WeightNames.hf_to_tune`).
qwen3_hf_to_tune = QWEN3_NAMES.hf_to_tune
#: torchtune -> HF names (:meth:`WeightNames.tune_to_hf`).
qwen3_tune_to_hf = QWEN3_NAMES.tune_to_hf
#: torchtune adapter -> PEFT names (:meth:`WeightNames.tune_to_peft_adapter`).
qwen3_tune_to_peft_adapter = QWEN3_NAMES.tune_to_peft_adapter


def Qwen3HFCheckpointer(**kwargs: Any) -> HFFamilyCheckpointer:  # noqa: N802 - stands for a class
    """The checkpointer of Qwen3 HF folders (what ``hf_checkpointer`` returns for
    ``model_type: QWEN3``): :class:`HFFamilyCheckpointer` with :data:`QWEN3_NAMES`."""
    return HFFamilyCheckpointer(QWEN3_NAMES, **kwargs)
