"""DAPO's dynamic sampling: extra prompt draws, group selection, the loop and its collective.

The extra draws of a step are a pure function of ``(seed, step, draw)`` and never repeat the
step's main prompts; their rollout seeds differ from the main batch's; a step whose groups
all tie draws up to ``max_batches`` more batches and says so in its metrics; the kept groups
have a signal; the loss normaliser counts only the kept groups' tokens; and every rank makes
the same number of extra rollouts (checked with two gloo processes).
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtune_grpo.algorithm.advantages import group_advantages, loss_token_mask
from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.config.settings import DynamicSamplingSettings, settings_from_config
from torchtune_grpo.rewards.reward_set import RewardOutput
from torchtune_grpo.rollout.seeding import mix_seeds, rollout_seeds
from torchtune_grpo.training.batching import (
    StepBatches,
    dynamic_sample,
    group_rows,
    select_groups,
)

#: :func:`parity_length_reward` as a ``rewards=`` override (``tune run`` or in-process).
PARITY_REWARD = [{"_component_": "tests.unit.training.test_dynamic_sampling.parity_length_reward",
                  "success": True, "success_threshold": 3.0}]

G = 4  # completions per prompt
B = 3  # groups per rank
P, T = 2, 8


def parity_length_reward(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """A reward for recipe runs under which about half the groups tie: a completion's length
    when its problem's answer is odd, else 0 (every completion of an even-answer group ties)."""
    return [float(len(c)) if int(a) % 2 else 0.0 for c, a in zip(completions, answers)]


def constant_reward(completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """1 for every completion: every group ties."""
    return [1.0] * len(completions)


# ------------------------------------------------------------------------------ prompt stream
def _batches(n: int = 100, *, world_size: int = 1, rank: int = 0, seed: int = 0,
             shuffle: bool = True, batch_size: int = 4) -> StepBatches:
    return StepBatches(list(range(n)), batch_size=batch_size, world_size=world_size, rank=rank,
                       seed=seed, shuffle=shuffle, collate=lambda items: items)


def _global_extra(step: int, draw: int, world_size: int = 2, **kw) -> list[int]:
    shards = [_batches(world_size=world_size, rank=r, **kw).extra_indices(step, draw)
              for r in range(world_size)]
    return sorted(i for shard in shards for i in shard)


@pytest.mark.parametrize("shuffle", [True, False])
def test_extra_draws_are_deterministic_and_distinct_from_the_main_stream(shuffle):
    world_size = 2
    for step in range(6):  # crosses epochs: 100 prompts / 8 per step = 12 steps per epoch
        main = sorted(i for r in range(world_size)
                      for i in _batches(world_size=world_size, rank=r, shuffle=shuffle)
                      .indices(step))
        seen = set(main)
        for draw in (1, 2, 3):
            extra = _global_extra(step, draw, world_size, shuffle=shuffle)
            assert len(extra) == 8 and len(set(extra)) == 8
            assert not seen & set(extra), (step, draw)  # no main prompt, no earlier draw's
            seen |= set(extra)
            # a pure function of (seed, step, draw): a fresh instance, another call order
            fresh = _batches(world_size=world_size, rank=1, shuffle=shuffle)
            fresh.indices(step + 7)
            fresh.extra_indices(step, draw + 1)
            assert fresh.extra_indices(step, draw) == \
                _batches(world_size=world_size, rank=1, shuffle=shuffle).extra_indices(step,
                                                                                     draw)
    # other steps and other seeds draw other prompts
    assert _global_extra(0, 1) != _global_extra(1, 1)
    assert _global_extra(0, 1) != _global_extra(0, 1, seed=1)


def test_extra_draws_keep_the_rank_partition_and_wrap_on_a_small_dataset():
    one = _batches(world_size=1, batch_size=8).extra_indices(3, 2)
    assert sorted(one) == _global_extra(3, 2, world_size=2)  # same global prompts on 1 or 2
    tiny = _batches(n=8, batch_size=8)  # the dataset is one global batch: extra draws repeat it
    assert sorted(tiny.extra_indices(0, 1)) == list(range(8))
    small = _batches(n=12, batch_size=8)  # 4 prompts outside the main batch: wrap around
    extra = small.extra_indices(0, 1)
    assert len(extra) == 8 and not set(extra) & set(small.indices(0))
    with pytest.raises(ValueError, match="numbered from 1"):
        small.extra_indices(0, 0)


def test_rollout_seeds_of_extra_draws_differ_from_the_main_batch():
    indices = torch.tensor([3, 17, 42])
    main = rollout_seeds(7, 5, indices)
    assert torch.equal(main, mix_seeds(7, 5, indices))  # runs without dynamic sampling unchanged
    draws = [rollout_seeds(7, 5, indices, k) for k in (1, 2, 3)]
    every = torch.cat([main, *draws])
    assert len(set(every.tolist())) == every.numel()
    assert torch.equal(draws[0], rollout_seeds(7, 5, indices.tolist(), 1))


def test_settings_validate_max_batches():
    assert settings_from_config(DynamicSamplingSettings, {"max_batches": 3},
                                "dynamic_sampling").max_batches == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="dynamic_sampling"):
            settings_from_config(DynamicSamplingSettings, {"max_batches": bad},
                                 "dynamic_sampling")
    with pytest.raises(ValueError, match="Did you mean 'dynamic_sampling.max_batches'"):
        settings_from_config(DynamicSamplingSettings, {"max_batch": 2}, "dynamic_sampling")


