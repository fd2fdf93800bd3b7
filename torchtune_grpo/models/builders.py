"""torchtune models built from a Hugging Face folder's ``config.json``.

:func:`hf_architecture` maps ``config.json`` onto torchtune's builders (Llama, Qwen2) or this
package's families, sets the folder's RoPE where a builder fixes it, and refuses, before any
weight is read, what none of them computes. :func:`hf_model` returns the policy model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from torchtune_grpo.errors import CheckpointError
from torchtune_grpo.models.families import (
    FAMILY_MODULES,
    HF_MODEL_TYPES,
    MODEL_TYPES,
    family_module,
)
from torchtune_grpo.policy.decoder import PolicyDecoder, policy_decoder

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFArchitecture",
    "hf_architecture",
    "hf_model",
    "hf_model_type",
    "lora_hf_model",
    "read_hf_config",
]

#: ``architectures[0]`` of a supported ``config.json`` -> (family, torchtune checkpointer
#: ``model_type``). The model type picks torchtune's HF <-> torchtune weight converter.
#: The families of :mod:`torchtune_grpo.models.families` are named by their module.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LLAMA3_2"),
    "Qwen2ForCausalLM": ("qwen2", "QWEN2"),
    **{arch: (module.rsplit(".", 1)[1], MODEL_TYPES[arch])
       for arch, module in FAMILY_MODULES.items()},
}
#: ``model_type`` values of ``config.json`` accepted when ``architectures`` is missing.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", **HF_MODEL_TYPES}


def _out_of_scope(arch: str | None, model_type: str) -> bool:
    """Mixture-of-experts and vision/multimodal architectures: never a plain decoder here."""
    arch_parts = ("Moe", "VL", "Vision", "ConditionalGeneration", "Omni")
    type_parts = ("moe", "_vl", "vision", "omni")
    return (any(part in (arch or "") for part in arch_parts)
            or any(part in model_type for part in type_parts))


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model folder.

    Args:
        model_dir: the folder (as downloaded by ``tune download`` or written by
            ``tune-grpo prepare-model``).

    Raises:
        FileNotFoundError: the folder or its ``config.json`` is missing.
        CheckpointError: (a ``ValueError``) ``config.json`` is not valid JSON.
    """
    folder = Path(model_dir).expanduser()
    path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"model_dir {folder} does not exist (download the model or fix "
                                "the path)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: model_dir must be a Hugging Face model folder "
                                "with a config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the file is truncated or "
                              "damaged; copy it from an intact copy of the model, or download "
                              "the model again") from None


