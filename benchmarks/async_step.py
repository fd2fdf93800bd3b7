"""Seconds per step of synchronous vs. asynchronous GRPO through the real recipes, on CPU.

Runs, in one invocation, with the same model, data, global batch and steps:

* ``sync``: ``tune run --nproc_per_node 3 grpo_full_finetune_distributed --config
  grpo/quickstart_cpu`` (3 ranks each generate and update 2 prompts x 8);
* ``async k=0, 1, 2``: ``tune run --nproc_per_node 3 async_grpo_full_finetune_distributed
  --config grpo/quickstart_cpu_async rollout_ranks=1 max_staleness=k`` (rank 2 generates, ranks
  0-1 train 3 prompts x 8 each);

all with ``global_batch_size=6 batch_size=null group_size=8 max_generated_tokens=96``,
``num_steps`` steps, evaluation off, the quickstart addition prompts, a length reward
(``tests.recipes.components.length_reward``: the correctness reward is all zero on a random
model, so the update would be empty) and ``optimizer.lr=1e-8``: AdamW moves every one of the
3.2M weights by about ``lr`` per step whatever the gradient's size, and at ``1e-5`` the length
reward already lengthened the completions from 43 to 75 tokens in 3 steps; at ``1e-8`` the
length distribution stays put, so every mode (and every staleness) sees the same workload,
while the update costs exactly what it costs at any learning rate. Every process gets
``OMP_NUM_THREADS=--threads`` (default 1): **3 processes
share this machine's cores** (2 on the development machine), so ranks that run at the same
time slow each other down.

**Stopping model.** A random-weight Llama 3.2-architecture decoder (4 layers, dim 256, 4
heads, 2 KV heads, vocabulary 320, tied embeddings, 3.2M parameters; the quickstart byte
tokenizer) whose completions stop like real rollouts, roughly geometrically: the stop token
``<|end_of_text|>`` is sampled with probability about ``q`` (``--stop-prob``, default 0.03)
at every position, so lengths have mean about ``1 / q`` and are capped by
``max_generated_tokens``. Construction (:func:`make_stopping_model`), using the tied
embedding ``E`` (which is also the output layer):

1. scale ``E`` by ``--embed-scale`` (0.1), so the logits of the other tokens spread by ~1.5
   (random ``N(0, 1)`` embeddings against a normalised hidden state of norm 16 would make
   every position nearly deterministic, and the stop probability 0 or 1);
2. pick hidden dim ``d0 = 0``; set ``E[:, d0] = M`` (4) for every token and ``M + c`` for the
   stop token, ``M - 1`` for the tokenizer's other stop ids (``<|eot_id|>``, ``<|eom_id|>``:
   never sampled);
3. zero row ``d0`` of every layer's output projections (``attn.output_proj``, ``mlp.w2``), so
   the residual stream's ``d0`` stays exactly ``M`` and, after the final RMSNorm, ``h[d0]`` is
   nearly constant (``M`` dominates the norm); every logit gets the same ``M * h[d0]`` (no
   effect on the softmax) except the stop token's, which gets an extra ``c * h[d0]``;
4. choose ``c`` by bisection so that the mean stop probability (over the allowed vocabulary,
   temperature 1, all stop ids) at 8 x 64 positions of random token sequences is ``q``; then
   refine it on the model's own completions (16 rows sampled with the stop ids masked, so all
   run ``max_generated_tokens``): bisection on the expected capped length ``sum_t prod_{j<t}
   (1 - p_j)`` of those rows, to the capped geometric mean ``(1 - (1 - q)^T) / q`` (31.5 at
   ``q = 0.03, T = 96``). The stop probability varies over positions (std ~0.4 q), so the
   lengths are a geometric mixture: the recipe saw means of 32-35 and 4-10% truncated rows.

The recipe's own view of the lengths is printed per run (``response_length/mean``,
``truncated_fraction``) next to the capped-geometric prediction.

**Simulator validation** (``benchmarks/async_sim.py``): a :class:`CostModel` is fitted to this
machine, then ``async_sim.validate`` predicts the s/step of every mode:

* decode ``a + b * rows`` per decode step and prefill per token: a separate in-process decode
  measurement on one thread (``generate_trajectory`` with the stop token masked: 8 and 24 rows
  x ``max_generated_tokens``, and 24 rows x 1 token), **scaled** by the factor that makes the
  simulated lockstep generation of the sync run equal its measured ``time/generation`` (the
  contention of 3 processes on the cores, the gloo collectives per decode step);
* update per token: the sync run's ``time/update`` / (rows per rank x (prompt + mean
  response length)); step overhead: sync's ``time/step - time/generation - time/update``
  (scoring, rewards, logging);
* weight sync: the async runs' mean ``time/weight_sync`` over the steps that sent weights
  (``weight_sync/bytes > 0``; the last ``k + 1`` steps of a run send none);
* lengths: capped geometric with the stop probability whose capped mean equals the mean
  ``response_length/mean`` of all runs.

So with these **sync-fitted** costs the sync row is fitted (its error only reflects the
length model) and the async rows are predictions. A second set, **async-fitted**
(:func:`fit_costs_async`), takes decode, update and overhead from the async runs' own phases
(the decode scale from ``async/rollout_generate_s``, update per token from the trainers'
``time/update``); then the async rows are close by construction and the sync row is the
prediction. The gap between the two is what the simulator cannot model: CPU
oversubscription that changes with the schedule. In sync generation every decode step is a
collective of 3 processes on 2 cores, so each step waits for whichever rank the OS has
descheduled (the uncontended decode cost times ~3), while the rollout rank's engine decodes
alone and only competes for the cores with the trainers; at ``k = 0`` generation and update
alternate, so each runs with less contention than when they overlap. Also not modelled: the
trainers' extra no-grad forward of a stale batch (behaviour-version audit) and the rollout
transfer.

Usage::

    python benchmarks/async_step.py                     # 10 steps, sync,k0,k1,k2: ~4 min
    python benchmarks/async_step.py --repeats 2         # sync,k0,k1,k2,k2,k1,k0,sync: ~8 min
    python benchmarks/async_step.py --quick             # 4 steps, sync and k=1: ~2 min
    python benchmarks/async_step.py --out async_step.json

How to read the table: ``s/step`` is the mean of ``time/step`` (rank 0's wall seconds of a
whole step) over the steps after ``--warmup`` (2); ``speed-up`` is sync's s/step over the
row's. ``trainer wait`` (``async/trainer_wait_s``) is the trainers' idle time per step waiting
for their batch; ``rollout busy`` / ``rollout idle`` (``async/rollout_generate_s`` /
``async/rollout_weight_wait_s``) the rollout rank's generation and its wait for weights. For
``sync`` the busy column is ``time/generation`` and ``update`` ``time/update``. On 2 busy
cores, async can be slower than sync: the 3 processes compete for the cores, so overlap buys
less than the idle figures suggest. Absolute seconds depend on the machine's load; compare
rows of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

if not __package__:  # run as a file: python benchmarks/async_step.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import async_sim, harness  # noqa: E402

#: Dimensions of the stopping model (Llama 3.2 architecture, tied embeddings).
DIMS = {"vocab_size": 320, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "embed_dim": 256, "max_seq_len": 256}
#: Hidden dim that carries the constant ``M`` and the stop token's extra logit.
D0 = 0
#: The constant of hidden dim ``D0``.
M_CONST = 4.0
#: Reward that varies within every group of a random policy (tests/recipes/components.py).
LENGTH_REWARD = [{"_component_": "tests.recipes.components.length_reward", "success": True,
                  "success_threshold": 3.0}]
#: Metrics averaged per run (those present).
KEYS = ("time/step", "time/generation", "time/update", "time/weight_sync",
        "async/trainer_wait_s", "async/rollout_generate_s", "async/rollout_weight_wait_s",
        "weight_sync/bytes", "staleness/mean", "response_length/mean", "truncated_fraction")


# --------------------------------------------------------------------------------------------
# Stopping model
# --------------------------------------------------------------------------------------------


def _stop_ids(tokenizer, vocab: int):
    import torch

    from torchtune_grpo.token_rules import allowed_token_mask, stop_token_ids

    return allowed_token_mask(tokenizer, vocab), torch.tensor(stop_token_ids(tokenizer))


def set_stop_logit(model, tokenizer, c: float, m_const: float = M_CONST) -> None:
    """Column ``D0`` of the tied embedding: ``M`` everywhere, ``M + c`` on ``<|end_of_text|>``,
    ``M - 1`` on the other stop ids (so they are never sampled)."""
    import torch

    eos = int(tokenizer.eos_id)
    _, stops = _stop_ids(tokenizer, int(model.tok_embeddings.weight.shape[0]))
    with torch.no_grad():
        col = model.tok_embeddings.weight[:, D0]
        col.fill_(m_const)
        for s in stops.tolist():
            col[s] = m_const - 1.0
        col[eos] = m_const + c


def stop_probability(model, tokenizer, tokens) -> "torch.Tensor":  # noqa: F821
    """``[B, S]`` probability (temperature 1, allowed vocabulary) of any stop id at every
    position of ``tokens``."""
    import torch

    allowed, stops = _stop_ids(tokenizer, int(model.tok_embeddings.weight.shape[0]))
    with torch.no_grad():
        logits = model(tokens).float()
    logits[..., ~allowed] = -float("inf")
    return logits.softmax(-1)[..., stops].sum(-1)


def make_stopping_model(q: float = 0.03, seed: int = 0, dims: dict | None = None,
                        embed_scale: float = 0.1, probe: tuple[int, int] = (8, 64),
                        max_tokens: int | None = None, prompt_tokens: int = 11):
    """A random-weight decoder whose stop token has probability about ``q`` per position.

    See the module docstring for the construction. Returns ``(model, tokenizer, info)``;
    ``info`` has ``c``, the measured mean / std / 10-90% quantiles of the stop probability at
    the probe positions (``probe`` = rows x positions of random allowed tokens).
    """
    import torch

    from torchtune_grpo.quickstart.tiny import tiny_llama, tiny_tokenizer

    dims = {**DIMS, **(dims or {})}
    torch.manual_seed(seed)
    model = tiny_llama(**dims).eval()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_tokenizer(tmp)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(embed_scale)
        for layer in model.layers:
            layer.attn.output_proj.weight[D0] = 0
            layer.mlp.w2.weight[D0] = 0
    allowed, stops = _stop_ids(tokenizer, dims["vocab_size"])
    ordinary = torch.nonzero(allowed & ~torch.isin(torch.arange(dims["vocab_size"]), stops))
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = ordinary.flatten()[torch.randint(0, len(ordinary), probe, generator=gen)]

    def mean_p(c: float) -> float:
        set_stop_logit(model, tokenizer, c)
        return float(stop_probability(model, tokenizer, tokens).mean())

    lo, hi = -4.0, 4.0
    for _ in range(20):  # mean stop probability increases with c
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_p(mid) < q else (lo, mid)
    c_probe = (lo + hi) / 2
    c = c_probe
    if max_tokens:  # calibrate on the model's own completions: expected capped length
        seqs = _own_completions(model, tokenizer, ordinary.flatten(), max_tokens, seed)
        target = capped_geometric_mean(q, max_tokens)

        def mean_len(c: float) -> float:
            set_stop_logit(model, tokenizer, c)
            return expected_length(stop_probability(model, tokenizer, seqs), max_tokens)

        lo, hi = c_probe - 2.0, c_probe + 2.0
        for _ in range(16):  # expected length decreases with c
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_len(mid) > target else (lo, mid)
        c = (lo + hi) / 2
    set_stop_logit(model, tokenizer, c)
    p = stop_probability(model, tokenizer, tokens).flatten()
    info = {"c": c, "c_probe": c_probe, "q": q, "embed_scale": embed_scale, "M": M_CONST,
            "d0": D0, "stop_prob_mean": float(p.mean()), "stop_prob_std": float(p.std()),
            "stop_prob_q10_q90": [float(x) for x in p.quantile(torch.tensor([0.1, 0.9]))]}
    if max_tokens:
        info["expected_length"] = expected_length(
            stop_probability(model, tokenizer, seqs), max_tokens)
        info["target_length"] = target
    return model, tokenizer, info


def _own_completions(model, tokenizer, ordinary, max_tokens: int, seed: int,
                     prompts: int = 2, prompt_tokens: int = 11):
    """``[prompts * 8, prompt_tokens + max_tokens]``: random prompts and the model's own
    samples (temperature 1) with every stop id masked, so every row runs ``max_tokens``."""
    import torch

    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest
    from torchtune_grpo.token_rules import logit_bias_from_mask

    allowed, stops = _stop_ids(tokenizer, int(model.tok_embeddings.weight.shape[0]))
    allowed = allowed.clone()
    allowed[stops] = False
    gen = torch.Generator().manual_seed(seed + 2)
    ids = ordinary[torch.randint(0, len(ordinary), (prompts, prompt_tokens), generator=gen)]
    traj = generate_trajectory(model, GenerationRequest(ids, torch.ones_like(ids, dtype=torch.bool),
        group_size=8, forward_batch_size=8 * prompts, prompt_seeds=torch.arange(prompts) + seed,
        max_generated_tokens=max_tokens, temperature=1.0, top_k=None, stop_tokens=stops, pad_id=0,
        logit_bias=logit_bias_from_mask(allowed)))
    return traj.tokens[:, : prompt_tokens + max_tokens]


def expected_length(stop_p, max_tokens: int) -> float:
    """Expected capped completion length when ``stop_p[:, P - 1 + t]`` (``[rows, P + T]``, the
    prompt of ``P = S - T`` tokens first) is the stop probability of generated token ``t``:
    ``E[min(L, T)] = sum_{t < T} prod_{j < t} (1 - p_j)``, mean over rows."""
    import torch

    p = stop_p[:, -max_tokens - 1: -1].double()  # the positions that predict tokens 0..T-1
    survive = torch.cumprod(torch.cat([torch.ones_like(p[:, :1]), 1 - p[:, :-1]], 1), 1)
    return float(survive.sum(1).mean())


def capped_geometric_mean(p: float, cap: int) -> float:
    """``E[min(L, cap)]`` of ``L ~ Geometric(p)`` on ``1, 2, ...``."""
    return (1 - (1 - p) ** cap) / p


def stop_prob_for_mean(mean: float, cap: int) -> float:
    """The ``p`` whose capped geometric mean is ``mean`` (bisection; ``1 <= mean < cap``)."""
    lo, hi = 1e-6, 1.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if capped_geometric_mean(mid, cap) > mean else (lo, mid)
    return math.sqrt(lo * hi)


def write_model(directory: Path, q: float, seed: int, embed_scale: float,
                max_tokens: int) -> dict:
    """Write the stopping model + tokenizer as an HF folder; returns its ``info``."""
    from torchtune_grpo.quickstart.tiny import write_hf_checkpoint

    model, _, info = make_stopping_model(q, seed, embed_scale=embed_scale,
                                         max_tokens=max_tokens)
    write_hf_checkpoint(model, directory, DIMS)
    info["params"] = sum(p.numel() for p in model.parameters())
    return info


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def overrides(model_dir: Path, out: Path, steps: int, max_tokens: int) -> list[str]:
    """The ``key=value`` overrides every run shares (model dims, batch, reward, lr)."""
    d = DIMS
    return [f"model_dir={model_dir}", f"output_dir={out}", "progress_bar=false",
            "eval_every_n_steps=null", "eval_at_start=false", "global_batch_size=6",
            "batch_size=null", "group_size=8", f"max_generated_tokens={max_tokens}",
            f"num_steps={steps}", "optimizer.lr=1e-8", "rewards=" + json.dumps(LENGTH_REWARD),
            f"model.vocab_size={d['vocab_size']}", f"model.num_layers={d['num_layers']}",
            f"model.num_heads={d['num_heads']}", f"model.num_kv_heads={d['num_kv_heads']}",
            f"model.embed_dim={d['embed_dim']}", f"model.max_seq_len={d['max_seq_len']}",
            f"tokenizer.max_seq_len={d['max_seq_len']}"]


def run_mode(mode: str, k: int, model_dir: Path, out: Path, steps: int, max_tokens: int,
             threads: int, nproc: int = 3) -> list[dict[str, float]]:
    """One ``tune run`` (``mode`` ``sync`` or ``async`` at staleness ``k``); its training rows."""
    if mode == "sync":
        recipe, config, extra = "grpo_full_finetune_distributed", "grpo/quickstart_cpu", []
    else:
        recipe, config = "async_grpo_full_finetune_distributed", "grpo/quickstart_cpu_async"
        extra = ["rollout_ranks=1", f"max_staleness={k}"]
    harness.tune_run(["run", "--nproc_per_node", str(nproc), recipe, "--config", config,
                      *overrides(model_dir, out, steps, max_tokens), *extra],
                     cwd=out.parent, threads=threads,
                     pythonpath=[harness.REPO / "tests" / "recipes", harness.REPO], timeout=1800)
    return harness.training_rows(out)


def summarize(rows: Sequence[dict[str, float]], warmup: int) -> dict[str, float]:
    """Mean of each of :data:`KEYS` (present in the rows) over the rows after ``warmup``."""
    kept = list(rows[warmup:]) or list(rows)
    out: dict[str, float] = {"steps_averaged": len(kept)}
    for key in KEYS:
        vals = [r[key] for r in kept if key in r]
        if vals:
            out[key] = float(np.mean(vals))
    sent = [r["time/weight_sync"] for r in kept if r.get("weight_sync/bytes", 0) > 0]
    if sent:  # the last k + 1 steps send no weights (no batch left to generate)
        out["time/weight_sync_sent"] = float(np.mean(sent))
    out["time/step_all"] = [float(r["time/step"]) for r in rows if "time/step" in r]
    return out


def label(mode: str, k: int) -> str:
    return "sync" if mode == "sync" else f"async k={k}"


def merge(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean over the repeats of one mode (``runs``: :func:`summarize` results)."""
    out: dict[str, Any] = {"repeats": len(runs)}
    for key in KEYS + ("steps_averaged", "time/weight_sync_sent"):
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = float(np.mean(vals))
    out["s_per_step_repeats"] = [r["time/step"] for r in runs]
    return out


