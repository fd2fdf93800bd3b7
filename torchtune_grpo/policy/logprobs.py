"""Per-token log-probabilities (and entropies) without materialising ``[N*T, V]`` logits.

:func:`chunked_token_logprobs` projects the hidden states chunk by chunk (checkpointed, or a
fused autograd function for a plain linear projection); :func:`naive_token_logprobs` is the
reference on full logits. A plain linear projection of bf16/fp16 hidden states gives float32
logits that are never rounded to the hidden states' dtype (:func:`float_matmul`,
:func:`float_logits`); any other projection (LoRA/DoRA, a linear with a bias) gives its own
output, cast to float32.
"""


from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["auto_chunk_size", "chunked_token_logprobs", "float_logits", "float_matmul",
           "naive_token_logprobs"]

#: Float32 logits per chunk that :func:`auto_chunk_size` aims for (``2**25``: 128 MiB).
CHUNK_LOGITS_BUDGET = 2**25


def auto_chunk_size(vocab_size: int, budget: int = CHUNK_LOGITS_BUDGET) -> int:
    """Positions per log-prob chunk so that one ``[chunk, V]`` float32 block holds ``budget``.

    Args:
        vocab_size (int): ``V`` (``> 0``).
        budget (int): float32 elements per chunk (``> 0``).

    Returns:
        int: ``budget // V`` rounded down to a multiple of 16 (at least 16).

    Raises:
        ValueError: if ``vocab_size`` or ``budget`` is not a positive integer.
    """
    for name, value in (("vocab_size", vocab_size), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return max(16, budget // vocab_size // 16 * 16)


#: ``logit_bias`` entries of ``-inf`` become this inside the fused path: ``exp`` still gives exactly
#: 0 in float32, while ``p * z`` stays finite (0) for the entropy.
_FORBIDDEN_LOGIT = -1.0e30


def _linear_weight(project: Callable[[Tensor], Tensor]) -> Tensor | None:
    """``W [V, D]`` when ``project(h)`` is exactly ``h @ W.T`` (else None: use the generic path)."""
    from torchtune.modules import TiedLinear

    if isinstance(project, TiedLinear):
        return project.tied_module.weight
    if isinstance(project, nn.Linear) and project.bias is None and type(project).forward in (
        nn.Linear.forward,
    ):
        return project.weight
    return None


#: Weight elements that the upcasting path of :func:`float_matmul` turns into float32 at a time
#: (``2**22``: a 16 MiB block of rows, instead of a float32 copy of the whole weight).
UPCAST_BLOCK_ELEMENTS = 2**22


def float_matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b.T`` in float32, accumulated in float32 and never rounded to ``a``'s dtype.

    Chosen by dtype and device type alone (no host sync): float32 inputs take ``torch.mm``
    (bitwise the plain product); bf16/fp16 on CUDA ``torch.mm(a, b.T, out_dtype=float32)``,
    the tensor-core product written in float32 (no extra memory); bf16/fp16 elsewhere (the CPU
    has no such kernel) upcast ``a`` once and ``b`` a block of rows at a time
    (:data:`UPCAST_BLOCK_ELEMENTS`; a whole float32 copy of a 151k x 2048 weight would be
    1.2 GB), each block multiplied into its columns of ``out``: a float32 matmul, several
    times slower than the bf16 one on a CPU with AVX512-BF16/AMX.

    Args:
        a (Tensor): ``[m, k]``.
        b (Tensor): ``[n, k]``, same dtype and device as ``a``.
        out (Tensor | None): ``[m, n]`` float32 with unit column stride (a row-major block or
            its column slice); None allocates it.

    Returns:
        Tensor: ``out``, ``[m, n]`` float32. Not differentiable (see :func:`float_logits`).
    """
    if out is None:
        out = a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)
    if a.dtype == torch.float32:
        return torch.mm(a, b.t(), out=out)
    if a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
    a32 = a.float()
    rows = max(1, UPCAST_BLOCK_ELEMENTS // max(1, b.shape[1]))
    for r in range(0, b.shape[0], rows):
        torch.mm(a32, b[r : r + rows].float().t(), out=out[:, r : r + rows])
    return out


class _FloatLinear(torch.autograd.Function):
    """``float_matmul(hidden, weight)``: float32 logits ``[M, V]`` of low-precision ``hidden
    [M, D]`` and ``weight [V, D]``, with ``F.linear``'s gradients (the float32 output gradient
    rounded to ``hidden``'s dtype; gradients in the inputs' dtypes)."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return float_matmul(hidden, weight)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        low = grad.to(hidden.dtype)
        grad_h = low @ weight if ctx.needs_input_grad[0] else None
        grad_w = low.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_h, grad_w


def float_logits(project: Callable[[Tensor], Tensor], h: Tensor) -> Tensor:
    """``project(h)`` as float32 logits ``[..., V]``, differentiable.

    A plain linear ``project`` (``nn.Linear`` without bias, torchtune's ``TiedLinear``) of
    bf16/fp16 ``h`` is computed by :func:`float_matmul`: the logits are never rounded to
    ``h``'s dtype (bf16 spacing is 0.125 at ``|logit|`` 16-32). Float32 ``h`` and any other
    projection return ``project(h).float()`` (bitwise today's result); for LoRA/DoRA output
    projections that means logits rounded to the model's dtype before the cast.

    Args:
        project (Callable[[Tensor], Tensor]): ``[..., D]`` -> ``[..., V]``.
        h (Tensor): ``[..., D]`` hidden states.

    Returns:
        Tensor: ``[..., V]`` float32 logits.
    """
    weight = _linear_weight(project)
    if weight is None or h.dtype == torch.float32 or weight.dtype != h.dtype:
        return project(h).float()
    flat = h.reshape(-1, h.shape[-1])
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        z = _FloatLinear.apply(flat, weight)
    else:
        z = float_matmul(flat, weight)
    return z.view(*h.shape[:-1], weight.shape[0])


def _chunk_scores(h: Tensor, weight: Tensor, temperature: float, bias: Tensor | None,
                  out: Tensor) -> Tensor:
    """``out[:m] = float_matmul(h, W) / temperature + bias`` written into a reused buffer.

    ``h [m, D]``, ``weight [V, D]``, ``out [>= m, V]`` float32. Returns the ``[m, V]`` view.
    """
    m = h.shape[0]
    z = float_matmul(h, weight, out=out[:m])
    if temperature != 1.0:
        z.div_(temperature)
    if bias is not None:
        z.add_(bias)
    return z


class _FusedLinearLogProbs(torch.autograd.Function):
    """Log-probs of ``targets`` under ``softmax((h @ W.T) / temperature + bias)``, chunked, the
    product in float32 (:func:`float_matmul`); the backward rounds the logits' gradient to
    ``h``'s dtype for its two matmuls, as ``F.linear`` would.

    Forward inputs: ``hidden [M, D]``, ``weight [V, D]``, ``targets [M]``, ``bias [V]`` float32
    (finite; forbidden ids at ``_FORBIDDEN_LOGIT``) or None, ``temperature``, ``chunk_size``,
    ``want_entropy``, ``keep_probs`` (float32 elements). Outputs ``logp [M]`` float32 and
    ``entropy [M]`` float32 (empty when not wanted; never differentiable). Saves ``hidden``,
    ``weight`` and ``targets``, and the softmax ``[m, V]`` of the first chunks, as long as
    their elements stay within ``keep_probs``: the backward uses those instead of recomputing
    the chunk's logits and softmax (one output-projection matmul and one softmax pass fewer per
    kept chunk). Kept blocks are consumed by the first backward (turned into the logits'
    gradient in place); a second backward (``retain_graph``) recomputes every chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, chunk_size, want_entropy,
                keep_probs):
        m_total, v = hidden.shape[0], weight.shape[0]
        rows = min(chunk_size, m_total)
        buf = hidden.new_empty((rows, v), dtype=torch.float32)
        probs = hidden.new_empty((rows, v), dtype=torch.float32) if want_entropy else None
        logp = hidden.new_empty(m_total, dtype=torch.float32)
        entropy = hidden.new_empty(m_total if want_entropy else 0, dtype=torch.float32)
        kept: list[Tensor] = []
        for s in range(0, m_total, chunk_size):
            e = min(s + chunk_size, m_total)
            z = _chunk_scores(hidden[s:e], weight, temperature, bias, buf)
            y = targets[s:e].unsqueeze(1)
            if s == len(kept) * chunk_size and e * v <= keep_probs:
                # softmax kept for the backward; log p_y = z_y - logsumexp(z), the logsumexp
                # read off the largest probability (>= 1 / V, so its log is exact to rounding):
                # softmax is monotone, so max p sits where max z does (two plain reductions,
                # cheaper than an argmax and two gathers)
                p = torch._softmax(z, 1, False)
                lse = z.amax(1) - p.amax(1).log()
                logp[s:e] = z.gather(1, y).squeeze(1) - lse
                if want_entropy:  # H = logsumexp(z) - sum_v p_v z_v
                    entropy[s:e] = lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
                kept.append(p)
                continue
            if want_entropy:
                # H = logsumexp(z) - sum_v p_v z_v; logsumexp(z) = max(z) - max(log_softmax(z))
                p = probs[: e - s]
                torch._softmax(z, 1, False, out=p)
                expected_z = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)  # no [m, V] temp
                z_max = z.amax(1)
            torch._log_softmax(z, 1, False, out=z)
            logp[s:e] = z.gather(1, y).squeeze(1)
            if want_entropy:
                entropy[s:e] = (z_max - z.amax(1)) - expected_z
        # a forbidden target has log-prob -inf, as in the unfused path
        logp.masked_fill_(logp < _FORBIDDEN_LOGIT / 2, float("-inf"))
        ctx.save_for_backward(hidden, weight, targets, bias)
        ctx.temperature, ctx.chunk_size, ctx.kept = temperature, chunk_size, kept
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, bias = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        kept, ctx.kept = ctx.kept, []  # consumed: a second backward recomputes
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m_total, v = hidden.shape[0], weight.shape[0]
        rows = min(chunk_size, m_total)
        recompute = m_total > len(kept) * chunk_size
        buf = hidden.new_empty((rows, v), dtype=torch.float32) if recompute else None
        low = None if hidden.dtype == torch.float32 else hidden.new_empty((rows, v))
        probs = hidden.new_empty((rows, v), dtype=torch.float32) if recompute else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        # d logp_i / d z_i = onehot(y_i) - softmax(z_i); d z / d logits = 1 / temperature
        g = grad_logp.float() / temperature
        for i, s in enumerate(range(0, m_total, chunk_size)):
            e = min(s + chunk_size, m_total)
            if i < len(kept):
                p = kept[i]
                kept[i] = None  # freed as soon as this chunk is done
            else:
                z = _chunk_scores(hidden[s:e], weight, temperature, bias, buf)
                p = probs[: e - s]
                torch._softmax(z, 1, False, out=p)
            gs = g[s:e]
            p.mul_(-gs.unsqueeze(1))
            p.scatter_add_(1, targets[s:e].unsqueeze(1), gs.unsqueeze(1))
            grad_z = p if low is None else low[: e - s].copy_(p)
            if need_h:
                torch.mm(grad_z, weight, out=grad_h[s:e])
            if need_w:
                if low is None:
                    grad_w.addmm_(grad_z.t(), hidden[s:e])
                else:
                    grad_w.add_((grad_z.t() @ hidden[s:e]).float())
            del p, grad_z
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _check_common(temperature: float, logit_bias: Tensor | None) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (0.0 < float(temperature) < float("inf"))
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if logit_bias is not None and logit_bias.dim() != 1:
        raise ValueError(
            f"logit_bias must be a 1-D tensor [V], got shape {tuple(logit_bias.shape)}"
        )


def _check_targets(targets: Tensor) -> None:
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer (long) tensor, got dtype {targets.dtype}")
    if targets.numel() and bool((targets < 0).any()):
        raise ValueError(
            "targets contain negative ids; replace padding ids (e.g. -100) by a valid id such "
            "as 0 before computing log-probs (padded positions are masked out by the loss)"
        )


def _scores(logits: Tensor, temperature: float, logit_bias: Tensor | None) -> Tensor:
    """``[M, V]`` float32 ``logits / temperature + logit_bias``."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if logit_bias is not None:
        z = z + logit_bias.to(device=z.device, dtype=torch.float32)
    return z


def _entropy(z: Tensor, logp_all: Tensor) -> Tensor:
    """``[M]`` entropy of ``softmax(z)`` given ``logp_all = log_softmax(z)`` (``[M, V]``)."""
    # softmax, not logp_all.exp(): on CPU, exp() of very negative inputs (the long tail of a
    # large vocabulary, -inf for forbidden ids) takes a slow path, ~15x slower per element.
    probs = torch.softmax(z, dim=-1)
    # H = -sum p log p. Entries with p = 0 (log p = -inf, e.g. forbidden ids) contribute 0; the
    # where() keeps -inf out of the product so neither the value nor the gradient becomes NaN.
    # (log_softmax yields finite values or -inf, never +inf or NaN, so one comparison suffices.)
    finite = logp_all != float("-inf")
    safe_logp = torch.where(finite, logp_all, torch.zeros((), dtype=z.dtype, device=z.device))
    return -(probs * safe_logp).sum(dim=-1)


def _logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    logit_bias: Tensor | None,
    return_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` (and entropy) from a 2-D block of logits, in float32.

    Args:
        logits (Tensor): ``[M, V]`` raw logits, any float dtype.
        targets (Tensor): ``[M]`` token ids in ``[0, V)``.
        temperature (float): logits are divided by it.
        logit_bias (Tensor | None): ``[V]`` added after the temperature (0 or ``-inf`` entries
            forbid ids); finite values are allowed too.
        return_entropy (bool): also return the entropy of the tempered distribution.

    Returns:
        tuple[Tensor, Tensor | None]: ``[M]`` float32 log-probs and ``[M]`` float32 entropies
        (or ``None``).
    """
    z = _scores(logits, temperature, logit_bias)
    logp_all = torch.log_softmax(z, dim=-1)  # [M, V]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, (_entropy(z, logp_all) if return_entropy else None)


def naive_token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    logit_bias: Tensor | None = None,
    return_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs from full logits (reference implementation).

    Args:
        logits (Tensor): ``[N, T, V]`` logits at the positions that predict ``targets``.
        targets (Tensor): ``[N, T]`` long token ids in ``[0, V)`` (padding replaced by a valid
            id; mask it out later).
        temperature (float): sampling temperature; logits are divided by it.
        logit_bias (Tensor | None): ``[V]`` added to the tempered logits (0 or ``-inf``).
        return_entropy (bool): also return the per-token entropy.

    Returns:
        tuple[Tensor, Tensor | None]: ``[N, T]`` float32 log-probs and ``[N, T]`` float32
        entropies of the tempered, biased distribution (``None`` unless ``return_entropy``).

    Raises:
        ValueError: on inconsistent shapes, negative target ids or ``temperature <= 0``.
    """
    _check_common(temperature, logit_bias)
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [N, T, V] and targets [N, T]; got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    _check_targets(targets)
    n, t, v = logits.shape
    logp, ent = _logprobs_from_logits(
        logits.reshape(n * t, v),
        targets.reshape(n * t),
        float(temperature),
        logit_bias,
        return_entropy,
    )
    return logp.view(n, t), None if ent is None else ent.view(n, t)


def chunked_token_logprobs(
    hidden: Tensor,
    project: Callable[[Tensor], Tensor],
    targets: Tensor,
    *,
    temperature: float = 1.0,
    logit_bias: Tensor | None = None,
    chunk_size: int = 1024,
    checkpoint: bool = True,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    fused: bool = True,
    keep_probs: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs computed chunk by chunk from the final hidden states.

    Each chunk is projected to float32 logits (:func:`float_logits`: a plain linear projection
    is never rounded to ``hidden``'s dtype), divided by ``temperature``, biased,
    log-softmaxed and gathered; peak memory holds one ``[chunk_size, V]`` block.

    Args:
        hidden (Tensor): ``[N, T, D]`` final hidden states at the positions that predict
            ``targets``.
        project (Callable[[Tensor], Tensor]): ``[M, D]`` -> ``[M, V]`` logits.
        targets (Tensor): ``[N, T]`` long token ids in ``[0, V)`` (padding a valid id).
        temperature (float): ``> 0``; logits are divided by it.
        logit_bias (Tensor | None): ``[V]`` added to the tempered logits (0 or ``-inf``); no NaN
            as long as the targets are allowed.
        chunk_size (int): positions per chunk (``> 0``).
        checkpoint (bool): recompute each chunk's logits in the backward pass.
        return_entropy (bool): also return the entropy of the tempered, biased distribution.
        entropy_grad (bool): differentiate the entropy (False: a metric, no graph).
        fused (bool): use the fused function when ``checkpoint``, a plain linear ``project`` and
            no entropy gradient allow it; False forces the checkpointed chunks.
        keep_probs (int): fused path with gradients only: float32 softmax elements kept for the
            backward (whole chunks); 0 recomputes every chunk.

    Returns:
        tuple[Tensor, Tensor | None]: ``[N, T]`` float32 log-probs and, if ``return_entropy``,
        ``[N, T]`` float32 entropies.

    Raises:
        ValueError: on inconsistent shapes, negative target ids, ``temperature <= 0`` or
            ``chunk_size <= 0``.
    """
    _check_common(temperature, logit_bias)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [N, T, D] and targets [N, T]; got hidden {tuple(hidden.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    _check_targets(targets)
    n, t, d = hidden.shape
    flat_hidden = hidden.reshape(n * t, d)
    flat_targets = targets.reshape(n * t)
    temperature = float(temperature)
    weight = _linear_weight(project) if fused and checkpoint and n * t else None
    if weight is not None and not (return_entropy and entropy_grad and torch.is_grad_enabled()):
        bias = None
        if logit_bias is not None:
            bias = logit_bias.to(device=hidden.device, dtype=torch.float32).clamp(
                min=_FORBIDDEN_LOGIT)
        if isinstance(keep_probs, bool) or not isinstance(keep_probs, int) or keep_probs < 0:
            raise ValueError(f"keep_probs must be an integer >= 0, got {keep_probs!r}")
        grads = torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad)
        logp, ent = _FusedLinearLogProbs.apply(
            flat_hidden, weight, flat_targets, bias, temperature, chunk_size, return_entropy,
            keep_probs if grads else 0)
        return logp.view(n, t), (ent.view(n, t) if return_entropy else None)

    def chunk_fn(h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logp, ent = _logprobs_from_logits(float_logits(project, h), y, temperature, logit_bias,
                                          return_entropy)
        # checkpoint() needs tensor outputs; an empty placeholder stands in for "no entropy".
        return logp, ent if ent is not None else logp.new_empty(0)

    def chunk_fn_metric_entropy(h: Tensor, y: Tensor, first: list[bool]) -> tuple[Tensor, Tensor]:
        # entropy only as a metric: computed once, without a graph, and skipped when the
        # checkpoint recomputes the chunk in the backward pass (it saves no tensors, so the
        # recomputation stays consistent).
        z = _scores(float_logits(project, h), temperature, logit_bias)
        logp_all = torch.log_softmax(z, dim=-1)
        logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        if first[0]:
            first[0] = False
            with torch.no_grad():  # reuses this chunk's log-softmax
                ent = _entropy(z.detach(), logp_all.detach())
            return logp, ent
        return logp, logp.new_zeros(logp.shape).detach()

    use_checkpoint = checkpoint and torch.is_grad_enabled()
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, n * t, chunk_size):
        h = flat_hidden[start : start + chunk_size]
        y = flat_targets[start : start + chunk_size]
        if use_checkpoint and return_entropy and not entropy_grad:
            logp, ent = _checkpoint(chunk_fn_metric_entropy, h, y, [True], use_reentrant=False)
            ent = ent.detach()
        elif use_checkpoint:
            logp, ent = _checkpoint(chunk_fn, h, y, use_reentrant=False)
        else:
            logp, ent = chunk_fn(h, y)
            if return_entropy and not entropy_grad:
                ent = ent.detach()
        logps.append(logp)
        ents.append(ent)

    if n * t == 0:
        empty = flat_hidden.new_zeros((n, t), dtype=torch.float32)
        return empty, (empty.clone() if return_entropy else None)
    logprobs = torch.cat(logps).view(n, t)
    entropy = torch.cat(ents).view(n, t) if return_entropy else None
    return logprobs, entropy