@dataclass(frozen=True)
class HFArchitecture:
    """What a ``config.json`` says, in torchtune's terms.

    Attributes:
        architecture: the HF class name (``LlamaForCausalLM``, ...).
        family: which builders make it (``"llama"``, ``"qwen2"``, ``"qwen3"``, ...).
        model_type: the checkpointer's ``model_type`` (``LLAMA3_2``, ``QWEN2``, ``QWEN3``, ...).
        builder_kwargs: arguments of the component builder (dimensions, head counts,
            ``rope_base``, ``norm_eps``, ``tie_word_embeddings``, ``max_seq_len``, ...).
        rope: for the Llama family, ``None`` for plain RoPE, else the Llama 3 scaling
            parameters (``scale_factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``old_context_len``).
        final_logit_softcap: the output head's final-logit soft-cap (Gemma 2), else ``None``.
    """

    architecture: str
    family: str
    model_type: str
    builder_kwargs: dict[str, Any] = field(default_factory=dict)
    rope: dict[str, float] | None = None
    final_logit_softcap: float | None = None


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling or None)`` from transformers 4 (``rope_theta`` +
    ``rope_scaling``) or transformers 5 (``rope_parameters``) style configs."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", 10_000.0))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def hf_architecture(cfg: dict[str, Any], *, where: str = "config.json",
                    max_seq_len: int | None = None) -> HFArchitecture:
    """Map an HF ``config.json`` onto torchtune's builders, or say why it cannot be.

    Args:
        cfg: the parsed ``config.json``.
        where: how to name the file in error messages.
        max_seq_len: the model's context (RoPE cache length); ``None`` takes
            ``max_position_embeddings``.

    Raises:
        ValueError: the architecture, RoPE scaling or a dimension is not supported; the
            message names what the config says and what is supported.
    """
    archs = list(cfg.get("architectures") or [])
    arch = archs[0] if archs else _MODEL_TYPES.get(str(cfg.get("model_type")))
    if arch not in SUPPORTED_ARCHITECTURES and _out_of_scope(arch, str(cfg.get("model_type"))):
        raise ValueError(
            f"{where}: architectures={archs} (model_type={cfg.get('model_type')!r}) is out of "
            "scope: mixture-of-experts and vision models are not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures={archs} (model_type={cfg.get('model_type')!r}) is not "
            f"supported; supported: {sorted(SUPPORTED_ARCHITECTURES)} (model_type "
            f"{sorted(_MODEL_TYPES)})"
        )
    family, model_type = SUPPORTED_ARCHITECTURES[arch]

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{where}: key {key!r} is missing; an {arch} config needs it")
        return cfg[key]

    dim, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if dim % heads:
        raise ValueError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads "
                         f"{heads}")
    ours = arch in FAMILY_MODULES  # a family of this package checks the rest itself
    head_dim = cfg.get("head_dim")
    if not ours and head_dim is not None and int(head_dim) != dim // heads:
        raise ValueError(
            f"{where}: head_dim {head_dim} differs from hidden_size / num_attention_heads = "
            f"{dim // heads}; torchtune's {family} builder supports only the latter"
        )
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu" and not ours:
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    theta, scaling = _rope_settings(cfg)
    tied = cfg.get("tie_word_embeddings")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(need("vocab_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        embed_dim=dim,
        intermediate_dim=int(need("intermediate_size")),
        max_seq_len=int(max_seq_len or cfg.get("max_position_embeddings") or 4096),
        rope_base=theta,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # absent means untied: LlamaConfig's and Qwen2Config's default
        tie_word_embeddings=bool(tied),
    )
    rope, final_logit_softcap = None, None
    if family == "llama":
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{where}: attention_bias/mlp_bias is not supported for {arch} "
                             "(torchtune's Llama builders have no biases)")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for "
                                 f"{arch}; supported: none (plain RoPE) or 'llama3'")
            rope = dict(
                scale_factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                old_context_len=int(scaling.get("original_max_position_embeddings", 8192)),
            )
    elif ours:
        kwargs.update(family_module(arch).check_config(cfg, where=where, heads=heads,
                                                       rope_scaling=scaling))
        # the output head's cap is the policy's, not the decoder builder's
        final_logit_softcap = kwargs.pop("final_logit_softcap", None)
    else:  # qwen2
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported for {arch} "
                             "(torchtune's Qwen2 builder has plain RoPE only)")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported (torchtune's "
                             "Qwen2 attention is full attention)")
    return HFArchitecture(architecture=arch, family=family, model_type=model_type,
                          builder_kwargs=kwargs, rope=rope,
                          final_logit_softcap=None if final_logit_softcap is None
                          else float(final_logit_softcap))


def hf_model_type(model_dir: str | Path) -> str:
    """The torchtune checkpointer ``model_type`` of an HF folder (``LLAMA3_2``, ``QWEN2``, or one
    of this package's families such as ``QWEN3``).

    Raises:
        FileNotFoundError / ValueError: as :func:`read_hf_config` and :func:`hf_architecture`.
    """
    where = str(Path(model_dir).expanduser() / "config.json")
    return hf_architecture(read_hf_config(model_dir), where=where).model_type


