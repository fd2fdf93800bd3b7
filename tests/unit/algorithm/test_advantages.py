"""Tests for torchtune_grpo.algorithm.advantages."""

from __future__ import annotations

import math
import os
import socket
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtune_grpo.algorithm.advantages import group_advantages


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=torch.float32), rtol=tol, atol=tol
    )


def test_group_scale_hand_values() -> None:
    # Group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3.
    # Group 1: rewards 2, 4, 6, 8 -> mean 5, unbiased var = (9 + 1 + 1 + 9) / 3 = 20/3.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    eps = 1e-6
    out = group_advantages(rewards, 4, eps=eps)
    s0 = math.sqrt(1.0 / 3.0) + eps
    s1 = math.sqrt(20.0 / 3.0) + eps
    _close(
        out.advantages,
        [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -3 / s1, -1 / s1, 1 / s1, 3 / s1],
    )
    assert out.zero_std_groups.tolist() == [False, False]
    assert out.advantages.dtype == torch.float32


def test_batch_scale_hand_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    mean = sum(rewards.tolist()) / 8  # 22 / 8 = 2.75
    var = sum((r - mean) ** 2 for r in rewards.tolist()) / 7  # unbiased over the batch
    s = math.sqrt(var) + 1e-6
    out = group_advantages(rewards, 4, scale="batch")
    _close(out.advantages, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -3 / s, -1 / s, 1 / s, 3 / s])


def test_none_scale_is_dr_grpo_centering() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    out = group_advantages(rewards, 4, scale="none")
    _close(out.advantages, [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_groups_flagged_and_exactly_zero(scale: str) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not be a rounding residue.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.2, 0.7, 0.7, 0.7])
    out = group_advantages(rewards, 3, scale=scale, eps=0.0)
    assert out.zero_std_groups.tolist() == [True, False, True]
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert out.advantages[6:].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(out.advantages).all()
    assert (out.advantages[3:6] != 0).all()


def test_all_groups_zero_std_batch_scale_no_nan() -> None:
    out = group_advantages(torch.ones(6), 3, scale="batch", eps=0.0)
    assert out.advantages.tolist() == [0.0] * 6
    assert out.zero_std_groups.tolist() == [True, True]


def test_group_size_one() -> None:
    out = group_advantages(torch.tensor([1.0, 2.0, 3.0]), 1)
    assert out.advantages.tolist() == [0.0, 0.0, 0.0]
    assert out.zero_std_groups.tolist() == [True, True, True]


def test_pure_function_does_not_modify_input() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=torch.float64)
    before = rewards.clone()
    out = group_advantages(rewards, 2)
    assert torch.equal(rewards, before)
    assert out.advantages.shape == (4,)
    assert out.zero_std_groups.shape == (2,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rewards": torch.zeros(6), "group_size": 4}, "group_size"),
        ({"rewards": torch.zeros(6), "group_size": 0}, "group_size"),
        ({"rewards": torch.zeros(2, 3), "group_size": 3}, "rewards"),
        ({"rewards": torch.zeros(6), "group_size": 3, "scale": "std"}, "scale"),
        ({"rewards": torch.zeros(6), "group_size": 3, "eps": -1.0}, "eps"),
        ({"rewards": torch.zeros(6), "group_size": 3, "estimator": "ppo"}, "estimator"),
        ({"rewards": torch.zeros(6), "group_size": 3, "estimator": "rloo", "scale": "group"},
         "scale='group' applies to the grpo estimator only"),
        ({"rewards": torch.zeros(3), "group_size": 1, "estimator": "rloo"}, "group_size >= 2"),
        ({"rewards": torch.zeros(3), "group_size": 1, "estimator": "reinforce_pp"},
         "group_size >= 2"),
        ({"rewards": torch.zeros(4), "group_size": 2, "estimator": "reinforce_pp",
          "token_counts": torch.ones(3)}, "token_counts"),
        ({"rewards": torch.zeros(4), "group_size": 2, "estimator": "reinforce_pp",
          "token_counts": torch.tensor([1, -1, 2, 2])}, "token_counts"),
        ({"rewards": torch.tensor([0.0, float("nan")]), "group_size": 2}, "rewards"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    data=st.data(),
)
def test_properties(groups: int, group_size: int, data: st.DataObject) -> None:
    values = data.draw(
        st.lists(
            st.sampled_from([0.0, 0.5, 1.0, 2.0]),
            min_size=groups * group_size,
            max_size=groups * group_size,
        )
    )
    rewards = torch.tensor(values)
    for scale in ("group", "batch", "none"):
        out = group_advantages(rewards, group_size, scale=scale)
        adv = out.advantages.view(groups, group_size)
        # Each group's advantages sum to ~0 and keep the reward ordering.
        assert torch.allclose(adv.sum(dim=1), torch.zeros(groups), atol=1e-4)
        r = rewards.view(groups, group_size)
        for g in range(groups):
            order = torch.sign(r[g].unsqueeze(0) - r[g].unsqueeze(1))
            assert torch.equal(torch.sign(adv[g].unsqueeze(0) - adv[g].unsqueeze(1)), order)
        if scale == "group":
            nz = ~out.zero_std_groups
            if nz.any():
                std = adv[nz].std(dim=1)
                assert torch.allclose(std, torch.ones_like(std), atol=1e-3)


def test_loss_token_mask_drops_truncated_and_zero_std_groups():
    from torchtune_grpo.algorithm.advantages import loss_token_mask

    response = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    stopped = torch.tensor([True, False, True, False])
    zero_std = torch.tensor([False, True])  # groups of 2: rows 2-3 had equal rewards
    assert torch.equal(loss_token_mask(response, stopped, zero_std), response)
    truncated = loss_token_mask(response, stopped, zero_std, mask_truncated_completions=True)
    assert truncated.sum(dim=1).tolist() == [2, 0, 1, 0]
    both = loss_token_mask(response, stopped, zero_std, mask_truncated_completions=True,
                           exclude_zero_std_groups=True)
    assert both.sum(dim=1).tolist() == [2, 0, 0, 0]


# ------------------------------------------------------------------------- other estimators
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0]


