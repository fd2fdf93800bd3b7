"""CPU decoding on oneDNN-reordered weights, and decoder layers fused for the decode step.

For the skinny products of a decode step (a few rows times every weight) MKL's ``F.linear``
runs far below the CPU's matmul rate; oneDNN on a weight reordered once per rollout is faster
(see :func:`packed_linear_weights`). Where a decoder layer has the plain torchtune structure
(RMSNorm, attention, RMSNorm, gated feed-forward) its decode step also runs as one function
(:func:`fused_decode_layer`): the query, key and value projections as one product, the gate and
up projections as one product, and no module calls in between.

:func:`~torchtune_grpo.rollout.native.generate_trajectory` enters
:func:`packed_linear_weights` for a rollout (``NativeGenerator(packed_weights=True)``, the
default); every module gets its own ``forward`` back on exit.
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

from torchtune_grpo.policy.kv_cache import (
    INTERLEAVED_ROPES,
    SpanKVCache,
    attend_projected,
    rotate,
)

#: Inputs of at most this many rows (decode steps) use the packed weights of
#: :func:`packed_linear_weights`; larger ones (prefill) the layer's own ``F.linear``.
PACKED_MAX_ROWS = 64


def attend_decode_step(attn: MultiHeadAttention, qkv: torch.Tensor, *, mask: torch.Tensor,
                       input_pos: torch.Tensor | None) -> torch.Tensor | None:
    """``attend_projected`` (:mod:`torchtune_grpo.policy.kv_cache`) for one decode step, from
    the stacked projection, in few ops.

    A decode step of a fused layer (:func:`fused_decode_layer`) has its queries, keys and
    values side by side in one ``[b, 1, (heads + 2 kv_heads) * head_dim]`` product. Here the
    query and key heads are rotated together (one complex product on their ``heads +
    kv_heads`` heads), the new key and value are stored by the span cache's own ``update``,
    and the attention reads the span with the step's additive mask broadcast over the heads
    (``[b, 1, 1, S]``, made once per step for all layers). The same arithmetic as
    ``attend_projected`` (equal results in the tests) with nine fewer tensor operations per
    layer and step.

    Args:
        attn (MultiHeadAttention): the module; its ``kv_cache`` a span-decoding
            :class:`~torchtune_grpo.policy.kv_cache.SpanKVCache`.
        qkv (Tensor): ``[b, 1, (heads + 2 * kv_heads) * head_dim]`` query|key|value projection.
        mask (Tensor): ``[b, 1, S]`` bool, True where the new position may attend (``S``: the
            filled span including it).
        input_pos (Tensor | None): ``[b, 1]`` position ids.

    Returns:
        Tensor | None: ``[b, 1, heads * head_dim]``, the input of the output projection; None
        (nothing done) where this shortcut does not apply: another cache or phase, q/k norms,
        or a position embedding ``rotate`` does not compute itself.
    """
    cache, rope = attn.kv_cache, attn.pos_embeddings
    if (type(cache) is not SpanKVCache or cache.write_pos is not None or cache.prefilling
            or attn.q_norm is not None or attn.k_norm is not None
            or (rope is not None and (type(rope) not in INTERLEAVED_ROPES or input_pos is None))
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


def _fusable(layer: nn.Module, adapters: set[int]) -> bool:
    """Whether :func:`fused_decode_layer` computes ``layer``'s forward: a torchtune
    ``TransformerSelfAttentionLayer`` with RMSNorms, no residual scales, exactly a
    ``MultiHeadAttention`` (not a subclass: a soft-capped attention's scores are not SDPA's, so
    its layer keeps its own forward) and a ``FeedForward`` of plain packable ``nn.Linear``
    layers (no LoRA), and no hooks."""
    if type(layer) is not TransformerSelfAttentionLayer or "forward" in layer.__dict__:
        return False
    attn, mlp = layer.attn, layer.mlp
    if (type(attn) is not MultiHeadAttention or type(mlp) is not FeedForward
            or type(layer.sa_norm) is not RMSNorm or type(layer.mlp_norm) is not RMSNorm
            or type(layer.sa_scale) is not nn.Identity or type(layer.mlp_scale) is not nn.Identity):
        return False
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.output_proj, mlp.w1, mlp.w2]
    if mlp.w3 is not None:
        linears.append(mlp.w3)
    if not all(type(lin) is nn.Linear and id(lin) not in adapters and "forward" not in lin.__dict__
               and _packable(lin.weight) for lin in linears):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


def fused_decode_layer(layer: TransformerSelfAttentionLayer) -> Callable[..., torch.Tensor]:
    """A ``forward`` for ``layer`` that runs decode steps as one function on packed weights.

    The decode step of a torchtune ``TransformerSelfAttentionLayer`` calls a dozen modules
    (two RMSNorms, the attention and its four projections, the feed-forward and its three) and
    seven matmuls. Here the same arithmetic runs with three matmuls fewer and no module calls:
    ``x -> RMSNorm -> [q | k | v]`` (one product with the three weights stacked) ``->``
    :func:`~torchtune_grpo.policy.kv_cache.attend_projected` ``-> output projection + x ->
    RMSNorm -> [gate | up]`` (one product) ``-> activation(gate) * up -> down projection +``
    residual, each residual sum a post-op of its product; a decode step's attention goes through
    :func:`attend_decode_step` (straight from the stacked
    product). Every output element is the same dot product as the layer's own, so results agree
    to float32 rounding of oneDNN's summation order (equal in the tests).

    Runs only for inputs of at most :data:`PACKED_MAX_ROWS` positions, without autograd, on a
    layer whose attention decodes into a rollout's
    :class:`~torchtune_grpo.policy.kv_cache.SpanKVCache`; anything else (prefill of long prompts,
    training forwards) goes to the layer's own forward.

    Args:
        layer: a layer :func:`_fusable` accepts.

    Returns:
        ``forward(x [b, s, D], *, mask=None, input_pos=None, **kwargs) -> [b, s, D]``.
    """
    attn, mlp = layer.attn, layer.mlp
    qkv, qkv_bias = _reordered([attn.q_proj, attn.k_proj, attn.v_proj])
    split = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
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

    CPU decoding multiplies ``[rows, D]`` activations (``rows`` = the decode batch, a few to a
    few dozen) by every weight once per step. For such skinny products ``F.linear`` (MKL) runs
    far below the CPU's matmul rate (the A/B: ``python -m benchmarks.decode_kernels``,
    ``docs/performance.md``). oneDNN's
    ``_linear_pointwise`` on a weight reordered once (``_reorder_linear_weight``) is faster, so
    for the duration of a rollout every plain ``nn.Linear`` (and torchtune's ``TiedLinear``
    output projection) whose weight is a float32 CPU tensor gets an instance ``forward`` that
    uses the reordered copy for inputs of at most :data:`PACKED_MAX_ROWS` rows (prefill keeps
    ``F.linear``, which is as fast there). Results agree with ``F.linear`` to float32 rounding
    of a different summation order (SmolLM2-135M's logits, of magnitude ~100, move by ~1e-4,
    its log-probs by ~5e-5), so a sampled token can differ where a row's uniform draw falls
    within that rounding of a CDF boundary: rollouts are reproducible for a given setting,
    and equal between the settings in the tiny-model tests, not always on a real model.

    Decoder layers of the plain torchtune structure (Llama, Qwen2 and the like, without LoRA)
    get a fused forward instead (:func:`fused_decode_layer`): their q/k/v weights and their
    gate/up weights are reordered as one matrix each, and a decode step runs the layer as
    one function.

    Untouched: LoRA/DoRA layers (base weights and adapters), FSDP2-wrapped models (sharded or
    gathered), other dtypes and devices, and builds without oneDNN. The copies cost one
    more copy of the packed weights' memory for the rollout, and one pass over them to make
    (~0.3 s for 135M parameters on 2 cores).

    Args:
        model: a torchtune decoder.
        enabled: False makes this a no-op.

    Yields:
        int: the number of linear layers that decode on packed weights, the fused layers' seven
        included (0 when none could).
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
