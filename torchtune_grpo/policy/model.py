"""Building the policy (and reference) model, plain or FSDP2-sharded, and its token rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtune import config, modules, training
from torchtune.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_params,
    set_trainable_params,
)

from torchtune_grpo.errors import CheckpointError
from torchtune_grpo.policy.decoder import PolicyDecoder, policy_decoder
from torchtune_grpo.token_rules import allowed_token_mask, logit_bias_from_mask, stop_token_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def meta_model(cfg_model: DictConfig) -> nn.Module:
    """The ``model`` config instantiated on the meta device: its shape, no memory, no load."""
    with torch.device("meta"):
        return config.instantiate(cfg_model)


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` has LoRA/DoRA adapters (torchtune's ``lora_*`` builders)."""
    return bool(get_adapter_params(model))


def _check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor],
                      adapter_names: set[str] = frozenset()) -> None:
    """Raise a :class:`~torchtune_grpo.errors.CheckpointError` naming the first parameter whose
    name or shape does not match.

    Adapter parameters (``adapter_names``) may be absent: a base checkpoint has none.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict) - set(adapter_names))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            "the checkpoint does not match the config's `model` (check `model` and "
            "`checkpointer.checkpoint_files`): "
            + (f"missing {missing[:5]} " if missing else "")
            + (f"unexpected {unexpected[:5]}" if unexpected else "")
        )
    for name, shape in expected.items():
        if name not in state_dict:  # an adapter the base checkpoint does not have
            continue
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise CheckpointError(
                f"the checkpoint does not match the config's `model`: parameter {name!r} has "
                f"shape {list(got)} in the checkpoint but {list(shape)} in the model"
            )


def build_model(
    cfg_model: DictConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    trainable: bool = True,
    activation_checkpointing: bool = False,
    fsdp_cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    adapter_state_dict: dict[str, torch.Tensor] | None = None,
    dp_mesh: Any = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> PolicyDecoder:
    """Instantiate ``cfg_model`` as a :class:`~torchtune_grpo.policy.decoder.PolicyDecoder`, load
    ``state_dict`` and prepare it for GRPO (LoRA/DoRA: only the adapters train).

    Args:
        cfg_model: the ``model`` config node.
        state_dict: full torchtune-format weights (base weights for LoRA).
        device: target device.
        dtype: parameter dtype.
        world_size: ranks; above 1 the model is FSDP2-sharded.
        trainable: False freezes it and puts it in eval mode.
        activation_checkpointing: wrap transformer layers (trainable models only).
        fsdp_cpu_offload: keep FSDP shards on CPU.
        reshard_after_forward: FSDP2 ``reshard_after_forward``.
        adapter_state_dict: LoRA adapter weights to resume from.
        dp_mesh: the FSDP2 ``DeviceMesh`` to shard over (None: the default process group).
        reduce_dtype: FSDP2 gradient reduce-scatter dtype (the config's ``fsdp_reduce_dtype``;
            see :func:`shard_policy`).
    """
    checkpointing = trainable and activation_checkpointing
    if world_size > 1:
        with training.set_default_dtype(dtype), torch.device("meta"):
            model = policy_decoder(config.instantiate(cfg_model))
        adapters = {n for n, _ in get_adapter_params(model).items()}
        _check_state_dict(model, state_dict, adapters)
        if adapters:
            set_trainable_params(model, get_adapter_params(model))
        if checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        shard_policy(model, dtype=dtype, reduce_dtype=reduce_dtype, cpu_offload=fsdp_cpu_offload,
                     reshard_after_forward=reshard_after_forward, dp_mesh=dp_mesh)
        with training.set_default_dtype(dtype), device:
            for module in model.modules():
                if isinstance(module, (LoRALinear, DoRALinear)):
                    module.to_empty(device="cpu" if fsdp_cpu_offload else device)
                    module.initialize_parameters()
                if hasattr(module, "rope_init"):
                    module.rope_init()
        training.load_from_full_model_state_dict(
            model, state_dict, device, strict=not adapters, cpu_offload=fsdp_cpu_offload
        )
        if adapter_state_dict:
            training.load_from_full_model_state_dict(
                model, adapter_state_dict, device, strict=False, cpu_offload=fsdp_cpu_offload
            )
    else:
        with training.set_default_dtype(dtype), device:
            model = policy_decoder(config.instantiate(cfg_model))
        adapters = {n for n, _ in get_adapter_params(model).items()}
        _check_state_dict(model, state_dict, adapters)
        model.load_state_dict(state_dict, strict=not adapters)
        if adapter_state_dict:
            model.load_state_dict(adapter_state_dict, strict=False)
        if adapters:
            set_trainable_params(model, get_adapter_params(model))
        if checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model


def shard_policy(model: nn.Module, *, dtype: torch.dtype, reduce_dtype: torch.dtype,
                 cpu_offload: bool = False, reshard_after_forward: bool = True,
                 dp_mesh: Any = None) -> None:
    """FSDP2-shard ``model`` in place as torchtune's ``training.shard_model`` does (every
    ``layers.i``, then the root; it takes no mixed-precision policy), each with
    ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)``.

    The parameters (built in ``dtype``) are gathered and used in ``dtype``; every backward
    reduce-scatters the gradients in ``reduce_dtype``: with bf16 parameters and a float32
    ``reduce_dtype`` each rank's bf16 gradient is upcast, the ranks' sum (and the average) is
    taken in float32 and rounded to bf16 once, instead of bf16 partial sums rounded at every
    hop of the reduction (one rounding per rank on NCCL's ring). The reduce-scatter's buffer
    is twice as big in float32 (one FSDP unit, a transformer layer, at a time). The reduced
    shard is then cast to the parameters' dtype and added to the sharded ``.grad`` in it:
    the update syncs at every micro-batch's backward (it never calls
    ``set_requires_gradient_sync(False)``), so gradients accumulate over micro-batches in
    ``dtype``. A float32 model is unaffected (FSDP2 drops casts to the same dtype).

    Args:
        model: the policy decoder (on the meta device or materialised).
        dtype: parameter (and compute) dtype.
        reduce_dtype: gradient reduce-scatter dtype.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``.
        reshard_after_forward: FSDP2 ``reshard_after_forward``.
        dp_mesh: the ``DeviceMesh`` to shard over (None: the default process group).
    """
    kwargs: dict[str, Any] = dict(
        reshard_after_forward=reshard_after_forward, mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype))
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = [m for n, m in reversed(list(model.named_modules()))
              if training.get_shard_conditions(n, m, names_to_match=None)]
    if not layers:
        raise ValueError("no transformer layer (`layers.i`) to shard in the model")
    for module in layers:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def output_vocab_size(model: nn.Module) -> int:
    """``V``: rows of the output projection (tied or not)."""
    out = model.output
    weight = getattr(out, "weight", None)
    if weight is None:  # torchtune's TiedLinear
        weight = out.tied_module.weight
    return int(weight.shape[0])


@dataclass
class TokenRules:
    """What sampling may emit and where it stops.

    Attributes:
        allowed: ``[V]`` bool, ids sampling may emit (ordinary vocabulary and stop tokens).
        logit_bias: ``[V]`` float32 on the device, 0 or ``-inf``.
        stop_tokens: ``[s]`` stop ids on the device.
        pad_id: padding id.
    """

    allowed: torch.Tensor
    logit_bias: torch.Tensor
    stop_tokens: torch.Tensor
    pad_id: int


def token_rules(tokenizer: Any, model: nn.Module, device: torch.device) -> TokenRules:
    """The :class:`TokenRules` of ``tokenizer`` for ``model``'s vocabulary."""
    allowed = allowed_token_mask(tokenizer, output_vocab_size(model))
    return TokenRules(
        allowed=allowed,
        logit_bias=logit_bias_from_mask(allowed).to(device),
        stop_tokens=torch.tensor(stop_token_ids(tokenizer), device=device),
        pad_id=int(getattr(tokenizer, "pad_id", 0) or 0),
    )