def test_config_key_is_validated():
    from torchtune_grpo.config.schema import RECIPE_KEYS

    key = RECIPE_KEYS["dynamic_sampling"]
    assert key.default is None and key.settings is DynamicSamplingSettings


# ------------------------------------------------------------------------------ selection
def test_select_groups_prefers_signal_in_draw_order_and_fills_with_ties():
    tied = torch.tensor([True, False, True, False, False, True])
    assert select_groups(tied, 2).tolist() == [1, 3]
    assert select_groups(tied, 3).tolist() == [1, 3, 4]
    assert select_groups(tied, 4).tolist() == [0, 1, 3, 4]  # one tie completes the batch
    assert select_groups(torch.ones(5, dtype=torch.bool), 3).tolist() == [0, 1, 2]
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]
    with pytest.raises(ValueError, match="at least"):
        select_groups(tied, 7)


# ------------------------------------------------------------------------------ the loop
def _length(draw: int, group: int, sample: int) -> int:
    """Response length of a fake completion: distinct enough that a wrong row shows."""
    return 1 + (3 * draw + 5 * group + sample) % T


def _fake(draw: int, group_rewards: list[list[float]]) -> tuple[Trajectory, RewardOutput]:
    """A rollout of ``len(group_rewards)`` groups; each row's prompt holds ``(draw, group)``."""
    n = len(group_rewards) * G
    tokens = torch.zeros(n, P + T, dtype=torch.long)
    response_mask = torch.zeros(n, T, dtype=torch.bool)
    for g in range(len(group_rewards)):
        for i in range(G):
            row = g * G + i
            tokens[row, 0], tokens[row, 1] = draw, g
            response_mask[row, : _length(draw, g, i)] = True
    tokens[:, P:] = torch.where(response_mask, 7, 0)
    traj = Trajectory(tokens=tokens, prompt_mask=torch.ones(n, P, dtype=torch.bool),
                      response_mask=response_mask,
                      logprobs=-response_mask.float(), stopped=torch.ones(n, dtype=torch.bool),
                      pad_id=0)
    total = torch.tensor([r for rewards in group_rewards for r in rewards], dtype=torch.float32)
    assert total.numel() == n
    rewards = RewardOutput(total=total, components={"c": total.clone()},
                           success=total > 0, errors={"c": draw})
    return traj, rewards


TIE = [1.0] * G
SIGNAL = [0.0, 1.0, 0.0, 1.0]


class _Draws:
    """``draw(k)`` of fake rollouts from a plan ``{k: groups}``; records the draws made."""

    def __init__(self, plan: dict[int, list[list[float]]]) -> None:
        self.plan, self.made = plan, []

    def __call__(self, k: int):
        self.made.append(k)
        return _fake(k, self.plan[k])


def _origin(traj: Trajectory) -> list[tuple[int, int]]:
    """``(draw, group)`` of each group of ``traj``."""
    return [(int(traj.tokens[r, 0]), int(traj.tokens[r, 1])) for r in range(0, len(traj.tokens), G)]


def _alone(flag: bool) -> bool:
    return flag


def test_all_tied_groups_draw_up_to_max_batches_and_say_so():
    draws = _Draws({1: [TIE] * B, 2: [TIE] * B, 3: [TIE] * B})
    out = dynamic_sample(_fake(0, [TIE] * B), draws, batch_size=B, group_size=G,
                         max_batches=3, all_ranks_true=_alone)
    assert draws.made == [1, 2, 3] and out.extra_rollouts == 3
    assert out.signal_groups == 0
    assert out.traj.num_sequences == B * G  # the batch is still full: ties complete it
    assert _origin(out.traj) == [(0, 0), (0, 1), (0, 2)]  # the first ties, in draw order
    every = sum(_length(d, g, i) for d in range(4) for g in range(B) for i in range(G))
    assert out.generated_tokens == every  # the dropped rollouts' tokens are counted
    assert out.rewards.errors == {"c": 0 + 1 + 2 + 3}


