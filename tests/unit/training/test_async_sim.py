"""benchmarks.async_sim: hand-checkable cases of the sync vs. async GRPO event simulation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import async_sim as sim

# a + b * rows per decode step, prefill per token, update per token
A, B_ROW, PRE, UPD = 0.01, 0.001, 1e-4, 1e-3
PROMPTS, G, P_TOK, L = 4, 2, 10, 100


def _cost(update=UPD, sync=0.0, **kw):
    return sim.CostModel(decode_fixed_s=A, decode_per_row_s=B_ROW, prefill_s_per_token=PRE,
                         update_s_per_token=update, sync_s=sync, **kw)


def _const_workload(length=L):
    return sim.Workload(PROMPTS, G, P_TOK, sim.LengthModel("empirical", values=(length,)))


def _gen(prompts):
    """One engine generating ``prompts`` x G rows of constant length L."""
    return PRE * P_TOK * prompts + A * L + B_ROW * prompts * G * L


def _upd(prompts, update=UPD):
    return prompts * G * (P_TOK + L) * update


def test_decode_time_is_the_sum_over_steps_and_shrinking_rows_cost_less():
    cost = _cost()
    lengths = np.array([1, 3, 10, 10, 4])
    by_steps = sum(cost.decode_step_s(int((lengths >= s).sum())) for s in range(1, 11))
    assert sim.decode_time(cost, lengths) == pytest.approx(by_steps)
    # finished rows dropped < every row decoded to the longest one
    assert sim.decode_time(cost, lengths) < 10 * cost.decode_step_s(len(lengths))
    assert sim.decode_time(cost, [1, 10]) == pytest.approx(A * 10 + B_ROW * 11)
    assert list(sim.active_rows(lengths, 11)) == [5, 4, 4, 3, 2, 2, 2, 2, 2, 2, 0]


def test_sync_constant_lengths_step_is_generation_plus_update():
    res = sim.simulate_sync(_cost(), _const_workload(), n_ranks=2, steps=4)
    assert res.s_per_step == pytest.approx(_gen(2) + _upd(2))  # 1.402 + 0.44
    assert res.step_s == pytest.approx([_gen(2) + _upd(2)] * 4)
    assert res.gen_busy_s == pytest.approx(_gen(2))
    assert res.update_busy_s == pytest.approx(_upd(2))
    assert res.lockstep_wait_s == pytest.approx(0.0)
    assert res.rollout_idle_s == res.trainer_idle_s == 0.0


def test_async_k0_is_a_sequential_pipeline():
    # 1 rollout rank generates both trainer shards (2 prompts each) one after the other
    res = sim.simulate_async(_cost(), _const_workload(), 1, 2, k=0, steps=5)
    assert res.s_per_step == pytest.approx(2 * _gen(2) + _upd(2))
    # with a sync cost it is paid once in the chain: send/receive, generate, update
    res = sim.simulate_async(_cost(sync=0.3), _const_workload(), 1, 2, k=0, steps=5)
    assert res.s_per_step == pytest.approx(0.3 + 2 * _gen(2) + _upd(2))
    for prev, rec in zip(res.records, res.records[1:]):
        assert rec.gen_start >= prev.update_end  # no overlap
        assert rec.version == rec.step


@pytest.mark.parametrize("k", [1, 2])
def test_async_overlap_generation_bound(k):
    res = sim.simulate_async(_cost(), _const_workload(), 1, 2, k=k, steps=8)
    gen, upd = 2 * _gen(2), _upd(2)  # 2.804 > 0.44
    assert res.s_per_step == pytest.approx(max(gen, upd))
    assert res.rollout_idle_s == pytest.approx(0.0)
    assert res.trainer_idle_s == pytest.approx(res.s_per_step - upd)
    assert res.gen_busy_s == pytest.approx(gen)
    assert [r.version for r in res.records] == [max(0, t - k) for t in range(8)]


@pytest.mark.parametrize("k", [1, 2])
def test_async_overlap_trainer_bound(k):
    update = 0.01
    gen, upd = 2 * _gen(2), _upd(2, update)  # 2.804 < 4.4
    res = sim.simulate_async(_cost(update=update), _const_workload(), 1, 2, k=k, steps=12)
    assert res.s_per_step == pytest.approx(upd)
    assert res.trainer_idle_s == pytest.approx(0.0)
    # the rollout rank starts k batches ahead; it uses up that lead in about
    # k * gen / (upd - gen) = 1.8k steps, waiting less meanwhile
    assert res.rollout_idle_s < res.s_per_step - gen
    settled = sim.simulate_async(_cost(update=update), _const_workload(), 1, 2, k=k, steps=12,
                                 warmup=2 * k + 2)
    assert settled.s_per_step == pytest.approx(upd)
    assert settled.rollout_idle_s == pytest.approx(settled.s_per_step - gen)
    sync = sim.simulate_sync(_cost(update=update), _const_workload(), 3, steps=4)
    assert sync.s_per_step > res.s_per_step


def test_async_sync_cost_is_paid_on_both_sides():
    s = 0.25
    for update in (UPD, 0.01):
        res = sim.simulate_async(_cost(update=update, sync=s), _const_workload(), 1, 2, k=1,
                                 steps=8)
        gen, upd = 2 * _gen(2), _upd(2, update)
        assert res.s_per_step == pytest.approx(max(gen + s, upd + s))
        assert res.sync_busy_s == s
        # every rollout-rank second is receive, generate or wait; same for trainers
        assert res.rollout_idle_s + gen + s == pytest.approx(res.s_per_step)
        assert res.trainer_idle_s + upd + s == pytest.approx(res.s_per_step)


def test_two_rollout_ranks_share_the_shards():
    # R=2, T=4: each rollout rank generates 2 shards of 1 prompt
    res = sim.simulate_async(_cost(), _const_workload(), 2, 4, k=0, steps=4)
    assert res.s_per_step == pytest.approx(2 * _gen(1) + _upd(1))


def test_deterministic_under_seed_and_same_lengths_for_both_modes():
    wl = sim.Workload(8, 4, 16, sim.LengthModel("geometric", stop_prob=0.05, max_tokens=64))
    cost = _cost(sync=0.1, logprob_s_per_token=2e-4, logprob_passes=1)
    a = sim.simulate_async(cost, wl, 1, 2, k=1, steps=6, seed=3)
    b = sim.simulate_async(cost, wl, 1, 2, k=1, steps=6, seed=3)
    assert a.step_s == b.step_s and a.records == b.records
    assert sim.simulate_sync(cost, wl, 3, 6, seed=3).step_s == \
        sim.simulate_sync(cost, wl, 3, 6, seed=3).step_s
    assert sim.simulate_async(cost, wl, 1, 2, k=1, steps=6, seed=4).step_s != a.step_s
    x = sim.sample_lengths(wl, 3, 2)
    assert x.shape == (32,) and x.max() <= 64 and x.min() >= 1
    assert np.array_equal(x, sim.sample_lengths(wl, 3, 2))
    assert not np.array_equal(x, sim.sample_lengths(wl, 3, 1))


def test_sync_generation_is_lockstep():
    cost = _cost()
    phase, own = sim.lockstep_generation(cost, [np.array([1, 1]), np.array([10, 10])], [1, 1],
                                         P_TOK)
    pre = PRE * P_TOK
    assert own == pytest.approx([pre + A * 1 + B_ROW * 2, pre + A * 10 + B_ROW * 20])
    assert phase == pytest.approx(pre + A * 10 + B_ROW * 20)  # the short rank waits
    # per step the slower rank counts: rank 0 has 3 rows for 2 steps, rank 1 one row for 5
    phase, _ = sim.lockstep_generation(cost, [np.array([2, 2, 2]), np.array([5])], [1, 1], 0)
    assert phase == pytest.approx(A * 5 + B_ROW * (3 + 3 + 1 + 1 + 1))
    # through simulate_sync: prompts 0-1 (rank 0) short, prompts 2-3 (rank 1) long
    wl = sim.Workload(4, 1, P_TOK, sim.LengthModel("empirical", values=(3,)))
    res = sim.simulate_sync(cost, wl, 2, 2)
    assert res.gen_busy_s == pytest.approx(PRE * P_TOK * 2 + A * 3 + B_ROW * 6)


def test_sync_lockstep_waits_for_the_longest_row_over_ranks():
    wl = sim.Workload(4, 2, P_TOK, sim.LengthModel("lognormal", median=50, sigma=0.8,
                                                   max_tokens=400))
    res = sim.simulate_sync(_cost(), wl, 2, 3, seed=1)
    lengths = sim.sample_lengths(wl, 1, 1)
    rank_gen = [PRE * P_TOK * 2 + sim.decode_time(_cost(), lengths[i * 4:(i + 1) * 4])
                for i in range(2)]
    gen1 = res.records[1].batch_ready - res.records[1].gen_start
    assert gen1 >= max(rank_gen) - 1e-12
    assert gen1 >= PRE * P_TOK * 2 + A * lengths.max()
    assert res.lockstep_wait_s > 0


def test_splits_and_uneven_shards():
    assert sim.async_splits(8) == [(1, 7), (2, 6), (4, 4)]
    assert sim.split_prompts(256, 6) == [(0, 43), (43, 86), (86, 129), (129, 172), (172, 214),
                                         (214, 256)]


def test_validate_relative_error():
    cost = _cost(sync=0.05)
    sync = sim.simulate_sync(cost, _const_workload(), 3, 20)
    asy = sim.simulate_async(cost, _const_workload(), 1, 2, 1, 20)
    measured = {
        "costs": {"decode_fixed_s": A, "decode_per_row_s": B_ROW, "prefill_s_per_token": PRE,
                  "update_s_per_token": UPD, "sync_s": 0.05},
        "workload": {"prompts": PROMPTS, "group_size": G, "prompt_tokens": P_TOK,
                     "lengths": {"kind": "empirical", "values": [L]}},
        "runs": [{"mode": "sync", "ranks": 3, "k": 0, "s_per_step": sync.s_per_step * 1.25},
                 {"mode": "async", "rollout_ranks": 1, "trainer_ranks": 2, "k": 1,
                  "s_per_step": asy.s_per_step * 0.8}],
    }
    out = sim.validate(measured)
    assert out["rel_error"]["sync 3"] == pytest.approx(1 / 1.25 - 1)  # -0.2
    assert out["rel_error"]["async 1+2 k=1"] == pytest.approx(1 / 0.8 - 1)  # +0.25
    assert out["max_abs_rel_error"] == pytest.approx(0.25)
    assert out["runs"][1]["predicted_s"] == pytest.approx(asy.s_per_step)


def test_profile_is_first_principles_arithmetic():
    cost, wl = sim.h100_qwen25_3b()
    n = 3.09e9
    assert cost.update_s_per_token == pytest.approx(6 * n / (989e12 * 0.4))
    assert cost.logprob_s_per_token == pytest.approx(2 * n / (989e12 * 0.4))
    assert cost.decode_fixed_s == pytest.approx(2 * n / (3.35e12 * 0.7) + 1e-3)
    assert cost.for_world(32, 8).sync_s == pytest.approx(2 * 2 * n / 40e9)
    assert cost.for_world(8, 8).sync_s == cost.sync_s
    assert (wl.prompts, wl.group_size, wl.lengths.max_tokens) == (256, 8, 1024)


def test_cli_profile_prints_table(capsys):
    assert sim.main(["--profile", "h100-qwen2.5-3b", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "| world | mode | split (R+T) | k | s/step | speed-up vs sync |" in out
    assert "| 8 | sync | 8 | 0 |" in out and "| 32 | sync | 32 | 0 |" in out
    assert "8 GPUs" in out and "32 GPUs" in out and "best async k=1" in out


def test_cli_costs_json(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({
        "costs": {"decode_fixed_s": A, "decode_per_row_s": B_ROW, "prefill_s_per_token": PRE,
                  "update_s_per_token": UPD},
        "workload": {"prompts": 8, "group_size": 2, "prompt_tokens": P_TOK,
                     "lengths": {"kind": "geometric", "stop_prob": 0.1, "max_tokens": 50}},
        "steps": 5}))
    out_json = tmp_path / "out.json"
    assert sim.main(["--costs", str(path), "--node", "2", "--nodes", "2", "--all-splits",
                     "--out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| 4 | async* | 2+2 | 1 |" in out and "| 4 | async | 1+3 | 2 |" in out
    summary = json.loads(out_json.read_text())
    assert [w["world"] for w in summary["worlds"]] == [2, 4]
