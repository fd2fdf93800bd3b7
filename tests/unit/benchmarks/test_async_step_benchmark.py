"""benchmarks.async_step: the stopping model, the cost fit and the table (no torchrun)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import async_step as bench

torch.set_num_threads(1)  # small matmuls; two threads on two busy cores are far slower
sim = bench.async_sim
SMALL = {"num_layers": 2, "embed_dim": 64, "num_heads": 4, "num_kv_heads": 2}


def test_stop_probability_near_q_and_only_end_of_text():
    q = 0.05
    model, tok, info = bench.make_stopping_model(q, seed=0, dims=SMALL, probe=(4, 32))
    assert info["stop_prob_mean"] == pytest.approx(q, rel=0.02)  # bisection target
    # fresh positions, not the ones the bisection saw
    allowed, stops = bench._stop_ids(tok, 320)
    ordinary = torch.nonzero(allowed & ~torch.isin(torch.arange(320), stops)).flatten()
    gen = torch.Generator().manual_seed(123)
    tokens = ordinary[torch.randint(0, len(ordinary), (4, 48), generator=gen)]
    p = bench.stop_probability(model, tok, tokens)
    assert float(p.mean()) == pytest.approx(q, rel=0.3)
    # the stop mass is <|end_of_text|>'s: the other stop ids are pushed down
    with torch.no_grad():
        logits = model(tokens).float()
    logits[..., ~allowed] = -float("inf")
    probs = logits.softmax(-1)
    eos = int(tok.eos_id)
    others = [s for s in stops.tolist() if s != eos]
    assert float(probs[..., others].sum(-1).max()) < 0.1 * float(probs[..., eos].mean())
    # the residual's d0 is untouched by the layers: every output projection row d0 is zero
    for layer in model.layers:
        assert not layer.attn.output_proj.weight[bench.D0].any()
        assert not layer.mlp.w2.weight[bench.D0].any()


def test_length_calibration_on_own_completions():
    q, cap = 0.1, 16
    _, _, info = bench.make_stopping_model(q, seed=1, dims=SMALL, probe=(2, 16), max_tokens=cap)
    assert info["target_length"] == pytest.approx(bench.capped_geometric_mean(q, cap))
    assert info["expected_length"] == pytest.approx(info["target_length"], rel=0.02)


def test_capped_geometric_and_inverse():
    assert bench.capped_geometric_mean(0.5, 1) == pytest.approx(1.0)
    assert bench.capped_geometric_mean(1e-9, 96) == pytest.approx(96, rel=1e-5)
    rng = np.random.default_rng(0)
    draws = np.minimum(rng.geometric(0.03, 200_000), 96)
    assert draws.mean() == pytest.approx(bench.capped_geometric_mean(0.03, 96), rel=0.01)
    for p in (0.01, 0.03, 0.2):
        m = bench.capped_geometric_mean(p, 96)
        assert bench.stop_prob_for_mean(m, 96) == pytest.approx(p, rel=1e-6)
    # expected_length: constant p gives the capped geometric mean
    stop_p = torch.full((3, 5 + 20), 0.1)
    assert bench.expected_length(stop_p, 20) == pytest.approx(bench.capped_geometric_mean(0.1, 20))


def _synthetic(contention=1.5, upd=2e-3, overhead=0.3, sync=0.05, p=0.05, cap=40, ptok=11):
    decode = {"decode_fixed_s": 0.01, "decode_per_row_s": 0.001, "prefill_s_per_token": 1e-4}
    mean_len = bench.capped_geometric_mean(p, cap)
    workload = sim.Workload(6, 8, ptok, sim.LengthModel("geometric", stop_prob=p,
                                                        max_tokens=cap))
    base = sim.CostModel(decode["decode_fixed_s"], decode["decode_per_row_s"],
                         decode["prefill_s_per_token"], 0.0)
    phases = []
    for t in range(40):
        lens = sim.sample_lengths(workload, 0, t)
        phases.append(sim.lockstep_generation(base, [lens[i * 16:(i + 1) * 16] for i in range(3)],
                                              [2] * 3, ptok)[0])
    gen = contention * float(np.mean(phases))
    update = upd * 16 * (ptok + mean_len)
    sync_res = {"time/generation": gen, "time/update": update,
                "time/step": gen + update + overhead, "response_length/mean": mean_len}
    asyncs = [{"response_length/mean": mean_len, "time/weight_sync_sent": sync,
               "time/step": 0.8 * (gen + update), "async/trainer_wait_s": 0.1,
               "async/rollout_generate_s": 1.0, "async/rollout_weight_wait_s": 0.2}]
    return decode, sync_res, asyncs, mean_len


def test_fit_costs_recovers_synthetic_costs_and_validates():
    decode, sync_res, asyncs, mean_len = _synthetic()
    fit = bench.fit_costs(sync_res, asyncs, decode, prompt_tokens=11, max_tokens=40)
    c = fit["costs"]
    assert fit["contention"] == pytest.approx(1.5, rel=1e-9)
    assert c["decode_fixed_s"] == pytest.approx(0.015)
    assert c["decode_per_row_s"] == pytest.approx(0.0015)
    assert c["update_s_per_token"] == pytest.approx(2e-3)
    assert c["step_overhead_s"] == pytest.approx(0.3)
    assert c["sync_s"] == pytest.approx(0.05)
    assert fit["stop_prob"] == pytest.approx(0.05, rel=1e-6)
    assert fit["mean_length"] == pytest.approx(mean_len)
    results = {"sync": sync_res, "async k=1": asyncs[0]}
    val_in = bench.validation_input(fit, results)
    assert [r["mode"] for r in val_in["runs"]] == ["sync", "async"]
    assert val_in["runs"][1]["k"] == 1 and val_in["runs"][1]["trainer_ranks"] == 2
    val = sim.validate(val_in)
    # the sync row is fitted: only the update's per-step token variation is left
    assert abs(val["rel_error"]["sync 3"]) < 0.1
    assert "async 1+2 k=1" in val["rel_error"]


def test_fit_costs_async_recovers_the_rollout_and_trainer_phases():
    decode, sync_res, asyncs, mean_len = _synthetic()
    fit = bench.fit_costs(sync_res, asyncs, decode, prompt_tokens=11, max_tokens=40)
    workload = sim.workload_from_dict(fit["workload"])
    base = sim.CostModel(0.01, 0.001, 1e-4, 0.0)
    gen = np.mean([sum(sim.generation_time(base, sim.shard_rows(sim.sample_lengths(
        workload, 0, t), b, 8), 3, 11) for b in [(0, 3), (3, 6)]) for t in range(40)])
    upd = 1e-3 * 24 * (11 + mean_len)
    run = {**asyncs[0], "async/rollout_generate_s": 2.5 * gen, "time/update": upd,
           "time/generation": 0.2, "time/weight_sync": 0.05, "time/step": 0.2 + upd + 0.05 + 0.4}
    fit2 = bench.fit_costs_async(fit, [run], decode, prompt_tokens=11)
    c = fit2["costs"]
    assert fit2["contention"] == pytest.approx(2.5)
    assert c["decode_fixed_s"] == pytest.approx(0.025)
    assert c["update_s_per_token"] == pytest.approx(1e-3)
    assert c["step_overhead_s"] == pytest.approx(0.4)
    assert c["sync_s"] == fit["costs"]["sync_s"] and fit2["workload"] == fit["workload"]


def test_table_and_schedule():
    results = {
        "sync": {"time/step": 6.0, "time/generation": 3.0, "time/update": 2.5,
                 "response_length/mean": 33.0},
        "async k=1": {"time/step": 4.0, "async/trainer_wait_s": 0.25,
                      "async/rollout_generate_s": 3.5, "async/rollout_weight_wait_s": 0.1,
                      "response_length/mean": 34.0},
    }
    text = bench.table(results).splitlines()
    assert text[0] == bench.TABLE_HEADER.splitlines()[0] and len(text) == 4
    assert text[2].startswith("| sync |") and "1.00x" in text[2] and "3.00 gen" in text[2]
    assert text[3] == "| async k=1 | 1+2 | 1 | 4.00 | 1.50x | 0.25 | 3.50 | 0.10 | 34.00 |"
    assert bench.schedule([0, 1, 2], 2) == [("sync", 0), ("async", 0), ("async", 1),
                                            ("async", 2), ("async", 2), ("async", 1),
                                            ("async", 0), ("sync", 0)]
    rows = [{"time/step": s, "response_length/mean": 30.0, "time/weight_sync": w,
             "weight_sync/bytes": b} for s, w, b in [(9, 0.1, 1), (5, 0.2, 1), (7, 0.0, 0)]]
    summ = bench.summarize(rows, warmup=1)
    assert summ["time/step"] == 6.0 and summ["time/weight_sync_sent"] == 0.2
    merged = bench.merge([summ, {**summ, "time/step": 8.0}])
    assert merged["time/step"] == 7.0 and merged["s_per_step_repeats"] == [6.0, 8.0]