def test_kept_groups_have_a_signal_and_the_draws_stop_when_the_batch_is_full():
    draws = _Draws({1: [TIE, SIGNAL, TIE], 2: [SIGNAL, [2.0, 0.0, 0.0, 0.0], SIGNAL],
                    3: [SIGNAL] * B})
    main = _fake(0, [TIE, SIGNAL, TIE])
    out = dynamic_sample(main, draws, batch_size=B, group_size=G, max_batches=5,
                         all_ranks_true=_alone)
    assert draws.made == [1, 2] and out.extra_rollouts == 2
    assert out.signal_groups == B
    assert _origin(out.traj) == [(0, 1), (1, 1), (2, 0)]  # the first signals, in draw order
    tied = group_advantages(out.rewards.total, G).zero_std_groups
    assert not tied.any()
    stds = out.rewards.total.view(B, G).std(dim=1)
    assert (stds > 0).all()
    assert torch.equal(out.rewards.components["c"], out.rewards.total)
    # the rows' rewards travelled with their trajectories
    assert out.rewards.total.view(B, G).tolist() == [SIGNAL, SIGNAL, SIGNAL]


def test_no_tied_group_draws_nothing_and_changes_nothing():
    main = _fake(0, [SIGNAL] * B)
    out = dynamic_sample(main, _Draws({}), batch_size=B, group_size=G, max_batches=2,
                         all_ranks_true=_alone)
    assert out.extra_rollouts == 0 and out.traj is main[0] and out.rewards is main[1]


def test_short_batch_after_max_batches_keeps_every_signal_and_completes_with_ties():
    draws = _Draws({1: [TIE, TIE, SIGNAL]})
    out = dynamic_sample(_fake(0, [TIE, TIE, TIE]), draws, batch_size=B, group_size=G,
                         max_batches=1, all_ranks_true=_alone)
    assert out.extra_rollouts == 1 and out.signal_groups == 1
    assert _origin(out.traj) == [(0, 0), (0, 1), (1, 2)]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("exclude", [False, True])
def test_loss_normaliser_counts_only_the_kept_tokens(aggregation, exclude):
    draws = _Draws({1: [SIGNAL, TIE, SIGNAL], 2: [TIE] * B})
    out = dynamic_sample(_fake(0, [TIE, SIGNAL, TIE]), draws, batch_size=B, group_size=G,
                         max_batches=2, all_ranks_true=_alone)
    kept = [(0, 1), (1, 0), (1, 2)]
    assert _origin(out.traj) == kept
    adv = group_advantages(out.rewards.total, G)
    mask = loss_token_mask(out.traj.response_mask, out.traj.stopped, adv.zero_std_groups,
                           exclude_zero_std_groups=exclude)
    loss_fn = GRPOLoss(aggregation=aggregation)
    normaliser = float(loss_fn.normalizer_contribution(mask))
    kept_tokens = sum(_length(d, g, i) for d, g in kept for i in range(G))
    expected = kept_tokens if aggregation == "token_mean" else len(kept) * G
    assert normaliser == expected
    dropped = out.generated_tokens - kept_tokens
    assert dropped > 0  # the dropped groups generated tokens the normaliser does not see