def test_default_scale_is_the_group_z_score() -> None:
    rewards = torch.tensor(REWARDS)
    default = group_advantages(rewards, 4).advantages
    assert torch.equal(default, group_advantages(rewards, 4, estimator="grpo").advantages)
    assert torch.equal(default, group_advantages(rewards, 4, scale="group").advantages)


def test_rloo_hand_values() -> None:
    # Each completion's baseline is the mean of the *other* three of its group, written out:
    # group 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3, ...
    # group 1: 2 - (4+6+8)/3 = -4, 4 - (2+6+8)/3 = -4/3, 6 - (2+4+8)/3 = 4/3, 8 - (2+4+6)/3 = 4
    out = group_advantages(torch.tensor(REWARDS), 4, estimator="rloo")
    _close(out.advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4.0, -4 / 3, 4 / 3, 4.0])
    assert out.zero_std_groups.tolist() == [False, False]


def test_rloo_is_the_leave_one_out_baseline_for_any_group_size() -> None:
    torch.manual_seed(0)
    for group_size in (2, 3, 5, 16):
        rewards = torch.randn(3 * group_size)
        out = group_advantages(rewards, group_size, estimator="rloo").advantages
        groups = rewards.view(3, group_size).tolist()
        expected = [r - (sum(g) - r) / (group_size - 1) for g in groups for r in g]
        _close(out, expected)


def test_rloo_tied_group_is_exactly_zero() -> None:
    out = group_advantages(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5]), 3, estimator="rloo")
    assert out.zero_std_groups.tolist() == [True, False]
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]


def _weighted_whiten(values: list[float], weights: list[float], eps: float) -> list[float]:
    """Token-weighted population whitening, written out with Python floats."""
    total = sum(weights)
    mean = sum(v * w for v, w in zip(values, weights)) / total
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / total
    return [(v - mean) / (math.sqrt(var) + eps) for v in values]


def test_reinforce_pp_hand_values_with_token_counts() -> None:
    # group baselines: [1, 0] -> c = [0.5, -0.5]; [3, 1] -> c = [1, -1]
    # token-weighted (1, 3, 2, 2): mean = (0.5 - 1.5 + 2 - 2) / 8 = -0.125,
    # var = (0.625^2 + 3 * 0.375^2 + 2 * 1.125^2 + 2 * 0.875^2) / 8 = 4.875 / 8
    counts = torch.tensor([1, 3, 2, 2])
    out = group_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, estimator="reinforce_pp",
                           token_counts=counts, eps=0.0)
    std = math.sqrt(4.875 / 8)
    _close(out.advantages, [0.625 / std, -0.375 / std, 1.125 / std, -0.875 / std])
    assert out.advantages.dtype == torch.float32
    # the statistics are token-weighted: unit weights give another answer
    unit = group_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, estimator="reinforce_pp",
                            eps=0.0).advantages
    _close(unit, _weighted_whiten([0.5, -0.5, 1.0, -1.0], [1.0] * 4, 0.0))
    assert not torch.allclose(unit, out.advantages, atol=1e-3)


