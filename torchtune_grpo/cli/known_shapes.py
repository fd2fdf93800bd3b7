"""The shapes of the models the shipped configs name, for sizing a config before the download.

``tune-grpo estimate-memory`` builds the model on the ``meta`` device from its folder's
``config.json``. Before the download there is no folder: :data:`KNOWN_SHAPES` holds, for each
model a shipped config names (by the Hugging Face repo id of its header's download command),
the fields of the released ``config.json`` that fix the model's shape (dimensions, layers,
heads, vocabulary, tied embeddings, the family's layer pattern). :func:`known_shape` finds the
entry for a config's ``model_dir``; the estimate says when it used one, and reads the folder's
own ``config.json`` once it is there (a ``config.json`` alone in the folder is enough).

Fields that set no shape (token ids, dtypes, RoPE frequencies beyond what the builder checks)
are left out, except where a family's checker needs them to build the model.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["KNOWN_SHAPES", "config_text", "known_shape", "model_node", "repo_from_header"]

_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
              rms_norm_eps=1e-6, rope_theta=1_000_000.0, use_sliding_window=False,
              max_position_embeddings=32768, vocab_size=151936, tie_word_embeddings=True)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
              head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_scaling=None,
              attention_bias=False, use_sliding_window=False, max_position_embeddings=40960,
              vocab_size=151936, tie_word_embeddings=True)
_GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
               hidden_activation="gelu_pytorch_tanh", head_dim=256, query_pre_attn_scalar=256,
               sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0,
               rope_local_base_freq=10_000.0, rope_scaling=None, final_logit_softcapping=None,
               attn_logit_softcapping=None, rms_norm_eps=1e-6, max_position_embeddings=32768,
               vocab_size=262144, tie_word_embeddings=True)

#: HF repo id -> the shape fields of its released ``config.json``.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": {
        **_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2},
    "Qwen/Qwen2.5-1.5B-Instruct": {
        **_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2},
    "Qwen/Qwen2.5-3B-Instruct": {
        **_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 2},
    "Qwen/Qwen3-0.6B": {
        **_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8},
    "Qwen/Qwen3-4B": {
        **_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8},
    "meta-llama/Llama-3.2-3B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "vocab_size": 128256, "tie_word_embeddings": True},
    "google/gemma-3-1b-it": {
        **_GEMMA3, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1},
    "google/gemma-3-270m": {
        **_GEMMA3, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1},
    "microsoft/Phi-4-mini-instruct": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "sliding_window": 262144,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        # LongRoPE: the builder checks the short factors' length (48 = 96 rotated channels / 2)
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48},
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "vocab_size": 200064,
        "tie_word_embeddings": True},
    "HuggingFaceTB/SmolLM3-3B": {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 4, "no_rope_layer_interval": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 5_000_000.0, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
        "mlp_bias": False, "max_position_embeddings": 65536, "vocab_size": 128256,
        "tie_word_embeddings": True},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 100_000.0, "max_position_embeddings": 8192,
        "vocab_size": 49152, "tie_word_embeddings": True},
}

#: Suffixes that name a variant of the same shape (base and instruction-tuned weights).
_VARIANTS = ("-instruct", "-it", "-pt", "-base")


def _stem(name: str) -> str:
    """A folder or repo name without its variant suffix, lower case (``qwen2.5-3b``)."""
    name = name.lower()
    for suffix in _VARIANTS:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def repo_from_header(text: str, model_dir: str | Path) -> str | None:
    """The repo id a config's header downloads into ``model_dir``
    (``tune download ORG/NAME --output-dir DIR``), or None."""
    folder = Path(model_dir).expanduser()
    for repo, out in re.findall(r"tune download (\S+)[^\n]*?--output-dir[ =](\S+)", text):
        if Path(out).expanduser() == folder:
            return repo
    return None


def known_shape(model_dir: str | Path, header: str | None = None
                ) -> tuple[str, dict[str, Any]] | None:
    """``(repo id, config.json fields)`` of the model ``model_dir`` is meant to hold, or None.

    Args:
        model_dir: the folder a config names (it need not exist).
        header: the config file's text: a ``tune download REPO --output-dir DIR`` line whose
            ``DIR`` is ``model_dir`` names the repo.

    The repo named by the header wins; else the folder's name (``/data/Qwen3-4B``) is matched
    with a repo's name, an ``-Instruct``/``-it``/``-pt``/``-Base`` suffix left aside (base and
    instruction-tuned weights have one shape).
    """
    repo = repo_from_header(header, model_dir) if header else None
    if repo in KNOWN_SHAPES:
        return repo, dict(KNOWN_SHAPES[repo])
    stem = _stem(Path(model_dir).expanduser().name)
    for repo, fields in KNOWN_SHAPES.items():
        if _stem(repo.rsplit("/", 1)[-1]) == stem:
            return repo, dict(fields)
    return None


@contextmanager
def model_node(cfg_model: DictConfig,
               header: str | None) -> Iterator[tuple[DictConfig, str | None]]:
    """``(node to build, repo id or None)``: ``cfg_model`` itself, or, when its ``model_dir``
    has no ``config.json`` (not downloaded yet), a copy reading the known shape's
    ``config.json`` from a temporary folder.

    Raises:
        FileNotFoundError: no ``config.json`` and no known shape for the folder's name.
    """
    model_dir = cfg_model.get("model_dir")
    folder = Path(str(model_dir)).expanduser() if model_dir is not None else None
    if folder is None or (folder / "config.json").is_file():
        yield cfg_model, None
        return
    found = known_shape(folder, header)
    if found is None:
        state = "has no config.json" if folder.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"model_dir {folder} {state}: the model's shape comes from its config.json; "
            "download the model, or put its config.json alone in that folder to estimate "
            "before the download (a folder named after one of these models is sized from its "
            f"released shape without one: {', '.join(KNOWN_SHAPES)})")
    repo, fields = found
    with tempfile.TemporaryDirectory(prefix="grpo_shape_") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(fields))
        node = OmegaConf.create(OmegaConf.to_container(cfg_model, resolve=True))
        node.model_dir = tmp
        yield node, repo


def config_text(name: str) -> str | None:
    """The text of the config file ``name`` resolves to (its header names the model's repo),
    or None when ``name`` is no config file."""
    from torchtune_grpo.config.loading import resolve_config_path

    try:
        return resolve_config_path(name).read_text()
    except (OSError, ValueError):
        return None
