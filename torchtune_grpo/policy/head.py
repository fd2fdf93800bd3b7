"""The policy's output head and the requests it answers: torchtune's logits (``None``), the last
position's logits (:data:`LAST_POSITION`), or response log-probs (:class:`ResponseLogProbs`,
:class:`PackedLogProbs`) without full ``[N, P + T, V]`` logits. An optional final-logit
soft-cap applies to the float32 logits first. A plain linear output projection of a bf16 model
gives float32 logits that were never rounded to bf16
(:func:`~torchtune_grpo.policy.logprobs.float_logits`), in the engine and the trainer alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchtune_grpo.policy.logprobs import chunked_token_logprobs, float_logits

__all__ = [
    "LAST_POSITION",
    "LastPosition",
    "OutputHead",
    "OutputRequest",
    "PackedLogProbs",
    "ResponseLogProbs",
    "SoftCappedProjection",
    "soft_cap",
]


@dataclass(frozen=True)
class LastPosition:
    """Return the logits of the last position only: ``[b, 1, V]`` float32.

    Use the one instance :data:`LAST_POSITION`: a compiled decode step guards on the request
    it is called with, and one object keeps its guards.
    """


LAST_POSITION = LastPosition()


@dataclass(frozen=True, eq=False)
class ResponseLogProbs:
    """Return log-probs of ``targets`` predicted by the positions ``start .. start + T - 1``.

    Attributes:
        targets: ``[N, T]`` token ids; position ``start + t`` predicts ``targets[:, t]``.
        start: the first predicting position.
        temperature, logit_bias, chunk_size, return_entropy, entropy_grad, keep_probs: as for
            :func:`~torchtune_grpo.policy.logprobs.chunked_token_logprobs`.
    """

    targets: torch.Tensor
    start: int
    temperature: float = 1.0
    logit_bias: torch.Tensor | None = None
    chunk_size: int = 1024
    return_entropy: bool = False
    entropy_grad: bool = True
    keep_probs: int = 0


@dataclass(frozen=True, eq=False)
class PackedLogProbs:
    """Return log-probs of ``targets`` predicted by the positions ``index`` of a packed ``[1, S]``
    row (which may be longer than ``max_seq_len``).

    Attributes:
        index: ``[M]`` positions of the packed row whose hidden state predicts a target.
        targets: ``[1, M]`` token ids.
        temperature, logit_bias, chunk_size, return_entropy, entropy_grad, keep_probs: as for
            :class:`ResponseLogProbs`.
    """

    index: torch.Tensor
    targets: torch.Tensor
    temperature: float = 1.0
    logit_bias: torch.Tensor | None = None
    chunk_size: int = 1024
    return_entropy: bool = False
    entropy_grad: bool = True
    keep_probs: int = 0


#: What one forward of a :class:`~torchtune_grpo.policy.decoder.PolicyDecoder` may ask its head
#: for; ``None`` asks for torchtune's ordinary logits.
OutputRequest = LastPosition | ResponseLogProbs | PackedLogProbs | None


class SoftCappedProjection:
    """``cap * tanh(float_logits(project, h) / cap)``: an output projection with a final-logit
    soft-cap, in float32 (not linear: log-probs take the checkpointed chunks).
    """

    def __init__(self, project: Callable[[torch.Tensor], torch.Tensor], cap: float) -> None:
        self.project = project
        self.cap = cap

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return soft_cap(float_logits(self.project, h), self.cap)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``: logits squashed into ``(-cap, cap)``."""
    return torch.tanh(logits / cap) * cap


class OutputHead:
    """Final norm, output projection and optional final-logit soft-cap, answering a request.

    Not an ``nn.Module``: the decoder owns ``norm`` and ``output``.

    Args:
        norm: the final norm.
        output: the output projection (``TiedLinear``, ``nn.Linear``, LoRA/DoRA linear).
        final_logit_softcap: ``cap`` of ``cap * tanh(logits / cap)`` (None: no soft-cap).
    """

    def __init__(self, norm: nn.Module, output: Callable[[torch.Tensor], torch.Tensor], *,
                 final_logit_softcap: float | None = None) -> None:
        if final_logit_softcap is not None and not float(final_logit_softcap) > 0:
            raise ValueError(f"final_logit_softcap must be > 0 (or None), got "
                             f"{final_logit_softcap!r}")
        self.norm = norm
        self.output = output
        self.final_logit_softcap = (None if final_logit_softcap is None
                                    else float(final_logit_softcap))
        #: what maps normalised hidden states to the logits the log-probs use
        self.projection = (output if self.final_logit_softcap is None
                           else SoftCappedProjection(output, self.final_logit_softcap))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[b, s, V]`` float32 logits of the hidden states ``h [b, s, D]`` (soft-capped).

        A plain linear ``output`` of bf16/fp16 states is computed in float32 without rounding
        (:func:`~torchtune_grpo.policy.logprobs.float_logits`); LoRA/DoRA outputs give their
        own logits (rounded to the model's dtype) cast to float32.
        """
        logits = float_logits(self.output, self.norm(h))
        if self.final_logit_softcap is not None:
            logits = soft_cap(logits, self.final_logit_softcap)
        return logits

    def __call__(self, h: torch.Tensor, request: OutputRequest = None):
        """Answer ``request`` from the final hidden states ``h [b, s, D]`` (before the norm).

        Returns:
            ``[b, s, V]`` logits (``None``), ``[b, 1, V]`` logits (:data:`LAST_POSITION`), or
            ``(logprobs, entropy or None)`` float32 (:class:`ResponseLogProbs`: ``[N, T]``;
            :class:`PackedLogProbs`: ``[1, M]``).
        """
        if request is None:
            return self.logits(h)
        if isinstance(request, LastPosition):
            return self.logits(h[:, -1:])
        if isinstance(request, PackedLogProbs):  # the positions that predict a response token
            hidden = self.norm(h[:, request.index])
        elif isinstance(request, ResponseLogProbs):  # position i predicts token i + 1
            hidden = self.norm(h[:, request.start : request.start + request.targets.shape[1]])
        else:
            raise TypeError(f"unknown output request {type(request).__name__}")
        logprobs, entropy = chunked_token_logprobs(
            hidden,
            self.projection,
            request.targets,
            temperature=request.temperature,
            logit_bias=request.logit_bias,
            chunk_size=request.chunk_size,
            return_entropy=request.return_entropy,
            entropy_grad=request.entropy_grad,
            keep_probs=request.keep_probs,
        )
        return _not_a_view(logprobs), None if entropy is None else _not_a_view(entropy)


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view (``[N, T]``: a few KB). Under FSDP2 these are the root
    module's outputs, which it hooks for backward; an in-place op on a view output would
    drop that hook, so torch warns on every view output. Same values, same gradient."""
    return t.clone() if t._base is not None else t