# --------------------------------------------------------------------------------------------
# Decode measurement and cost fitting
# --------------------------------------------------------------------------------------------


def measure_decode(model, tokenizer, prompt_tokens: int, max_tokens: int, threads: int,
                   repeats: int = 2) -> dict[str, float]:
    """Uncontended decode costs in this process: ``a`` (s per decode step), ``b`` (s per
    active row per decode step), prefill s per prompt token.

    ``generate_trajectory`` with every stop id masked (rows decode ``max_tokens`` tokens):
    8 rows (1 prompt x 8) and 24 rows (3 x 8) x ``max_tokens``, and 24 rows x 1 token (prefill
    of 3 prompts + one step); the best of ``repeats`` each.
    """
    import torch

    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest
    from torchtune_grpo.token_rules import logit_bias_from_mask

    torch.set_num_threads(threads)
    allowed, stops = _stop_ids(tokenizer, int(model.tok_embeddings.weight.shape[0]))
    allowed = allowed.clone()
    allowed[stops] = False
    bias = logit_bias_from_mask(allowed)

    def timed(prompts: int, tokens: int) -> float:
        ids = torch.randint(0, 256, (prompts, prompt_tokens))
        mask = torch.ones_like(ids, dtype=torch.bool)
        best = float("inf")
        for r in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            generate_trajectory(model, GenerationRequest(ids, mask, group_size=8,
                forward_batch_size=8 * prompts, prompt_seeds=torch.arange(prompts) + r,
                max_generated_tokens=tokens, temperature=1.0, top_k=None, stop_tokens=stops,
                pad_id=0, logit_bias=bias))
            if r:
                best = min(best, time.perf_counter() - t0)
        return best

    t8, t24, t1 = timed(1, max_tokens), timed(3, max_tokens), timed(3, 1)
    b = max((t24 - t8) / (16 * max_tokens), 0.0)
    a = max(t8 / max_tokens - 8 * b, 0.0)
    prefill = max((t1 - a - 24 * b) / (3 * prompt_tokens), 0.0)
    return {"decode_fixed_s": a, "decode_per_row_s": b, "prefill_s_per_token": prefill,
            "t_8rows_s": t8, "t_24rows_s": t24, "t_prefill_24rows_1tok_s": t1}


