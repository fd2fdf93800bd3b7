"""The update's plan of micro-batches (:func:`plan_micro_batches`): rows, skipped rows, lockstep
fillers and the micro-batch that carries the skipped rows' normaliser share, as plain data."""

import torch

from torchtune_grpo.training.update import MicroBatch, micro_batches_needed, plan_micro_batches


def rows(plan: list[list[MicroBatch]]) -> list[list[list[int]]]:
    return [[mb.rows.tolist() for mb in epoch] for epoch in plan]


def test_each_epoch_follows_its_order_in_micro_batches_of_size():
    orders = [torch.tensor([3, 0, 2, 1, 5, 4]), torch.tensor([1, 2, 3, 4, 5, 0])]
    plan = plan_micro_batches(orders, torch.zeros(6, dtype=torch.bool), size=4, count=2)
    assert rows(plan) == [[[3, 0, 2, 1], [5, 4]], [[1, 2, 3, 4], [5, 0]]]
    assert all(mb.counts and not mb.adds_skipped_share for epoch in plan for mb in epoch)


def test_skipped_rows_leave_the_order_and_the_first_micro_batch_carries_their_share():
    orders = [torch.tensor([3, 0, 2, 1, 5, 4]), torch.tensor([4, 5, 0, 1, 2, 3])]
    skip = torch.tensor([False, True, False, False, True, False])
    plan = plan_micro_batches(orders, skip, size=2, count=2)
    assert rows(plan) == [[[3, 0], [2, 5]], [[5, 0], [2, 3]]]
    assert [[mb.adds_skipped_share for mb in epoch] for epoch in plan] == [[True, False]] * 2


def test_a_rank_with_fewer_rows_runs_fillers_that_count_nothing():
    skip = torch.tensor([True, True, True, False])
    assert micro_batches_needed(skip, size=2) == 1
    plan = plan_micro_batches([torch.tensor([0, 1, 2, 3])], skip, size=2, count=3)
    (epoch,) = plan
    assert [mb.counts for mb in epoch] == [True, False, False]
    assert [mb.rows.tolist() for mb in epoch] == [[3], [0], [0]]
    assert epoch[1].rows.dtype == torch.long


def test_every_row_skipped_still_runs_one_filler_per_epoch_with_the_share():
    skip = torch.ones(4, dtype=torch.bool)
    assert micro_batches_needed(skip, size=2) == 0
    plan = plan_micro_batches([torch.arange(4), torch.arange(4)], skip, size=2, count=1)
    assert [[(mb.counts, mb.adds_skipped_share) for mb in e] for e in plan] == [
        [(False, True)], [(False, True)]]
