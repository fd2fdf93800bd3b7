"""CPU decoding on oneDNN-reordered weights, and decoder layers fused for the decode step.

:func:`packed_linear_weights` gives a rollout's small-batch linears reordered weights and
plain torchtune layers a fused decode forward (:func:`fused_decode_layer`); every module gets
its own ``forward`` back on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TransformerSelfAttentionLayer,
)

from torchtune_grpo.models.layers import NormedProjection
from torchtune_grpo.policy.kv_cache import (
    SpanKVCache,
    attend_projected,
    rotate,
    rotates_heads_alike,
)

#: Inputs of at most this many rows (decode steps) use the packed weights of
#: :func:`packed_linear_weights`; larger ones (prefill) the layer's own ``F.linear``.
PACKED_MAX_ROWS = 64


def attend_decode_step(attn: MultiHeadAttention, qkv: torch.Tensor, *, mask: torch.Tensor,
                       input_pos: torch.Tensor | None) -> torch.Tensor | None:
    """``attend_projected`` (:mod:`torchtune_grpo.policy.kv_cache`) for one decode step, from the
    stacked projection, in few ops (query and key heads rotated together, the mask broadcast over
    the heads).

    Args:
        attn (MultiHeadAttention): the module; its ``kv_cache`` a span-decoding
            :class:`~torchtune_grpo.policy.kv_cache.SpanKVCache`.
        qkv (Tensor): ``[b, 1, (heads + 2 * kv_heads) * head_dim]`` query|key|value projection.
        mask (Tensor): ``[b, 1, S]`` bool, True where the new position may attend.
        input_pos (Tensor | None): ``[b, 1]`` position ids.

    Returns:
        Tensor | None: ``[b, 1, heads * head_dim]``, the input of the output projection; None
        where the shortcut does not apply (another cache or phase, q/k norms after RoPE, or a
        position embedding not known to rotate each head alike).
    """
    cache, rope = attn.kv_cache, attn.pos_embeddings
    if (type(cache) is not SpanKVCache or cache.write_pos is not None or cache.prefilling
            or attn.q_norm is not None or attn.k_norm is not None
            or (rope is not None and (not rotates_heads_alike(rope) or input_pos is None))
            or type(attn) is not MultiHeadAttention):  # a soft-capped attention: not SDPA
        return None
    b = qkv.shape[0]
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qk = qkv[..., : (heads + kv_heads) * head_dim].view(b, 1, heads + kv_heads, head_dim)
    if rope is not None:
        qk = rotate(rope, qk, input_pos)
    keys, values = cache.update(  # [b, kv_heads, 1, head_dim] each; the filled span back
        qk[:, 0, heads:].unsqueeze(2),
        qkv[:, 0, (heads + kv_heads) * head_dim :].view(b, kv_heads, 1, head_dim))
    q = qk[:, 0, :heads].reshape(b, kv_heads, heads // kv_heads, head_dim)
    out = nn.functional.scaled_dot_product_attention(
        q, keys, values,
        attn_mask=cache.additive_mask(mask, q.dtype)[:, None])  # [b, kv_heads, g, head_dim]
    return out.view(b, 1, heads * head_dim)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """``x @ W.T + bias`` by oneDNN from ``packed`` = ``_reorder_linear_weight(W)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias + residual`` in one oneDNN call (the sum as a post-op: the same values
    as adding afterwards); ``residual`` is shaped as the output."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


def _packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run ``x @ weight.T`` from a reordered copy of ``weight``."""
    from torch.distributed.tensor import DTensor

    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and not isinstance(weight, DTensor) and torch.backends.mkldnn.is_available())


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> Callable[..., torch.Tensor]:
    """A linear forward that runs small inputs on a oneDNN-reordered copy of ``weight``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor, *_ignored) -> torch.Tensor:
        if x.numel() > PACKED_MAX_ROWS * x.shape[-1] or x.requires_grad:
            return F.linear(x, weight, bias)
        return _onednn_linear(x, packed, bias)

    return forward


