"""Per-token log-probabilities (and entropies) without materialising ``[N*T, V]`` logits.

A policy update needs ``log pi(y_t | y_<t)`` for every response token. Computing all logits at
once costs ``N * T * V`` floats several times over (logits, log-softmax, their gradients): with a
128k vocabulary and 8k tokens that is 4 GiB per copy in float32. :func:`chunked_token_logprobs`
projects the final hidden states chunk by chunk and, with ``checkpoint=True``, recomputes each
chunk's logits during the backward pass, so at most one chunk of logits is alive at a time.

:func:`naive_token_logprobs` does the same computation on full logits; it is the reference for
tests and benchmarks, and fine when the logits exist anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["auto_chunk_size", "chunked_token_logprobs", "naive_token_logprobs"]

#: Float32 logits per chunk that :func:`auto_chunk_size` aims for (``2**25``: 128 MiB).
CHUNK_LOGITS_BUDGET = 2**25


def auto_chunk_size(vocab_size: int, budget: int = CHUNK_LOGITS_BUDGET) -> int:
    """Positions per log-prob chunk so that one ``[chunk, V]`` float32 block holds ``budget``.

    The chunk's logits, their log-softmax and the backward's gradient are each one such block,
    so peak memory grows with ``chunk * V``, not with the number of positions. A fixed number of
    positions would make a 150k vocabulary cost 75x what a 2k vocabulary costs.

    Args:
        vocab_size (int): ``V``, the output projection's width (``> 0``).
        budget (int): float32 elements per chunk (``> 0``).

    Returns:
        int: ``budget // V`` rounded down to a multiple of 16 (at least 16): 256 for Llama 3's
        128,256 ids, 208 for Qwen 2.5's 151,936, 16,384 for a 2,048-id vocabulary.

    Raises:
        ValueError: if ``vocab_size`` or ``budget`` is not a positive integer.
    """
    for name, value in (("vocab_size", vocab_size), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return max(16, budget // vocab_size // 16 * 16)


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
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs computed chunk by chunk from the final hidden states.

    The ``N * T`` positions are flattened and processed ``chunk_size`` at a time: project to
    logits, cast to float32, divide by ``temperature``, add ``logit_bias``, log-softmax, gather the
    target. The projection itself runs in ``hidden``'s dtype. With ``checkpoint=True`` (and grad
    enabled) each chunk runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``:
    the forward keeps only the chunk's hidden states and the backward recomputes its logits, so
    peak memory holds one chunk of ``[chunk_size, V]`` logits instead of ``[N*T, V]``.

    Args:
        hidden (Tensor): ``[N, T, D]`` final hidden states (after the final norm) at the
            positions that predict ``targets``.
        project (Callable[[Tensor], Tensor]): maps ``[M, D]`` to logits ``[M, V]``, e.g. the
            model's output ``nn.Linear`` or torchtune's ``TiedLinear``.
        targets (Tensor): ``[N, T]`` long token ids in ``[0, V)`` (padding replaced by a valid
            id such as 0; mask it out later).
        temperature (float): sampling temperature (``> 0``); logits are divided by it.
        logit_bias (Tensor | None): ``[V]`` added to the tempered logits; 0 or ``-inf`` entries
            forbid ids (e.g. ids the tokenizer cannot decode). Never produces NaN, in values or
            gradients, as long as the targets themselves are allowed.
        chunk_size (int): positions per chunk (``> 0``).
        checkpoint (bool): recompute each chunk's logits in the backward pass.
        return_entropy (bool): also return the entropy of the tempered, biased distribution.
        entropy_grad (bool): the entropy is differentiated (an entropy bonus). ``False``
            (entropy as a metric only) computes it once per chunk without a graph and skips
            it when the checkpoint recomputes the chunk in the backward pass.

    Returns:
        tuple[Tensor, Tensor | None]: ``[N, T]`` float32 log-probs and, if ``return_entropy``,
        ``[N, T]`` float32 entropies (else ``None``).

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

    def chunk_fn(h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logp, ent = _logprobs_from_logits(project(h), y, temperature, logit_bias, return_entropy)
        # checkpoint() needs tensor outputs; an empty placeholder stands in for "no entropy".
        return logp, ent if ent is not None else logp.new_empty(0)

    def chunk_fn_metric_entropy(h: Tensor, y: Tensor, first: list[bool]) -> tuple[Tensor, Tensor]:
        # entropy only as a metric: computed once, without a graph, and skipped when the
        # checkpoint recomputes the chunk in the backward pass (it saves no tensors, so the
        # recomputation stays consistent).
        z = _scores(project(h), temperature, logit_bias)
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
