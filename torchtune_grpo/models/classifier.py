"""Frozen, inference-only models from Hugging Face folders: one-label sequence-classification
reward models (Llama, Qwen2) and judges, built on the meta device and loaded without random
initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtune_grpo.models.builders import HFArchitecture, _set_rope, hf_architecture

__all__ = [
    "CLASSIFIER_ARCHITECTURES",
    "build_classifier",
    "classifier_hf_to_tune",
    "frozen_model",
    "hf_classifier_architecture",
    "num_labels",
    "read_hf_weights",
]

#: ``architectures[0]`` of a supported reward-model folder -> its causal-LM twin (the
#: architecture whose decoder it shares; see
#: :data:`~torchtune_grpo.models.SUPPORTED_ARCHITECTURES`).
CLASSIFIER_ARCHITECTURES: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
}


def num_labels(cfg: dict[str, Any]) -> int:
    """The number of outputs of an HF classifier config: ``num_labels``, else the size of
    ``id2label``, else 2 (``transformers``' default).
    """
    if cfg.get("num_labels") is not None:
        return int(cfg["num_labels"])
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    return 2


def hf_classifier_architecture(cfg: dict[str, Any], *, where: str = "config.json",
                               max_seq_len: int | None = None) -> HFArchitecture:
    """Check a reward-model ``config.json`` and map it onto torchtune's builders.

    Args:
        cfg: the parsed ``config.json``.
        where: how to name the file in error messages.
        max_seq_len: the context (RoPE cache length); ``None`` takes
            ``max_position_embeddings``.

    Returns:
        The :class:`~torchtune_grpo.models.HFArchitecture` of the folder's decoder (its
        ``architecture`` is the sequence-classification class).

    Raises:
        ValueError: the architecture is not a supported sequence classifier, the classifier
            has more than one label, or the decoder is not supported (as
            :func:`~torchtune_grpo.models.hf_architecture` says).
    """
    archs = list(cfg.get("architectures") or [])
    arch = archs[0] if archs else None
    if arch not in CLASSIFIER_ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures={archs} is not a supported reward model; a reward model "
            f"folder must be one of {sorted(CLASSIFIER_ARCHITECTURES)} with num_labels 1 (a "
            "causal LM folder is a policy or a judge, not a reward model)"
        )
    labels = num_labels(cfg)
    if labels != 1:
        raise ValueError(
            f"{where}: {arch} has num_labels={labels}; a reward model must output one score "
            "(num_labels 1, one id2label entry). A classifier over several labels is not "
            "supported"
        )
    causal = {**cfg, "architectures": [CLASSIFIER_ARCHITECTURES[arch]]}
    base = hf_architecture(causal, where=where, max_seq_len=max_seq_len)
    return HFArchitecture(architecture=arch, family=base.family, model_type=base.model_type,
                          builder_kwargs=base.builder_kwargs, rope=base.rope)


def build_classifier(arch: HFArchitecture, *, bias: bool = False) -> nn.Module:
    """The torchtune decoder of a reward model, with a one-output ``output`` projection.

    Builds on the current default device (use the meta device, then :func:`frozen_model`).

    Args:
        arch: from :func:`hf_classifier_architecture`.
        bias: give the output projection a bias (folders whose weights hold ``score.bias``).

    Returns:
        A :class:`torchtune.modules.TransformerDecoder` mapping ``[b, s]`` ids to ``[b, s, 1]``
        scores.
    """
    kw = dict(arch.builder_kwargs)
    if arch.family == "llama":
        from torchtune.models.llama2._component_builders import llama2_classifier

        model = llama2_classifier(
            num_classes=1, vocab_size=kw["vocab_size"], num_layers=kw["num_layers"],
            num_heads=kw["num_heads"], num_kv_heads=kw["num_kv_heads"],
            embed_dim=kw["embed_dim"], max_seq_len=kw["max_seq_len"],
            intermediate_dim=kw["intermediate_dim"], norm_eps=kw["norm_eps"],
        )
        model = _set_rope(model, arch)  # llama2_classifier's RoPE has base 10000, unscaled
    else:
        from torchtune.models.qwen2._component_builders import qwen2

        model = qwen2(**{**kw, "tie_word_embeddings": False})
        model.output = nn.Linear(kw["embed_dim"], 1, bias=False)
    if bias:
        model.output = nn.Linear(kw["embed_dim"], 1, bias=True)
    return model


def classifier_hf_to_tune(state_dict: dict[str, torch.Tensor],
                          arch: HFArchitecture) -> dict[str, torch.Tensor]:
    """HF reward-model weights in torchtune's names: ``score.*`` -> ``output.*``, the decoder as for
    the causal model.

    Args:
        state_dict: the folder's weights (:func:`read_hf_weights`).
        arch: from :func:`hf_classifier_architecture`.

    Raises:
        ValueError: ``score.weight`` is missing or not ``[1, embed_dim]``.
    """
    kw = arch.builder_kwargs
    sd = dict(state_dict)
    score = sd.get("score.weight")
    if score is None or tuple(score.shape) != (1, kw["embed_dim"]):
        got = None if score is None else list(score.shape)
        raise ValueError(
            f"the {arch.architecture} weights need `score.weight` of shape "
            f"[1, {kw['embed_dim']}], got {got}"
        )
    score_bias = sd.pop("score.bias", None)
    heads = dict(num_heads=kw["num_heads"], num_kv_heads=kw["num_kv_heads"], dim=kw["embed_dim"])
    if arch.family == "llama":
        from torchtune.rlhf.utils import reward_hf_to_tune

        out = reward_hf_to_tune(sd, **heads)
    else:
        from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune

        sd.pop("score.weight")
        out = qwen2_hf_to_tune(sd, **heads, tie_word_embeddings=True)
        out["output.weight"] = score
    if score_bias is not None:
        out["output.bias"] = score_bias.reshape(1)
    return out


def read_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All weights of an HF folder (``*.safetensors``, else ``*.bin``), on the CPU.

    Args:
        model_dir: the folder.

    Raises:
        FileNotFoundError: the folder has no weight file.
    """
    from torchtune_grpo.models.checkpointer import weight_files

    folder = Path(model_dir).expanduser()
    weights: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        path = folder / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            weights.update(load_file(str(path), device="cpu"))
        else:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
    return weights


def _check_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """A ValueError naming ``where`` and the first keys or shapes that do not match."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the weights of {where} do not match its config.json: "
            + (f"missing {missing[:5]} " if missing else "")
            + (f"unexpected {unexpected[:5]}" if unexpected else "")
        )
    for name, shape in expected.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise ValueError(f"the weights of {where} do not match its config.json: {name!r} "
                             f"has shape {list(got)}, the model {list(shape)}")


def frozen_model(build: Callable[[], nn.Module], state_dict: dict[str, torch.Tensor], *,
                 device: torch.device, dtype: torch.dtype, where: str) -> nn.Module:
    """Build a model on the meta device, materialise it on ``device`` in ``dtype``, load its weights
    and freeze it (eval mode, ``requires_grad=False``).

    Args:
        build: makes the model (a torchtune decoder).
        state_dict: its weights in torchtune's names (cast to ``dtype``).
        device: where the model lives.
        dtype: its parameter dtype.
        where: how to name the model in error messages (its folder).

    Raises:
        ValueError: the weights' names or shapes do not match the model.
    """
    from torchtune import training

    with training.set_default_dtype(dtype), torch.device("meta"):
        model = build()
    _check_weights(model, state_dict, where)
    model.to_empty(device=device)
    with training.set_default_dtype(dtype), device:
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    model.requires_grad_(False)
    return model