def fit_costs(sync: dict[str, float], asyncs: Sequence[dict[str, float]],
              decode: dict[str, float], prompt_tokens: int, max_tokens: int,
              sync_ranks: int = 3, prompts: int = 6, group_size: int = 8,
              sim_steps: int = 40, seed: int = 0) -> dict[str, Any]:
    """The :class:`async_sim.CostModel` and :class:`async_sim.Workload` of this machine.

    Args:
        sync: the sync run's means (:func:`summarize`); ``time/generation``, ``time/update``,
            ``time/step``, ``response_length/mean``.
        asyncs: the async runs' means (``time/weight_sync``, ``response_length/mean``).
        decode: :func:`measure_decode`'s uncontended ``a``, ``b``, prefill.
        prompt_tokens: prompt length (tokens).

    Returns:
        ``{"costs": CostModel fields, "workload": Workload as JSON, "contention":
        scale of the decode costs, "stop_prob": p of the length model}``.
    """
    means = [sync["response_length/mean"]] + [r["response_length/mean"] for r in asyncs]
    mean_len = float(np.mean(means))
    p = stop_prob_for_mean(mean_len, max_tokens)
    lengths = async_sim.LengthModel("geometric", stop_prob=p, max_tokens=max_tokens)
    workload = async_sim.Workload(prompts, group_size, prompt_tokens, lengths)
    base = async_sim.CostModel(decode["decode_fixed_s"], decode["decode_per_row_s"],
                               decode["prefill_s_per_token"], 0.0)
    per_rank = prompts // sync_ranks
    phases = []
    for t in range(sim_steps):
        lens = async_sim.sample_lengths(workload, seed, t)
        shards = [lens[i * per_rank * group_size:(i + 1) * per_rank * group_size]
                  for i in range(sync_ranks)]
        phases.append(async_sim.lockstep_generation(base, shards, [per_rank] * sync_ranks,
                                                    prompt_tokens)[0])
    contention = sync["time/generation"] / max(float(np.mean(phases)), 1e-12)
    tokens = per_rank * group_size * (prompt_tokens + sync["response_length/mean"])
    overhead = max(sync["time/step"] - sync["time/generation"] - sync["time/update"], 0.0)
    syncs = [r["time/weight_sync_sent"] for r in asyncs if "time/weight_sync_sent" in r]
    costs = async_sim.CostModel(
        decode_fixed_s=decode["decode_fixed_s"] * contention,
        decode_per_row_s=decode["decode_per_row_s"] * contention,
        prefill_s_per_token=decode["prefill_s_per_token"] * contention,
        update_s_per_token=sync["time/update"] / tokens,
        sync_s=float(np.mean(syncs)) if syncs else 0.0,
        step_overhead_s=overhead,
    )
    return {"costs": asdict(costs),
            "workload": {"prompts": prompts, "group_size": group_size,
                         "prompt_tokens": prompt_tokens,
                         "lengths": {"kind": "geometric", "stop_prob": p,
                                     "max_tokens": max_tokens}},
            "contention": contention, "stop_prob": p, "mean_length": mean_len}


