"""Tests for torchtune_grpo.algorithm.advantages."""

from __future__ import annotations

import math

import pytest
import torch
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