def _set_rope(model: nn.Module, arch: HFArchitecture) -> nn.Module:
    """Give every attention layer of a Llama-family model the folder's RoPE (one shared module,
    as torchtune's builders share theirs)."""
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.modules import RotaryPositionalEmbeddings

    kw = arch.builder_kwargs
    head_dim = kw["embed_dim"] // kw["num_heads"]
    if arch.rope is None:
        rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=kw["max_seq_len"],
                                          base=kw["rope_base"])
    else:
        rope = Llama3ScaledRoPE(dim=head_dim, max_seq_len=kw["max_seq_len"],
                                base=kw["rope_base"], **arch.rope)
    for layer in model.layers:
        layer.attn.pos_embeddings = rope
    return model


def _arch(model_dir: str | Path, max_seq_len: int | None) -> HFArchitecture:
    where = str(Path(model_dir).expanduser() / "config.json")
    return hf_architecture(read_hf_config(model_dir), where=where, max_seq_len=max_seq_len)


def hf_model(model_dir: str, max_seq_len: int | None = None) -> PolicyDecoder:
    """The policy model with the architecture of the HF folder ``model_dir`` (``config.json`` only;
    the checkpointer loads the weights).

    Args:
        model_dir: the HF model folder.
        max_seq_len: context length (RoPE cache); default ``max_position_embeddings``.

    Returns:
        A :class:`~torchtune_grpo.policy.decoder.PolicyDecoder` with torchtune's parameter
        names, whose head has the folder's final-logit soft-cap.
    """
    arch = _arch(model_dir, max_seq_len)
    return _policy(_decoder(arch), arch)


def _decoder(arch: HFArchitecture) -> nn.Module:
    """The torchtune decoder of ``arch``, from its family's builder."""
    if arch.architecture in FAMILY_MODULES:
        return family_module(arch.architecture).build(**arch.builder_kwargs)
    if arch.family == "qwen2":
        from torchtune.models.qwen2._component_builders import qwen2

        return qwen2(**arch.builder_kwargs)
    from torchtune.models.llama3_2._component_builders import llama3_2

    return _set_rope(llama3_2(**arch.builder_kwargs), arch)


def _policy(decoder: nn.Module, arch: HFArchitecture) -> PolicyDecoder:
    return policy_decoder(decoder, final_logit_softcap=arch.final_logit_softcap)


def lora_hf_model(
    model_dir: str,
    lora_attn_modules: list[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    max_seq_len: int | None = None,
) -> PolicyDecoder:
    """:func:`hf_model` with LoRA (or DoRA) adapters.

    Args:
        model_dir: the HF model folder.
        lora_attn_modules: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj`` (one or more).
        apply_lora_to_mlp: adapters on the MLP projections too.
        apply_lora_to_output: an adapter on the output projection (untied models only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters (rank ``r``,
            scale ``alpha / r``, input dropout, DoRA, NF4 frozen base weights).
        max_seq_len: context length; default ``max_position_embeddings``.
    """
    arch = _arch(model_dir, max_seq_len)
    lora = dict(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank,
                lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora)
    return _policy(_lora_decoder(arch, lora, quantize_base), arch)


def _lora_decoder(arch: HFArchitecture, lora: dict[str, Any], quantize_base: bool) -> nn.Module:
    """The torchtune LoRA decoder of ``arch``, from its family's ``lora_*`` builder."""
    if arch.architecture in FAMILY_MODULES:
        return family_module(arch.architecture).build_lora(
            **arch.builder_kwargs, **lora, quantize_base=quantize_base)
    if arch.family == "qwen2":
        from torchtune.models.qwen2._component_builders import lora_qwen2

        return lora_qwen2(**arch.builder_kwargs, **lora, quantize_base=quantize_base)
    from torchtune.models.llama3_2._component_builders import lora_llama3_2

    return _set_rope(lora_llama3_2(**arch.builder_kwargs, **lora, quantize_base=quantize_base),
                     arch)