def fit_costs_async(sync_fit: dict[str, Any], asyncs: Sequence[dict[str, float]],
                    decode: dict[str, float], prompt_tokens: int, trainers: int = 2,
                    sim_steps: int = 40, seed: int = 0) -> dict[str, Any]:
    """The cost model fitted to the async runs' own phases instead of the sync run's.

    Same lengths and weight sync as ``sync_fit`` (:func:`fit_costs`); decode costs: the
    uncontended ones scaled so that the simulated generation of one batch on the rollout rank
    (``trainers`` shards one after the other) equals the mean ``async/rollout_generate_s``;
    update per token: the trainers' ``time/update`` / (rows per trainer x (prompt + mean
    response length)); step overhead: ``time/step - time/generation - time/update -
    time/weight_sync`` (means over the async runs).
    """
    work = sync_fit["workload"]
    workload = async_sim.workload_from_dict(work)
    base = async_sim.CostModel(decode["decode_fixed_s"], decode["decode_per_row_s"],
                               decode["prefill_s_per_token"], 0.0)
    bounds = async_sim.split_prompts(workload.prompts, trainers)
    gens = []
    for t in range(sim_steps):
        lens = async_sim.sample_lengths(workload, seed, t)
        gens.append(sum(async_sim.generation_time(
            base, async_sim.shard_rows(lens, b, workload.group_size), b[1] - b[0],
            prompt_tokens) for b in bounds))
    measured_gen = float(np.mean([r["async/rollout_generate_s"] for r in asyncs]))
    scale = measured_gen / max(float(np.mean(gens)), 1e-12)
    rows = max(b[1] - b[0] for b in bounds) * workload.group_size
    upd = float(np.mean([r["time/update"] / (rows * (prompt_tokens + r["response_length/mean"]))
                         for r in asyncs]))
    overhead = float(np.mean([max(r["time/step"] - r["time/generation"] - r["time/update"]
                                  - r.get("time/weight_sync", 0.0), 0.0) for r in asyncs]))
    costs = {**sync_fit["costs"],
             "decode_fixed_s": decode["decode_fixed_s"] * scale,
             "decode_per_row_s": decode["decode_per_row_s"] * scale,
             "prefill_s_per_token": decode["prefill_s_per_token"] * scale,
             "update_s_per_token": upd, "step_overhead_s": overhead}
    return {**sync_fit, "costs": costs, "contention": scale}


