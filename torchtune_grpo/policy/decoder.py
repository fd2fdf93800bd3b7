"""The policy model: a torchtune decoder whose output head answers an explicit request.

:class:`PolicyDecoder` keeps torchtune's submodules and state dict; its ``forward`` takes an
``output`` request for its :class:`~torchtune_grpo.policy.head.OutputHead`, run inside the
model's own forward (so FSDP2 has gathered the output weights).
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.policy.head import OutputHead, OutputRequest, PackedLogProbs

__all__ = ["PolicyDecoder", "policy_decoder"]


class PolicyDecoder(TransformerDecoder):
    """A torchtune decoder whose ``forward`` passes an explicit request to its output head.

    Args:
        final_logit_softcap: the head's final-logit soft-cap (None: none); fixed for the
            model's life.
        **decoder: the arguments of :class:`torchtune.modules.TransformerDecoder`
            (``tok_embeddings``, ``layers``, ``max_seq_len``, ``num_heads``, ``head_dim``,
            ``norm``, ``output``, ...).

    Attributes:
        head (OutputHead): the final norm and output projection (this decoder's own ``norm``
            and ``output``) and the soft-cap.
    """

    def __init__(self, *, final_logit_softcap: float | None = None, **decoder) -> None:
        super().__init__(**decoder)
        self._build_head(final_logit_softcap)

    def _build_head(self, final_logit_softcap: float | None) -> None:
        self.head = OutputHead(self.norm, self.output, final_logit_softcap=final_logit_softcap)

    @classmethod
    def from_decoder(cls, decoder: TransformerDecoder, *,
                     final_logit_softcap: float | None = None) -> PolicyDecoder:
        """``decoder`` turned into a :class:`PolicyDecoder` in place (class swapped, head built
        from its ``norm`` and ``output``; parameters, hooks and attributes untouched).

        Raises:
            TypeError: ``decoder`` is not exactly a torchtune ``TransformerDecoder``.
        """
        if type(decoder) is not TransformerDecoder:
            raise TypeError(
                f"a PolicyDecoder is made of a torchtune TransformerDecoder, got "
                f"{type(decoder).__name__}; build the policy before sharding it, from a "
                "decoder-only torchtune builder")
        decoder.__class__ = cls
        decoder._build_head(final_logit_softcap)
        return decoder

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        encoder_input: torch.Tensor | None = None,
        encoder_mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        output: OutputRequest = None,
    ):
        """torchtune's decoder forward, its last step answering ``output``.

        Args:
            tokens, mask, encoder_input, encoder_mask, input_pos: as for
                :meth:`torchtune.modules.TransformerDecoder.forward`.
            output: None (torchtune's logits), :data:`~torchtune_grpo.policy.head.LAST_POSITION`,
                :class:`~torchtune_grpo.policy.head.ResponseLogProbs` or
                :class:`~torchtune_grpo.policy.head.PackedLogProbs`.

        Returns:
            What the head returns for ``output`` (after the hidden states of
            ``output_hidden_states`` layers, as a list, when there are any).
        """
        seq_len = tokens.shape[1]
        if isinstance(output, PackedLogProbs):
            seq_len = min(seq_len, self.max_seq_len)
        self._validate_inputs(seq_len, mask=mask, encoder_input=encoder_input,
                              encoder_mask=encoder_mask, input_pos=input_pos)
        h = self.tok_embeddings(tokens)
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            h = layer(h, mask=mask, encoder_input=encoder_input, encoder_mask=encoder_mask,
                      input_pos=input_pos)
        out = self.unembed(h) if output is None else self.head(h, output)
        return out if not hidden else [*hidden, out]

    def unembed(self, h: torch.Tensor):
        """torchtune's ``unembed`` through the head: ``[b, s, V]`` float32 logits (a list of
        chunks with ``set_num_output_chunks``, which a soft-capped head does not support)."""
        if self.num_output_chunks > 0:
            if self.head.final_logit_softcap is not None:
                raise NotImplementedError("chunked output of a soft-capped head")
            return super().unembed(h)
        return self.head.logits(h)


def policy_decoder(model: nn.Module, *,
                   final_logit_softcap: float | None = None) -> PolicyDecoder:
    """``model`` as a :class:`PolicyDecoder`: itself when it is one, else
    :meth:`PolicyDecoder.from_decoder` of it.

    Args:
        model: a torchtune ``TransformerDecoder`` as a builder returns it (not yet sharded),
            or a :class:`PolicyDecoder`.
        final_logit_softcap: the soft-cap of a decoder being turned into a policy; a
            :class:`PolicyDecoder` keeps its own and must not be given another.

    Raises:
        TypeError: ``model`` is neither (see :meth:`PolicyDecoder.from_decoder`).
        ValueError: a :class:`PolicyDecoder` given another soft-cap.
    """
    if isinstance(model, PolicyDecoder):
        if final_logit_softcap is not None and (
                model.head.final_logit_softcap != float(final_logit_softcap)):
            raise ValueError(f"the model's final_logit_softcap is "
                             f"{model.head.final_logit_softcap}, not {final_logit_softcap}")
        return model
    return PolicyDecoder.from_decoder(model, final_logit_softcap=final_logit_softcap)