def test_reinforce_pp_is_whitened_over_tokens_and_keeps_group_order() -> None:
    torch.manual_seed(1)
    rewards = torch.randint(0, 3, (24,)).float()
    counts = torch.randint(1, 40, (24,))
    out = group_advantages(rewards, 4, estimator="reinforce_pp", token_counts=counts, eps=0.0)
    w, a = counts.double(), out.advantages.double()
    mean = (w * a).sum() / w.sum()
    var = (w * (a - mean) ** 2).sum() / w.sum()
    assert abs(float(mean)) < 1e-6 and abs(float(var) - 1.0) < 1e-5
    c = (rewards.view(6, 4) - rewards.view(6, 4).mean(1, keepdim=True)).reshape(24)
    _close(out.advantages, _weighted_whiten(c.tolist(), counts.double().tolist(), 0.0), 1e-4)


def test_reinforce_pp_tied_group_gets_the_common_shift() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    counts = torch.tensor([2, 2, 1, 3])
    out = group_advantages(rewards, 2, estimator="reinforce_pp", token_counts=counts, eps=0.0)
    assert out.zero_std_groups.tolist() == [True, False]
    # c = [0, 0, 0.5, -0.5]; token mean = (0.5 - 1.5) / 8 = -0.125
    expected = _weighted_whiten([0.0, 0.0, 0.5, -0.5], [2.0, 2.0, 1.0, 3.0], 0.0)
    _close(out.advantages, expected)
    assert out.advantages[0] == out.advantages[1] > 0


def test_estimators_on_an_all_tied_batch_give_zeros_without_nan() -> None:
    for estimator in ("rloo", "reinforce_pp"):
        out = group_advantages(torch.ones(6), 3, estimator=estimator, eps=0.0,
                               token_counts=torch.tensor([1, 2, 3, 4, 5, 6]))
        assert out.advantages.tolist() == [0.0] * 6, estimator


# ---------------------------------------------------------------- exactness across ranks
class _ThreadRanks:
    """``reduce_sum`` for ``world`` threads that each hold a part of the batch."""

    def __init__(self, world: int) -> None:
        self.world, self.barrier = world, threading.Barrier(world)
        self.lock, self.parts = threading.Lock(), {}

    def reduce_sum(self, rank: int):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            with self.lock:
                self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts[r] for r in range(self.world))
            self.barrier.wait()
            tensor.copy_(total)
            return tensor
        return reduce


@pytest.mark.parametrize("kwargs", [{"estimator": "reinforce_pp"},
                                    {"estimator": "grpo", "scale": "batch"}])
def test_batch_statistics_are_global_across_ranks(kwargs: dict) -> None:
    torch.manual_seed(2)
    rewards = torch.randint(0, 4, (32,)).float() * 0.5
    counts = torch.randint(1, 50, (32,))
    whole = group_advantages(rewards, 4, token_counts=counts, **kwargs).advantages
    ranks, results = _ThreadRanks(2), {}

    def run(rank: int) -> None:
        part = slice(16 * rank, 16 * (rank + 1))  # whole groups per rank
        results[rank] = group_advantages(rewards[part], 4, token_counts=counts[part],
                                         reduce_sum=ranks.reduce_sum(rank), **kwargs).advantages

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    split = torch.cat([results[0], results[1]])
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    # the global statistics matter: one rank's own statistics give other advantages
    local = group_advantages(rewards[:16], 4, token_counts=counts[:16], **kwargs).advantages
    assert not torch.allclose(local, whole[:16], atol=1e-3)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, out_dir: str) -> None:
    from torchtune_grpo.distributed import WORLD

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(3)
        rewards = torch.rand(24)
        counts = torch.randint(0, 30, (24,))
        part = slice(12 * rank, 12 * (rank + 1))
        out = {name: group_advantages(rewards[part], 3, token_counts=counts[part],
                                      reduce_sum=WORLD.all_reduce, **kwargs).advantages
               for name, kwargs in (("reinforce_pp", {"estimator": "reinforce_pp"}),
                                    ("batch", {"scale": "batch"}))}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_equal_one_process() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_gloo_worker, args=(_free_port(), out_dir), nprocs=2, join=True)
        parts = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    torch.manual_seed(3)
    rewards = torch.rand(24)
    counts = torch.randint(0, 30, (24,))
    for name, kwargs in (("reinforce_pp", {"estimator": "reinforce_pp"}),
                         ("batch", {"scale": "batch"})):
        whole = group_advantages(rewards, 3, token_counts=counts, **kwargs).advantages
        assert whole.abs().max() > 0.1, name
        torch.testing.assert_close(torch.cat([parts[0][name], parts[1][name]]), whole,
                                   rtol=1e-6, atol=1e-6)