def validation_input(fit: dict[str, Any], results: dict[str, dict[str, Any]],
                     sim_steps: int = 40, seed: int = 0) -> dict[str, Any]:
    """``async_sim.validate``'s input: the fitted costs and every mode's measured s/step."""
    runs = []
    for name, res in results.items():
        if name == "sync":
            runs.append({"mode": "sync", "ranks": 3, "k": 0, "s_per_step": res["time/step"]})
        else:
            runs.append({"mode": "async", "rollout_ranks": 1, "trainer_ranks": 2,
                         "k": int(name.split("=")[1]), "s_per_step": res["time/step"]})
    return {"costs": fit["costs"], "workload": fit["workload"], "steps": sim_steps,
            "seed": seed, "runs": runs}


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------

TABLE_HEADER = ("| mode | split | k | s/step | speed-up | trainer wait s | rollout busy s "
                "| rollout idle s | mean response length |\n|---|---|---|---|---|---|---|---|---|")


def table_row(name: str, res: dict[str, Any], sync_s: float) -> str:
    """One markdown row of :data:`TABLE_HEADER`; sync shows ``time/generation`` as busy and
    ``time/update`` in the idle column's place as ``upd``."""
    if name == "sync":
        split, k = "3 (gen + update)", "-"
        wait = "-"
        busy = f"{harness.fmt(res.get('time/generation'))} gen"
        idle = f"{harness.fmt(res.get('time/update'))} upd"
    else:
        split, k = "1+2", name.split("=")[1]
        wait = harness.fmt(res.get("async/trainer_wait_s"))
        busy = harness.fmt(res.get("async/rollout_generate_s"))
        idle = harness.fmt(res.get("async/rollout_weight_wait_s"))
    return (f"| {name} | {split} | {k} | {res['time/step']:.2f} | "
            f"{sync_s / res['time/step']:.2f}x | {wait} | {busy} | {idle} | "
            f"{harness.fmt(res.get('response_length/mean'))} |")


