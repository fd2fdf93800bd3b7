"""Real models from Hugging Face folders: the architecture from ``config.json``
(:func:`hf_model`) and its weights (:func:`hf_checkpointer`), the tokenizer and the model's own
chat template from its tokenizer files (:func:`hf_tokenizer`), and packaged GGUF models written
as such folders (:func:`prepare_model`, ``tune-grpo prepare-model``)."""

from torchtune_grpo.models.builders import (
    SUPPORTED_ARCHITECTURES,
    HFArchitecture,
    hf_architecture,
    hf_model,
    hf_model_type,
    lora_hf_model,
    read_hf_config,
)
from torchtune_grpo.models.checkpointer import hf_checkpointer
from torchtune_grpo.models.gguf import gguf_to_hf
from torchtune_grpo.models.packaged import find_packaged_gguf, prepare_model
from torchtune_grpo.models.tokenizer import HFTokenizer, hf_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFArchitecture",
    "HFTokenizer",
    "find_packaged_gguf",
    "gguf_to_hf",
    "hf_checkpointer",
    "hf_architecture",
    "hf_model",
    "hf_model_type",
    "hf_tokenizer",
    "lora_hf_model",
    "prepare_model",
    "read_hf_config",
]
