"""One GRPO-shaped loss and gradient per model folder, on 1 rank or FSDP2-sharded over several.

Run under torchrun for the sharded case (``python -m torch.distributed.run --nproc_per_node 2
tests/unit/models/families/_fsdp_family_worker.py OUT.json FOLDER ...``), or call
:func:`loss_and_grad_norm`
in-process for one rank. Each rank takes rows ``rank::world`` of a fixed batch of 8 rows; the
loss is ``-sum(advantage * logprob)`` over the real response tokens, divided by the global
token count and multiplied by the world size (FSDP2 averages gradients over ranks), as the
recipe's update does. The model is built by the policy's own ``build_model`` (meta device,
``shard_model``, ``load_from_full_model_state_dict`` when sharded).
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist


def _batch(vocab: int):
    """8 left-padded prompts of up to 12 tokens and responses of up to 20 (rows longer than a
    sliding window of 8), their masks and advantages."""
    gen = torch.Generator().manual_seed(7)
    starts = torch.tensor([0, 3, 5, 0, 8, 2, 6, 1])
    prompt_mask = torch.arange(12)[None] >= starts[:, None]
    prompts = torch.randint(3, vocab, (8, 12), generator=gen).masked_fill(~prompt_mask, 0)
    lengths = torch.tensor([20, 7, 13, 20, 4, 16, 9, 11])
    response_mask = torch.arange(20)[None] < lengths[:, None]
    responses = torch.randint(3, vocab, (8, 20), generator=gen).masked_fill(~response_mask, 0)
    advantages = torch.randn(8, generator=gen)
    return torch.cat([prompts, responses], 1), prompt_mask, response_mask, advantages


def loss_and_grad_norm(folder: str, world: int = 1, rank: int = 0) -> dict[str, float]:
    """``{"loss", "grad_norm"}`` of the folder's model on this rank's rows (all rows when
    ``world`` is 1), reduced over ranks."""
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor
    from torchtune import training

    from torchtune_grpo.models import hf_checkpointer
    from torchtune_grpo.policy.forward import micro_batch_logprobs
    from torchtune_grpo.policy.model import build_model

    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model",
                            "model_dir": folder})
    ckpt = hf_checkpointer(folder, output_dir=tempfile.mkdtemp(prefix="fsdp_family_"))
    state = ckpt.load_checkpoint()[training.MODEL_KEY]
    model = build_model(cfg, state, device=torch.device("cpu"), dtype=torch.float32,
                        world_size=world)
    vocab = int(json.loads(open(f"{folder}/config.json").read())["vocab_size"])
    tokens, prompt_mask, response_mask, advantages = _batch(vocab)
    total_tokens = response_mask.sum()
    rows = slice(rank, None, world)
    logprobs, _ = micro_batch_logprobs(model, tokens[rows], prompt_mask[rows],
                                       response_mask[rows])
    summed = -(advantages[rows, None] * logprobs * response_mask[rows]).sum() / total_tokens
    (summed * world).backward()
    squares = torch.zeros(())
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            squares = squares + grad.double().pow(2).sum()
    loss = summed.detach()
    if world > 1:
        dist.all_reduce(loss)
    return {"loss": float(loss), "grad_norm": float(squares.sqrt())}


def main(argv: list[str]) -> None:
    """``OUT.json FOLDER ...``: write ``{folder: {"loss", "grad_norm"}}`` from rank 0."""
    from torchtune_grpo.distributed import init_distributed

    torch.manual_seed(0)
    world, rank = init_distributed(torch.device("cpu"))
    out = {folder: loss_and_grad_norm(folder, world, rank) for folder in argv[1:]}
    if rank == 0:
        with open(argv[0], "w") as f:
            json.dump(out, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
