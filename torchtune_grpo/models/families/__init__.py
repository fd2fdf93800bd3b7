"""Model families that torchtune 0.6.1 lacks or gets wrong, built from torchtune's modules.

Each family is a module of component builders (plain and LoRA) plus the config checks that
:func:`torchtune_grpo.models.hf_architecture` calls, and a module with its HF <-> torchtune
weight names and checkpointer. :func:`torchtune_grpo.models.hf_model` dispatches to them from a
folder's ``config.json``; nothing here reads weights.

* :mod:`~torchtune_grpo.models.families.qwen3`: ``Qwen3ForCausalLM`` (dense Qwen3), per-head
  RMSNorm on queries and keys before RoPE;
  :mod:`~torchtune_grpo.models.families.qwen3_weights` its weights.
* :mod:`~torchtune_grpo.models.families.gemma3`: ``Gemma3ForCausalLM`` (Gemma 3 text): Gemma
  norms, q/k norms before RoPE, sliding-window and global layers with their own RoPE bases
  (:mod:`~torchtune_grpo.models.families.gemma3_layers`);
  :mod:`~torchtune_grpo.models.families.gemma3_weights` its weights.
"""
