"""A test model whose completions stop at once on rank 0 and never on the other ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchtune.models.llama3_2 import llama3_2

from torchtune_grpo.tiny import tiny_special_tokens

EOT = tiny_special_tokens()["<|eot_id|>"]


def _bias(_module, _inputs, output):
    if not (torch.is_tensor(output) and output.dim() == 3):
        return output  # training forward returns (logprobs, entropy)
    rank = dist.get_rank() if dist.is_initialized() else 0
    output = output.clone()
    output[..., EOT] = 1e4 if rank == 0 else -1e4
    return output


def rank_biased_llama(**dims):
    """:func:`llama3_2` whose stop-token logit is forced by the rank it runs on."""
    model = llama3_2(**dims)
    model.register_forward_hook(_bias)
    return model