def table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of all modes (``results``: label -> merged means)."""
    sync_s = results["sync"]["time/step"]
    return "\n".join([TABLE_HEADER] + [table_row(n, r, sync_s) for n, r in results.items()])


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def schedule(ks: Sequence[int], repeats: int) -> list[tuple[str, int]]:
    """Run order: sync, k..., then mirrored on every second repeat (against load drift)."""
    one = [("sync", 0)] + [("async", k) for k in ks]
    order: list[tuple[str, int]] = []
    for i in range(repeats):
        order += one if i % 2 == 0 else one[::-1]
    return order


def prompt_length() -> int:
    """Mean token count of the quickstart addition prompts (the first 64 of the train split)."""
    from torchtune import config as tt_config

    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.quickstart.tiny import tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = tiny_tokenizer(tmp)
        cfg = load_config("grpo/quickstart_cpu", [])
        ds = tt_config.instantiate(cfg.dataset, tok)
        lens = [len(ds[i]["tokens"]) for i in range(min(64, len(ds)))]
    return int(round(float(np.mean(lens))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="num_steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the means")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2], help="max_staleness")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (mirrored order)")
    parser.add_argument("--stop-prob", type=float, default=0.03, help="q, per-position stop")
    parser.add_argument("--embed-scale", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=96, help="max_generated_tokens")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 steps (1 warm-up), sync and k=1")
    parser.add_argument("--out", help="write everything as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.k, args.repeats = 4, 1, [1], 1

    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores; "
          f"3 processes per run, OMP_NUM_THREADS={args.threads}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        info = write_model(work / "model", args.stop_prob, args.seed, args.embed_scale,
                           args.max_tokens)
        print(f"stopping model: {info['params'] / 1e6:.2f}M params, c={info['c']:.4f}, stop "
              f"probability on random tokens {info['stop_prob_mean']:.4f} (std "
              f"{info['stop_prob_std']:.4f},"
              f" 10-90% {info['stop_prob_q10_q90'][0]:.4f}-{info['stop_prob_q10_q90'][1]:.4f});"
              f" expected length on its own completions {info['expected_length']:.1f} vs. "
              f"capped geometric {info['target_length']:.1f}", flush=True)
        per_run: dict[str, list[dict[str, Any]]] = {}
        for i, (mode, k) in enumerate(schedule(args.k, args.repeats)):
            name = label(mode, k)
            t0 = time.perf_counter()
            rows = run_mode(mode, k, work / "model", work / f"run_{i}_{mode}_{k}", args.steps,
                            args.max_tokens, args.threads)
            res = summarize(rows, args.warmup)
            res["wall_s"] = time.perf_counter() - t0
            per_run.setdefault(name, []).append(res)
            print(f"  {name}: {res['time/step']:.2f} s/step, response length "
                  f"{res['response_length/mean']:.1f}, truncated "
                  f"{res.get('truncated_fraction', float('nan')):.3f}, command "
                  f"{res['wall_s']:.0f} s", flush=True)
        results = {n: merge(r) for n, r in per_run.items()}
        results = {n: results[n] for n in [label(m, k) for m, k in schedule(args.k, 1)]}

        import torch

        from torchtune_grpo.quickstart.tiny import tiny_tokenizer

        model, _, _ = make_stopping_model(args.stop_prob, args.seed,
                                          embed_scale=args.embed_scale, max_tokens=None)
        ptok = prompt_length()
        decode = measure_decode(model, tiny_tokenizer(work / "tok"), ptok, args.max_tokens,
                                args.threads)
        del model, torch
    asyncs = [r for n, r in results.items() if n != "sync"]
    fit = fit_costs(results["sync"], asyncs, decode, ptok, args.max_tokens, seed=args.seed)
    fits = {"sync-fitted": fit}
    if asyncs:
        fits["async-fitted"] = fit_costs_async(fit, asyncs, decode, ptok, seed=args.seed)
    validations = {}
    for name, f in fits.items():
        val_in = validation_input(f, results, seed=args.seed)
        validations[name] = {"input": val_in, "result": async_sim.validate(val_in)}

    p = fit["stop_prob"]
    print(f"\nlengths: mean response length over runs {fit['mean_length']:.1f} -> capped "
          f"geometric p={p:.4f} (predicted truncated fraction "
          f"{(1 - p) ** (args.max_tokens - 1):.3f}); prompt {ptok} tokens")
    print(f"uncontended decode (1 process): a={decode['decode_fixed_s'] * 1e3:.2f} ms/step, "
          f"b={decode['decode_per_row_s'] * 1e3:.3f} ms/row-step, prefill "
          f"{decode['prefill_s_per_token'] * 1e3:.3f} ms/token")
    for name, f in fits.items():
        c = f["costs"]
        print(f"{name} costs: decode x{f['contention']:.2f} of uncontended (a="
              f"{c['decode_fixed_s'] * 1e3:.2f} ms), update {c['update_s_per_token'] * 1e3:.3f}"
              f" ms/token, step overhead {c['step_overhead_s']:.2f} s, weight sync "
              f"{c['sync_s']:.3f} s")
    print(f"\n{args.steps} steps per run, means over steps {args.warmup}..{args.steps - 1}, "
          f"{args.repeats} repeat(s); sync: time/generation "
          f"{results['sync'].get('time/generation', 0):.2f} s, time/update "
          f"{results['sync'].get('time/update', 0):.2f} s\n")
    print(table(results))
    print("\nsimulator (benchmarks/async_sim.py) vs. measured s/step, with the costs fitted to "
          "the sync run (sync-fitted) and to the async runs' phases (async-fitted):")
    print("| run | measured s | " + " | ".join(f"{n} predicted s | rel. error" for n in fits)
          + " |\n|---|---|" + "---|---|" * len(fits))
    first = next(iter(validations.values()))["result"]["runs"]
    for i, r in enumerate(first):
        cells = [f"{v['result']['runs'][i]['predicted_s']:.2f} | "
                 f"{v['result']['runs'][i]['rel_error']:+.1%}" for v in validations.values()]
        print(f"| {r['label']} | {r['measured_s']:.2f} | " + " | ".join(cells) + " |")
    print("Not modelled: CPU oversubscription (3 processes on the cores) that changes with the "
          "schedule; in sync generation every decode step is a collective of 3 processes on "
          "oversubscribed cores (each waits for a descheduled peer), which the rollout rank's "
          "engine never does; the trainers' audit forward of stale batches.")
    if args.out:
        harness.write_json(args.out, {
            "args": vars(args), "load_average": load, "model": info, "prompt_tokens": ptok,
            "runs": per_run, "results": results, "decode": decode, "fits": fits,
            "validation": validations}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