# ------------------------------------------------------------------------------ two ranks
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    from torchtune_grpo.distributed import WORLD

    all_ranks_true = WORLD.all_ranks_true

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        # rank 0's batch is full of signal at once; rank 1's ties until its second extra draw
        plan = ({k: [SIGNAL] * B for k in (1, 2, 3)} if rank == 0
                else {1: [TIE] * B, 2: [SIGNAL] * B, 3: [SIGNAL] * B})
        main = [SIGNAL] * B if rank == 0 else [TIE] * B
        draws = _Draws(plan)
        out = dynamic_sample(_fake(0, main), draws, batch_size=B, group_size=G,
                             max_batches=3,
                             all_ranks_true=lambda flag: all_ranks_true(flag, torch.device("cpu")))
        dist.barrier()
        torch.save({"made": draws.made, "extra": out.extra_rollouts,
                    "origin": _origin(out.traj)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_makes_the_same_number_of_extra_rollouts():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_worker, args=(_free_port(), out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    assert [r["made"] for r in results] == [[1, 2], [1, 2]]
    assert [r["extra"] for r in results] == [2, 2]
    assert results[0]["origin"] == [(0, 0), (0, 1), (0, 2)]  # a full rank keeps its own batch
    assert results[1]["origin"] == [(2, 0), (2, 1), (2, 2)]


# ------------------------------------------------------------------------------ the recipe
@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The quickstart model after a few warm-up steps."""
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("base"), warmup_steps=20)


def _train(base, out, rewards, *overrides, capture=None):
    from tests.recipes._helpers import metrics, train_in_process
    from torchtune_grpo.training.recipe import GRPORecipe

    if capture is not None:
        update = GRPORecipe.update

        def recording_update(self, traj, advantages, ref, loss_mask=None, old_logprobs=None):
            capture.append({"traj": traj, "advantages": advantages.cpu(),
                            "loss_mask": loss_mask.cpu(),
                            "normaliser": float(self.loss_fn.normalizer_contribution(loss_mask))})
            return update(self, traj, advantages, ref, loss_mask, old_logprobs)

        GRPORecipe.update = recording_update
    try:
        train_in_process(base, out, "global_batch_size=8", "batch_size=null", "group_size=4",
                         *overrides, rewards=rewards)
    finally:
        if capture is not None:
            GRPORecipe.update = update
    return metrics(out)


@pytest.mark.slow
def test_recipe_all_tied_batch_draws_max_batches_and_the_metrics_say_so(tiny_base, tmp_path,
                                                                         monkeypatch):
    import torchtune_grpo.rollout.runtime as rollouts_module

    seeds = []  # (step, draw, seeds) of every rollout

    def recording_seeds(seed, step, indices, draw=0):
        out = rollout_seeds(seed, step, indices, draw)
        seeds.append((step, draw, out))
        return out

    monkeypatch.setattr(rollouts_module, "rollout_seeds", recording_seeds)
    rewards = [{"_component_": "tests.unit.training.test_dynamic_sampling.constant_reward",
                "success": True}]
    captured = []
    rows = _train(tiny_base, tmp_path / "run", rewards, "num_steps=2",
                  "dynamic_sampling={max_batches: 3}", capture=captured)
    assert [(step, draw) for step, draw, _ in seeds] == [(s, d) for s in (0, 1)
                                                         for d in (0, 1, 2, 3)]
    every = torch.cat([s for _, _, s in seeds])
    assert len(set(every.tolist())) == every.numel()  # extra draws sample with other seeds
    for row in rows:
        assert row["dynamic_sampling/extra_rollouts"] == 3
        assert row["dynamic_sampling/kept_fraction"] == 0
        assert row["zero_std_group_fraction"] == 1
    for c in captured:
        assert c["traj"].num_sequences == 8 * 4  # ties complete the batch
        assert not c["advantages"].any()


@pytest.mark.slow
def test_recipe_trains_on_kept_groups_only_and_normalises_by_their_tokens(tiny_base, tmp_path):
    captured = []
    rows = _train(tiny_base, tmp_path / "run", PARITY_REWARD, "num_steps=2",
                  "dynamic_sampling={max_batches: 2}", "loss.aggregation=token_mean",
                  capture=captured)
    off = _train(tiny_base, tmp_path / "off", PARITY_REWARD, "num_steps=1")
    assert off[0]["zero_std_group_fraction"] > 0  # without it, the first batch has ties
    assert rows[0]["dynamic_sampling/extra_rollouts"] >= 1
    for row, c in zip(rows, captured):
        traj = c["traj"]
        assert traj.num_sequences == 8 * 4
        kept = row["dynamic_sampling/kept_fraction"]
        tied = c["advantages"].view(8, 4).eq(0).all(dim=1)
        assert kept == pytest.approx(1 - float(tied.float().mean()))
        assert c["normaliser"] == float(traj.response_mask.sum())  # the update's own rows
        assert row["dynamic_sampling/generated_tokens"] > c["normaliser"]  # dropped groups


@pytest.mark.slow
def test_recipe_metrics_with_dynamic_sampling_are_documented(tiny_base, tmp_path):
    """Every metric a run with dynamic sampling logs is explained in docs/metrics.md (the
    docs' own check runs without it)."""
    from tests.docs.test_doc_snippets import _documented_metric_patterns

    rows = _train(tiny_base, tmp_path / "run", PARITY_REWARD, "num_steps=1",
                  "dynamic_sampling={max_batches: 1}")
    logged = {k for row in rows for k in row} - {"step"}
    assert {k for k in logged if k.startswith("dynamic_sampling/")} == {
        "dynamic_sampling/extra_rollouts", "dynamic_sampling/kept_fraction",
        "dynamic_sampling/generated_tokens"}
    patterns = _documented_metric_patterns()
    assert not sorted(k for k in logged if not any(p.match(k) for p in patterns))
