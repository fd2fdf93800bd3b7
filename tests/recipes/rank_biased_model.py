"""A test model whose completions stop at once on rank 0 and never on the other ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchtune.models.llama3_2 import llama3_2

from torchtune_grpo.quickstart.tiny import tiny_special_tokens

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


def _kill_rank_one(module, _inputs, output):
    """SIGKILL rank 1 at its first *training* forward of step 2 (after step_1 is saved)."""
    import os
    import signal

    if torch.is_tensor(output) or not dist.is_initialized() or dist.get_rank() != 1:
        return output
    module._training_forwards = getattr(module, "_training_forwards", 0) + 1
    if module._training_forwards == module._kill_at_forward:
        os.kill(os.getpid(), signal.SIGKILL)
    return output


def dying_rank_llama(kill_at_forward: int = 2, **dims):
    """:func:`llama3_2` whose rank 1 dies at its ``kill_at_forward``-th training forward."""
    model = llama3_2(**dims)
    model._kill_at_forward = kill_at_forward
    model.register_forward_hook(_kill_rank_one)
    return model
