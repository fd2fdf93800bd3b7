"""Real models from Hugging Face folders: architecture from ``config.json``, the tokenizer and
its chat template from the tokenizer files, and packaged models written as such folders."""

from torchtune_grpo.models.builders import (
    SUPPORTED_ARCHITECTURES,
    HFArchitecture,
    hf_architecture,
    hf_model,
    hf_model_type,
    lora_hf_model,
    read_hf_config,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFArchitecture",
    "hf_architecture",
    "hf_model",
    "hf_model_type",
    "lora_hf_model",
    "read_hf_config",
]
