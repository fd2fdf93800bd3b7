"""Which prompts each rank trains on at each step: a pure function of ``(seed, step)``.

Every epoch is a permutation of the dataset drawn from ``(seed, epoch)``; step ``s`` takes the
``s``-th slice of ``global_batch = batch_size * world_size`` prompts of its epoch, and rank
``r`` keeps every ``world_size``-th of them starting at ``r``. Nothing has to be saved for an
exact resume except the step, and a run resumed on a different number of ranks with the same
global batch trains on exactly the same prompts. (A per-rank ``StatefulDataLoader`` state
could not move to another world size; the prompts are pre-tokenized in memory, so a loader's
workers would buy nothing.)
"""

from __future__ import annotations

from typing import Any

import torch

from torchtune_grpo.rlhf.seeding import mix_seeds


class StepBatches:
    """Deterministic per-step prompt batches (see the module docstring).

    Args:
        dataset: a map-style dataset of prompts (``len`` and ``[i]``).
        batch_size: prompts per rank per step.
        world_size: number of ranks.
        rank: this rank.
        seed: run seed.
        shuffle: permute each epoch (else dataset order).
        collate: turns a list of items into a batch.

    Raises:
        ValueError: the dataset holds fewer prompts than one global batch.
    """

    def __init__(self, dataset: Any, *, batch_size: int, world_size: int, rank: int,
                 seed: int, shuffle: bool, collate) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.collate = collate
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one step needs "
                f"({batch_size} per rank x {world_size} ranks)"
            )
        self._epoch = None
        self._order: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._epoch != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(int(mix_seeds(self.seed, epoch, 0x5EED)))
                self._order = torch.randperm(len(self.dataset), generator=gen)
            else:
                self._order = torch.arange(len(self.dataset))
            self._epoch = epoch
        return self._order

    def indices(self, step: int) -> list[int]:
        """Dataset indices this rank uses at (zero-based) ``step``."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = self._permutation(epoch)
        start = offset * self.global_batch
        global_indices = order[start : start + self.global_batch]
        return global_indices[self.rank :: self.world_size].tolist()

    def batch(self, step: int) -> dict[str, Any]:
        """The collated batch of this rank at (zero-based) ``step``."""
        return self.collate([self.dataset[i] for i in self.indices(step)])


def split_batch(batch: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """Split a collated prompt batch into ``chunks`` equal consecutive parts.

    Prompt padding is recomputed per part (a part's prompts are left-padded to its own
    longest prompt); lists and per-prompt tensors are sliced alike.
    """
    if chunks == 1:
        return [batch]
    size = len(batch["answers"]) // chunks
    parts = []
    for i in range(chunks):
        sl = slice(i * size, (i + 1) * size)
        width = int(batch["prompt_lengths"][sl].max())
        parts.append({
            **{k: v[sl] for k, v in batch.items() if k != "tokens"},
            "tokens": batch["tokens"][sl, batch["tokens"].shape[1] - width :],
        })
    return parts
