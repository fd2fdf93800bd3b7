"""A random-weight model of a family in SmolLM2-135M's shape, for the real-model step
benchmark (``benchmarks/real_step.py --family qwen3`` or ``--family llama``).

The folder holds SmolLM2's tokenizer files (so both frameworks see the same prompts) and a
``config.json`` of the family with SmolLM2's dimensions (30 layers, width 576, 9 query and 3
key/value heads of 64, MLP 1536, vocabulary 49,152, tied embeddings), and seeded random weights
(normal, std 0.02; norm scales 1) written in the family's HF names by this package's own weight
tables (Llama: torchtune's converter). Timings depend on the values only through when rows
stop: random weights never emit the stop token, so every row decodes every position, in both
frameworks and in every family alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: SmolLM2-135M's dimensions in config.json terms.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)
#: The families this module writes: architecture and extra config.json keys.
FAMILIES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                  rope_theta=100000.0, attention_bias=False, use_sliding_window=False),
    # SmolLM2's own architecture with random weights: the same work per step as the Qwen3
    # folder (no row stops early), so the two compare the architectures alone
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  rope_theta=100000.0, attention_bias=False, mlp_bias=False),
}


def random_family_folder(smollm2_dir: Path, family: str, out: Path, seed: int = 0,
                         shape: dict | None = None) -> Path:
    """Write (once) the ``family`` folder in SmolLM2's shape at ``out``; return ``out``.

    Args:
        smollm2_dir: the SmolLM2-135M-Instruct HF folder (its tokenizer files are copied).
        family: a key of :data:`FAMILIES`.
        out: the folder to write; reused when its ``config.json`` already matches.
        seed: the weights' seed.
        shape: config.json dimensions instead of :data:`SMOLLM2_SHAPE` (tests).
    """
    import torch
    from safetensors.torch import save_file

    from torchtune_grpo.models import hf_model
    from torchtune_grpo.models.families import family_module

    config = {**(shape or SMOLLM2_SHAPE), **FAMILIES[family], "torch_dtype": "float32"}
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in smollm2_dir.iterdir():
        if path.is_file() and "safetensors" not in path.name and path.name != "config.json":
            shutil.copy(path, out / path.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = hf_model(str(out))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    state = model.state_dict()
    try:
        hf_state = family_module(config["architectures"][0]).NAMES.tune_to_hf(state)
    except KeyError:  # torchtune's own Llama: its converter (q/k rows permuted back)
        from torchtune.models.convert_weights import tune_to_hf

        hf_state = tune_to_hf(state, num_heads=config["num_attention_heads"],
                              num_kv_heads=config["num_key_value_heads"],
                              dim=config["hidden_size"], head_dim=config["head_dim"])
    save_file({k: v.contiguous() for k, v in hf_state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
