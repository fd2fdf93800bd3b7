"""Which prompts each rank trains on at each step: a pure function of ``(seed, step)``.

Every epoch is a permutation of the dataset drawn from ``(seed, epoch)``; step ``s`` takes the
``s``-th slice of ``global_batch = batch_size * world_size`` prompts of its epoch, and rank
``r`` keeps every ``world_size``-th of them starting at ``r``. Nothing has to be saved for an
exact resume except the step, and a run resumed on a different number of ranks with the same
global batch trains on exactly the same prompts. (A per-rank ``StatefulDataLoader`` state
could not move to another world size; the prompts are pre-tokenized in memory, so a loader's
workers would buy nothing.)

**Dynamic sampling** (DAPO; config ``dynamic_sampling: {max_batches: K}``) draws up to ``K``
extra batches in a step whose groups tied. Extra draw ``k`` (1-based) of step ``s`` is
:meth:`StepBatches.extra_indices`: the ``k``-th slice of a permutation drawn from
``(seed, s)`` alone, from which the step's main prompts are left out, so it is a pure function of
``(seed, s, k)`` too, holds none of the step's main prompts, and no two extra draws of a step
share a prompt (while the dataset has enough). :func:`select_groups` picks the groups a step
trains on, and :func:`dynamic_sample` is the loop, with the collective that keeps every rank's
number of extra rollouts the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtune_grpo.rollout.seeding import mix_seeds

#: Salt of the per-step permutation that extra draws of dynamic sampling come from.
EXTRA_DRAW_SALT = 0xE7A5


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

    def extra_indices(self, step: int, draw: int) -> list[int]:
        """Dataset indices of this rank's extra ``draw`` (1-based) of ``step`` (dynamic sampling).

        A permutation of the dataset drawn from ``(seed, step)`` (independent of the epoch's
        shuffle, of ``shuffle`` and of any other call), without the step's main global batch;
        draw ``k`` takes its ``k``-th slice of ``global_batch`` prompts (wrapping around when
        the dataset holds fewer than ``k + 1`` global batches), and rank ``r`` every
        ``world_size``-th of them. A pure function of ``(seed, step, draw)``: nothing is
        consumed, so a resumed run draws the same extra prompts.

        Raises:
            ValueError: ``draw < 1``.
        """
        if draw < 1:
            raise ValueError(f"extra draws are numbered from 1, got {draw}")
        epoch, offset = divmod(step, self.steps_per_epoch)
        start = offset * self.global_batch
        main = self._permutation(epoch)[start : start + self.global_batch]
        gen = torch.Generator().manual_seed(
            int(mix_seeds(self.seed, step, EXTRA_DRAW_SALT)))
        order = torch.randperm(len(self.dataset), generator=gen)
        is_main = torch.zeros(len(self.dataset), dtype=torch.bool)
        is_main[main] = True
        pool = order[~is_main[order]]
        if len(pool) == 0:  # the whole dataset is one global batch: repeat it
            pool = order
        positions = torch.arange((draw - 1) * self.global_batch, draw * self.global_batch)
        global_indices = pool[positions % len(pool)]
        return global_indices[self.rank :: self.world_size].tolist()

    def extra_batch(self, step: int, draw: int) -> dict[str, Any]:
        """The collated batch of :meth:`extra_indices` (``batch_size`` prompts, like
        :meth:`batch`)."""
        return self.collate([self.dataset[i] for i in self.extra_indices(step, draw)])


def select_groups(tied: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The groups a step trains on under dynamic sampling, in their draw order.

    The first ``batch_size`` groups with a signal (rewards not all equal), in draw order; when
    there are fewer, the batch is completed with the first tied groups, in draw order (they
    have advantage 0, so they add no policy gradient; they count in the loss normaliser unless
    ``exclude_zero_std_groups`` is set, exactly as a tied group of a step without dynamic
    sampling). The batch therefore always holds ``batch_size`` groups, so every rank runs the
    same number of micro-batches (FSDP lockstep) and ``forward_batch_size`` still divides it.

    Args:
        tied: ``[M]`` bool, True for groups whose rewards all tie, in draw order
            (``M >= batch_size``).
        batch_size: groups to keep.

    Returns:
        ``[batch_size]`` int64 group indices into ``tied``, ascending.
    """
    if tied.numel() < batch_size:
        raise ValueError(f"select_groups needs at least {batch_size} groups, got {tied.numel()}")
    signal = torch.nonzero(~tied.bool()).flatten()[:batch_size]
    fill = torch.nonzero(tied.bool()).flatten()[: batch_size - len(signal)]
    return torch.sort(torch.cat([signal, fill])).values


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[len(groups) * G]`` row indices of ``groups`` (groups contiguous, ``G`` rows each)."""
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()


@dataclass
class SampledGroups:
    """What :func:`dynamic_sample` returns for one rank.

    Attributes:
        traj: the ``batch_size * G`` rows the step trains on (a
            :class:`~torchtune_grpo.algorithm.trajectory.Trajectory`).
        rewards: their :class:`~torchtune_grpo.rewards.reward_set.RewardOutput` (rows as
            ``traj``; reward error counts summed over every rollout of the step).
        extra_rollouts: extra batches drawn and rolled out (the same on every rank).
        signal_groups: groups of ``traj`` whose rewards do not all tie.
        generated_tokens: tokens generated by all of the step's rollouts on this rank,
            including the groups that were dropped.
    """

    traj: Any
    rewards: Any
    extra_rollouts: int
    signal_groups: int
    generated_tokens: int


def _select(traj: Any, rewards: Any, groups: torch.Tensor, group_size: int) -> tuple[Any, Any]:
    """Rows of ``groups`` of a trajectory and its reward output."""
    rows = group_rows(groups, group_size)
    picked = type(rewards)(
        total=rewards.total[rows],
        components={k: v[rows] for k, v in rewards.components.items()},
        success=rewards.success[rows],
        errors=dict(rewards.errors),
        counts=dict(rewards.counts),
    )
    return traj.select(rows.to(traj.tokens.device)), picked


def dynamic_sample(first: tuple[Any, Any],
                   draw: Callable[[int], tuple[Any, Any]], *,
                   batch_size: int, group_size: int, max_batches: int,
                   all_ranks_true: Callable[[bool], bool]) -> SampledGroups:
    """DAPO's dynamic sampling on one rank: draw more until the batch has a signal.

    After the main rollout, while this rank (or any other) holds fewer than ``batch_size``
    groups with a signal and fewer than ``max_batches`` extra batches were drawn, every rank
    draws, rolls out and scores one more batch (``draw(k)``, ``k = 1, 2, ...``). Whether to draw
    again is decided by ``all_ranks_true``, a collective, so every rank makes the same number
    of extra rollouts (FSDP's collectives inside a rollout need all ranks in lockstep), even a
    rank whose batch is already full. The batch then holds :func:`select_groups` of all groups
    drawn (a rank keeps at most ``2 * batch_size`` groups between draws).

    Args:
        first: ``(trajectory, reward output)`` of the step's main batch: ``batch_size * G``
            rows.
        draw: returns ``(trajectory, reward output)`` of extra draw ``k`` (1-based), rolled
            out with seeds that differ from the main batch's.
        batch_size: groups per rank.
        group_size: ``G``.
        max_batches: most extra draws (``K >= 1``).
        all_ranks_true: ``flag -> bool``, True when ``flag`` is True on every rank (a
            collective; :func:`torchtune_grpo.distributed.all_ranks_true`).

    Returns:
        :class:`SampledGroups`.
    """
    from torchtune_grpo.algorithm.advantages import group_advantages
    from torchtune_grpo.algorithm.trajectory import concat_trajectories
    from torchtune_grpo.rewards.scoring import concat_reward_outputs

    def tied(rewards: Any) -> torch.Tensor:
        return group_advantages(rewards.total, group_size).zero_std_groups.cpu()

    traj, rewards = first
    generated = int(traj.response_mask.sum())
    is_tied = tied(rewards)
    extra = 0
    while extra < max_batches and not all_ranks_true(int((~is_tied).sum()) >= batch_size):
        extra += 1
        new_traj, new_rewards = draw(extra)
        generated += int(new_traj.response_mask.sum())
        traj = concat_trajectories([traj, new_traj])
        rewards = concat_reward_outputs([rewards, new_rewards])
        is_tied = torch.cat([is_tied, tied(new_rewards)])
        # keep what the final selection can still use: at most batch_size groups of each kind
        keep = torch.sort(torch.cat([
            torch.nonzero(~is_tied).flatten()[:batch_size],
            torch.nonzero(is_tied).flatten()[:batch_size]])).values
        traj, rewards = _select(traj, rewards, keep, group_size)
        is_tied = is_tied[keep]
    if extra:
        traj, rewards = _select(traj, rewards, select_groups(is_tied, batch_size), group_size)
    signal = int((~tied(rewards)).sum())
    return SampledGroups(traj=traj, rewards=rewards, extra_rollouts=extra,
                         signal_groups=signal, generated_tokens=generated)


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


def dynamic_sampling_metrics(sampled: SampledGroups, seconds: dict[str, float], *,
                             ranks: Any, batch_size: int,
                             device: torch.device) -> dict[str, float]:
    """``dynamic_sampling/...`` over ``ranks`` (a collective), and
    ``tokens_per_second/generation`` counting every token the step generated (dropped groups
    included); ``batch_size``: groups per rank the step asked for."""
    t = torch.tensor([float(sampled.signal_groups), float(batch_size),
                      float(sampled.generated_tokens)], dtype=torch.float64, device=device)
    ranks.all_reduce(t, "sum")
    return {
        "dynamic_sampling/extra_rollouts": float(sampled.extra_rollouts),
        "dynamic_sampling/kept_fraction": float(t[0] / t[1]),
        "dynamic_sampling/generated_tokens": float(t[2]),
        "tokens_per_second/generation": float(t[2]) / max(seconds["generation"], 1e-9),
    }
