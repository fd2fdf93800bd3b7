"""Finished rows stop decoding: generation tokens/s with ``shrink_finished`` off vs. on.

The workload varies in length the way real rollouts do: a random Llama (4 layers, dim 256,
vocab 32k, untied output: near-uniform next-token logits) and a logit bias on one stop id
chosen so that the stop token is sampled with probability about ``--stop-prob`` (3%) at
every step, so completion lengths are roughly geometric (mean about 33 of 128 allowed).
``batch`` rows (``batch / 8`` prompts x 8 samples, one micro-batch) are generated with
temperature-1 sampling, once with every row decoded until the last one stops
(``shrink_finished=False``, the engine before this change) and once with stopped rows dropped
from the decode batch (``shrink_finished=True``), alternating, ``--repeats`` times each, in
the same process. Both runs produce the same tokens (checked: tokens, masks and stop flags
equal, log-probs within 1e-6), so tokens/s is the count of generated (unmasked) tokens over
the wall time of :func:`~torchtune_grpo.rollout.native.generate_trajectory`.

Usage::

    python benchmarks/finished_rows.py                       # 32 rows x 128 tokens, 2 threads
    python benchmarks/finished_rows.py --repeats 5 --out finished_rows.json

The machine may be shared: absolute tokens/s move with its load; the ratio of the medians
(and the median of the ratios of adjacent off/on pairs), measured in one invocation with the
runs interleaved, is the figure to compare.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: python benchmarks/finished_rows.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from torchtune_grpo.quickstart.tiny import tiny_llama  # noqa: E402
from torchtune_grpo.rollout.native import generate_trajectory  # noqa: E402
from torchtune_grpo.rollout.protocol import GenerationRequest

DIMS = {"vocab_size": 32000, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
        "embed_dim": 256, "max_seq_len": 1024, "tie_word_embeddings": False}


def stop_bias(model: torch.nn.Module, prompts: torch.Tensor, stop_id: int, prob: float) -> float:
    """Bias on ``stop_id`` that makes its probability about ``prob`` after ``prompts``.

    Measured on the prompts' last-position logits ``[B, V]``: ``b`` such that the mean of
    ``exp(l_stop + b) / (exp(l_stop + b) + sum_{j != stop} exp(l_j))`` is ``prob`` (solved per
    row, then the median taken).
    """
    with torch.no_grad():
        logits = model(prompts)[:, -1].double()  # [B, V]
    others = torch.cat([logits[:, :stop_id], logits[:, stop_id + 1 :]], dim=1)
    per_row = math.log(prob / (1 - prob)) + others.logsumexp(-1) - logits[:, stop_id]
    return float(per_row.median())


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = tiny_llama(**DIMS).eval()
    vocab = DIMS["vocab_size"]
    stop_id, pad_id = vocab - 1, 0
    groups = args.batch // 8
    prompts = torch.randint(1, vocab - 1, (groups, args.prompt_len))
    bias = torch.zeros(vocab)
    bias[stop_id] = stop_bias(model, prompts, stop_id, args.stop_prob)
    kwargs = {"group_size": 8, "forward_batch_size": args.batch, "max_generated_tokens":
              args.new_tokens, "temperature": 1.0, "top_k": None,
              "stop_tokens": torch.tensor([stop_id]), "pad_id": pad_id, "logit_bias": bias}
    mask = torch.ones_like(prompts, dtype=torch.bool)
    seeds = torch.arange(groups) + 1000

    def generate(shrink: bool):
        t0 = time.perf_counter()
        traj = generate_trajectory(model, GenerationRequest(prompts, mask, prompt_seeds=seeds,
            **kwargs),
            shrink_finished=shrink)
        return traj, time.perf_counter() - t0

    generate(True)  # warm-up (allocator, kernels)
    rates: dict[bool, list[float]] = {False: [], True: []}
    outputs = {}
    for _ in range(args.repeats):
        for shrink in (False, True):
            traj, seconds = generate(shrink)
            outputs[shrink] = traj
            rates[shrink].append(int(traj.response_mask.sum()) / seconds)
            print(f"shrink_finished={shrink!s:5}  {rates[shrink][-1]:8.1f} tok/s  "
                  f"({seconds:.2f} s)", flush=True)
    old, new = outputs[False], outputs[True]
    same = (torch.equal(old.tokens, new.tokens) and torch.equal(old.response_mask,
            new.response_mask) and torch.equal(old.stopped, new.stopped))
    max_diff = float((old.logprobs - new.logprobs).abs().max())
    lengths = old.response_mask.sum(1).float()
    result = {
        "shape": DIMS, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats,
        "stop_prob": args.stop_prob, "stop_bias": float(bias[stop_id]),
        "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
        "rows_stopped": int(old.stopped.sum()), "decode_steps": old.response_len,
        "same_tokens": same, "max_logprob_diff": max_diff,
        "tok_s_off": rates[False], "tok_s_on": rates[True],
        "median_off": statistics.median(rates[False]),
        "median_on": statistics.median(rates[True]),
    }
    result["ratio"] = result["median_on"] / result["median_off"]
    # each "on" run against the "off" run just before it: less exposed to load drift
    pairs = [on / off for off, on in zip(rates[False], rates[True])]
    result["pair_ratios"] = pairs
    result["median_pair_ratio"] = statistics.median(pairs)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="rows (a multiple of 8)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--stop-prob", type=float, default=0.03)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"lengths: mean {result['mean_length']:.1f}, max {result['max_length']} of "
          f"{args.new_tokens}; {result['rows_stopped']}/{args.batch} rows stopped; "
          f"same tokens: {result['same_tokens']}, max log-prob diff "
          f"{result['max_logprob_diff']:.2e}")
    print(f"median tok/s: off {result['median_off']:.1f}, on {result['median_on']:.1f}, "
          f"ratio on/off {result['ratio']:.2f}; median of the {args.repeats} paired ratios "
          f"{result['median_pair_ratio']:.2f}")
    if args.out:
        harness.write_json(args.out, result)
    if not result["same_tokens"] or result["max_logprob_diff"] > 1e-6:
        sys.exit("outputs differ between shrink_finished off and on")


if __name__ == "__main__":
    main()