def _reordered(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One oneDNN-reordered weight for ``linears`` stacked along their outputs, and the bias.

    Returns:
        ``(packed, bias)``: ``x @ W.T + bias`` of the ``[sum(out), in]`` stacked weight is the
        layers' outputs side by side; ``bias`` is None when no layer has one (a missing one is
        zeros).
    """
    weights = [lin.weight.detach() for lin in linears]
    stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
    packed = torch.ops.mkldnn._reorder_linear_weight(stacked)
    if all(lin.bias is None for lin in linears):
        return packed, None
    bias = torch.cat([lin.bias.detach() if lin.bias is not None
                      else lin.weight.new_zeros(lin.out_features) for lin in linears])
    return packed, bias


def _linear_of(proj: nn.Module) -> nn.Module:
    """The linear layer of a q/k projection: ``proj`` itself, or a :class:`NormedProjection`'s
    ``proj`` (its norm and factor run after the stacked product)."""
    return proj.proj if type(proj) is NormedProjection else proj


def _fusable(layer: nn.Module, adapters: set[int]) -> bool:
    """Whether :func:`fused_decode_layer` computes ``layer``'s forward: a torchtune
    ``TransformerSelfAttentionLayer`` with RMSNorms, no residual scales, exactly a
    ``MultiHeadAttention`` (not a subclass: a soft-capped attention's scores are not SDPA's, so
    its layer keeps its own forward), q/k projections that are plain or a
    :class:`~torchtune_grpo.models.layers.NormedProjection` (Qwen3's per-head norms before RoPE)
    and a ``FeedForward``, all of plain packable ``nn.Linear`` layers (no LoRA), and no hooks."""
    if type(layer) is not TransformerSelfAttentionLayer or "forward" in layer.__dict__:
        return False
    attn, mlp = layer.attn, layer.mlp
    if (type(attn) is not MultiHeadAttention or type(mlp) is not FeedForward
            or type(layer.sa_norm) is not RMSNorm or type(layer.mlp_norm) is not RMSNorm
            or type(layer.sa_scale) is not nn.Identity or type(layer.mlp_scale) is not nn.Identity):
        return False
    linears = [_linear_of(attn.q_proj), _linear_of(attn.k_proj), attn.v_proj, attn.output_proj,
               mlp.w1, mlp.w2]
    if mlp.w3 is not None:
        linears.append(mlp.w3)
    if not all(type(lin) is nn.Linear and id(lin) not in adapters and "forward" not in lin.__dict__
               and _packable(lin.weight) for lin in linears):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


def _stacked_head_norms(attn: MultiHeadAttention) -> tuple[int, torch.Tensor, float] | None:
    """For q and k projections that both end in a per-head torchtune ``RMSNorm`` (same eps, no
    factor): ``(q|k width, [heads + kv_heads, head_dim] scales, eps)``, so that one
    ``rms_norm`` of the stacked q|k heads times the scales gives both norms; else None."""
    q, k = attn.q_proj, attn.k_proj
    if not all(type(p) is NormedProjection and type(p.norm) is RMSNorm and p.factor == 1.0
               and p.head_dim == attn.head_dim for p in (q, k)) or q.norm.eps != k.norm.eps:
        return None
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    scale = torch.cat((q.norm.scale.detach().expand(heads, head_dim),
                       k.norm.scale.detach().expand(kv_heads, head_dim)))
    return (heads + kv_heads) * head_dim, scale, q.norm.eps


def fused_decode_layer(layer: TransformerSelfAttentionLayer) -> Callable[..., torch.Tensor]:
    """A ``forward`` for ``layer`` that runs decode steps as one function on packed weights.

    Stacked ``[q | k | v]`` and ``[gate | up]`` products, residual sums as post-ops, no module
    calls; results agree with the layer's own to float32 rounding. Inputs of more than
    :data:`PACKED_MAX_ROWS` positions, autograd, or a cache other than a rollout's
    :class:`~torchtune_grpo.policy.kv_cache.SpanKVCache` go to the layer's own forward.

    Args:
        layer: a layer :func:`_fusable` accepts.

    Returns:
        ``forward(x [b, s, D], *, mask=None, input_pos=None, **kwargs) -> [b, s, D]``.
    """
    attn, mlp = layer.attn, layer.mlp
    q_lin, k_lin = _linear_of(attn.q_proj), _linear_of(attn.k_proj)
    qkv, qkv_bias = _reordered([q_lin, k_lin, attn.v_proj])
    split = [q_lin.out_features, k_lin.out_features, attn.v_proj.out_features]
    q_finish = attn.q_proj.finish if q_lin is not attn.q_proj else None
    k_finish = attn.k_proj.finish if k_lin is not attn.k_proj else None
    head_norms = _stacked_head_norms(attn)  # Qwen3: both norms in one call
    out, out_bias = _reordered([attn.output_proj])
    gated = mlp.w3 is not None
    up, up_bias = _reordered([mlp.w1, mlp.w3] if gated else [mlp.w1])
    up_split = [mlp.w1.out_features, mlp.w3.out_features] if gated else None
    down, down_bias = _reordered([mlp.w2])
    sa_norm, mlp_norm, activation = layer.sa_norm, layer.mlp_norm, mlp.activation

    def forward(x: torch.Tensor, *, mask: torch.Tensor | None = None,
                input_pos: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if (x.shape[:-1].numel() > PACKED_MAX_ROWS or torch.is_grad_enabled()
                or not isinstance(attn.kv_cache, SpanKVCache) or not attn.cache_enabled
                or (mask is not None and not isinstance(mask, torch.Tensor))):
            return type(layer).forward(layer, x, mask=mask, input_pos=input_pos, **kwargs)
        h = F.rms_norm(x, sa_norm.normalized_shape, sa_norm.scale, sa_norm.eps)
        projected = _onednn_linear(h, qkv, qkv_bias)
        if head_norms is not None:  # per-head q/k norms before RoPE, in one call
            width, scale, eps = head_norms
            qk = projected[..., :width].unflatten(-1, (-1, scale.shape[-1]))
            qk = F.rms_norm(qk, (scale.shape[-1],), None, eps) * scale
            projected = torch.cat((qk.flatten(-2), projected[..., width:]), dim=-1)
        elif q_finish is not None or k_finish is not None:  # other q/k norms before RoPE
            q, k, v = projected.split(split, dim=-1)
            projected = torch.cat((q if q_finish is None else q_finish(q),
                                   k if k_finish is None else k_finish(k), v), dim=-1)
        a = None
        if x.shape[1] == 1 and mask is not None:  # a decode step
            a = attend_decode_step(attn, projected, mask=mask, input_pos=input_pos)
        if a is None:
            q, k, v = projected.split(split, dim=-1)
            a = attend_projected(attn, q, k, v, mask=mask, input_pos=input_pos)
        h = _onednn_linear_add(a, x, out, out_bias)  # + x: the residual
        m = F.rms_norm(h, mlp_norm.normalized_shape, mlp_norm.scale, mlp_norm.eps)
        gu = _onednn_linear(m, up, up_bias)
        if gated:
            gate, value = gu.split(up_split, dim=-1)
            m = activation(gate) * value
        else:
            m = activation(gu)
        return _onednn_linear_add(m, h, down, down_bias)  # + h

    return forward


@contextlib.contextmanager
def packed_linear_weights(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Run ``model``'s small-batch linear layers on weights reordered for oneDNN; undo on exit.

    Every plain float32 CPU ``nn.Linear`` (and ``TiedLinear``) uses the reordered copy for inputs of
    at most :data:`PACKED_MAX_ROWS` rows; plain decoder layers get :func:`fused_decode_layer`.
    Results agree with ``F.linear`` to float32 rounding, so a sampled token can differ on a real
    model. LoRA/DoRA layers, FSDP2 models, other dtypes and devices, and builds without oneDNN are
    untouched. Costs one more copy of the packed weights for the rollout.

    Args:
        model: a torchtune decoder.
        enabled: False makes this a no-op.

    Yields:
        int: the number of linear layers that decode on packed weights (0 when none could).
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtune.modules import TiedLinear

    patched: list[nn.Module] = []
    count = 0
    # FSDP2: the weights are DTensor shards, or plain tensors while gathered for the rollout
    # (rollout_gather_weights); either way they stay on F.linear, so that gathering once or
    # per forward samples the same tokens
    enabled = enabled and not any(isinstance(m, FSDPModule) for m in model.modules())
    try:
        if enabled:
            adapters = {id(sub) for module in model.modules() if hasattr(module, "adapter_params")
                        for sub in module.modules()}  # LoRA/DoRA layers and their adapters
            for layer in model.modules():
                if _fusable(layer, adapters):
                    layer.forward = fused_decode_layer(layer)
                    patched.append(layer)
                    count += 6 + (layer.mlp.w3 is not None)
            fused = {id(sub) for layer in patched for sub in layer.modules()}
            for module in model.modules():
                if (type(module) is nn.Linear and "forward" not in module.__dict__
                        and id(module) not in fused and id(module) not in adapters
                        and _packable(module.weight)):
                    module.forward = _packed_forward(module.weight, module.bias)
                    patched.append(module)
                    count += 1
            for module in model.modules():  # the tied output projection is no submodule
                output = module.__dict__.get("output")
                if (isinstance(output, TiedLinear) and "forward" not in output.linear.__dict__
                        and _packable(output.tied_module.weight)):
                    output.linear.forward = _packed_forward(output.tied_module.weight, None)
                    patched.append(output.linear)
                    count += 1
        yield count
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
