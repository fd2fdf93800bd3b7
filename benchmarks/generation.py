"""Generation throughput: the native engine vs. torchtune's ``generate``, HF and vLLM.

Every engine generates from the **same weights** (the torchtune model is written as an HF
checkpoint with :func:`torchtune_grpo.quickstart.tiny.write_hf_checkpoint` and loaded back by
``transformers``; the benchmark checks that both give the same logits), the same prompts
(random ids, no padding), with temperature-1 sampling over the full vocabulary and no stop
token, so every engine generates exactly ``batch * new_tokens`` tokens.

Engines:

* ``native``: :func:`torchtune_grpo.rollout.native.generate_trajectory` (one cache for the
  rollout, attention over the filled span only, log-probs returned).
* ``native_grpo``: the same, with the prompts arranged as a GRPO rollout (``batch / 8``
  prompts x 8 samples), so each prompt is prefilled once and shared by its group.
* ``torchtune``: ``torchtune.generation.generate`` of torchtune 0.6.1 with its KV cache
  (``model.setup_caches``).
* ``hf``: ``transformers`` ``LlamaForCausalLM.generate`` (skipped if not installed; it is in the
  ``bench`` extra: ``pip install -e ".[bench]"``).
* ``vllm``: when ``vllm`` imports (skipped otherwise).

FLOP bound: the machine's fp32 matmul rate ``R`` is measured in the same run (a square
``1024 x 1024 x 1024`` matmul, best of several). The work of generating ``B * T`` tokens after
``B`` prompts of ``P`` tokens, with no prefill sharing, is counted as::

    2 * N_body * B * (P + T)          # every position through every linear layer
  + 2 * V * D * B * T                 # output projection of the positions that are sampled
  + 4 * L * D_attn * B * sum_{i=1}^{P+T} i   # q.k and p.v over a causal context

(``N_body``: parameters of the transformer layers; ``D_attn = heads * head_dim``). The bound is
``R * B * T / work`` tokens/s; each engine is reported as a fraction of it and as a ratio to
torchtune's and to HF's tokens/s.

Usage::

    python benchmarks/generation.py                 # 32M and 1M shapes (a few minutes)
    python benchmarks/generation.py --quick         # smaller, about a minute
    python benchmarks/generation.py --out gen.json --threads 2

On a shared machine the numbers move with the load; the ratios are measured in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a file: python benchmarks/generation.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from torchtune_grpo.quickstart.tiny import tiny_llama, write_hf_checkpoint  # noqa: E402
from torchtune_grpo.rollout.native import generate_trajectory  # noqa: E402
from torchtune_grpo.rollout.protocol import GenerationRequest

#: Model shapes: ``32m`` is the anchor shape (8 layers, dim 512, vocab 2048).
SHAPES = {
    "32m": {"vocab_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
            "embed_dim": 512, "intermediate_dim": 2048, "max_seq_len": 512},
    "1m": {"vocab_size": 2048, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
           "embed_dim": 128, "intermediate_dim": 512, "max_seq_len": 512},
}
NO_STOP = 10**9  # a stop id no model can emit


@dataclass
class Workload:
    """One generation problem: ``batch`` prompts of ``prompt_len`` ids, ``new_tokens`` each."""

    batch: int
    prompt_len: int
    new_tokens: int


def generation_work(dims: dict, w: Workload) -> float:
    """FLOPs of generating ``w`` without prefill sharing (see the module docstring)."""
    d, v, layers = dims["embed_dim"], dims["vocab_size"], dims["num_layers"]
    heads, kv_heads = dims["num_heads"], dims["num_kv_heads"]
    head_dim = d // heads
    hidden = dims["intermediate_dim"]
    per_layer = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * hidden
    body = layers * per_layer
    total_len = w.prompt_len + w.new_tokens
    linear = 2 * body * w.batch * total_len + 2 * v * d * w.batch * w.new_tokens
    attention = 4 * layers * heads * head_dim * w.batch * total_len * (total_len + 1) / 2
    return linear + attention


# ---------------------------------------------------------------------------- engines
def run_native(model, prompts: torch.Tensor, w: Workload, group_size: int = 1) -> float:
    """Seconds for the native engine; ``group_size > 1`` shares each prompt's prefill."""
    rows = prompts[:: group_size] if group_size > 1 else prompts
    mask = torch.ones_like(rows, dtype=torch.bool)

    def go(new_tokens: int):
        traj = generate_trajectory(model, GenerationRequest(rows, mask, group_size=group_size,
            forward_batch_size=w.batch, prompt_seeds=torch.arange(rows.shape[0]),
            max_generated_tokens=new_tokens, temperature=1.0, top_k=None,
            stop_tokens=torch.tensor([NO_STOP]), pad_id=0))
        assert traj.response_mask.sum() == w.batch * new_tokens

    go(4)
    return harness.timed(lambda: go(w.new_tokens))


def run_torchtune(model, prompts: torch.Tensor, w: Workload) -> float:
    """Seconds for ``torchtune.generation.generate`` with torchtune's KV cache."""
    from torchtune.generation import generate
    from torchtune.modules.common_utils import delete_kv_caches

    gen = torch.Generator().manual_seed(0)

    def go(new_tokens: int):
        with torch.no_grad():
            model.setup_caches(batch_size=w.batch, dtype=torch.float32,
                               decoder_max_seq_len=w.prompt_len + new_tokens)
            try:
                out, _ = generate(model, prompts, max_generated_tokens=new_tokens, pad_id=0,
                                  temperature=1.0, top_k=None, stop_tokens=None, rng=gen)
            finally:
                delete_kv_caches(model)
        assert out.shape == (w.batch, w.prompt_len + new_tokens)

    go(4)
    return harness.timed(lambda: go(w.new_tokens))


def load_hf(model, dims: dict, directory: Path):
    """Write ``model`` as an HF checkpoint and load it with ``transformers`` (None if absent)."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    write_hf_checkpoint(model, directory, dims)
    hf = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():  # same weights, same function
        ids = torch.randint(0, dims["vocab_size"], (2, 16))
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    if diff > 1e-3:
        raise RuntimeError(f"HF and torchtune logits differ by {diff}: weights not copied")
    return hf


def run_hf(hf, prompts: torch.Tensor, w: Workload) -> float:
    """Seconds for ``transformers`` ``generate`` (sampling, top_k off, no early stop)."""
    mask = torch.ones_like(prompts)

    def go(new_tokens: int):
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape == (w.batch, w.prompt_len + new_tokens)

    torch.manual_seed(0)
    go(4)
    return harness.timed(lambda: go(w.new_tokens))


def run_vllm(directory: Path, prompts: torch.Tensor, w: Workload) -> float | str:
    """Seconds for vLLM, or the reason it was skipped."""
    try:
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001 - not installed or not usable here
        return f"skipped ({type(exc).__name__}: vllm not importable)"
    try:
        llm = LLM(model=str(directory), tokenizer=None, skip_tokenizer_init=True,
                  dtype="float32", max_model_len=w.prompt_len + w.new_tokens,
                  gpu_memory_utilization=0.3, enforce_eager=True, seed=0)
        params = SamplingParams(temperature=1.0, max_tokens=w.new_tokens,
                                min_tokens=w.new_tokens, ignore_eos=True, detokenize=False)
        inputs = [{"prompt_token_ids": p.tolist()} for p in prompts]
        llm.generate(inputs[:1], params, use_tqdm=False)
        return harness.timed(lambda: llm.generate(inputs, params, use_tqdm=False))
    except Exception as exc:  # noqa: BLE001
        return f"skipped ({type(exc).__name__}: {str(exc)[:80]})"


# ---------------------------------------------------------------------------- driver
def bench_shape(name: str, dims: dict, w: Workload, flops: float, engines: list[str],
                workdir: Path) -> dict:
    """Run every engine on one shape; return its rows."""
    torch.manual_seed(0)
    model = tiny_llama(**dims).eval()
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(0, dims["vocab_size"], (w.batch, w.prompt_len))
    work = generation_work(dims, w)
    bound = flops * w.batch * w.new_tokens / work
    # the same work, with the decode steps' share at the rate their [batch, D] matmuls reach
    prefill = generation_work(dims, Workload(w.batch, w.prompt_len, 0))
    decode_rate = harness.decode_matmul_flops_per_second(model, w.batch)
    decode_bound = w.batch * w.new_tokens / (prefill / flops + (work - prefill) / decode_rate)
    tokens = w.batch * w.new_tokens
    seconds: dict[str, float | str] = {}
    for engine in engines:
        print(f"[{name}] {engine} ...", flush=True)
        if engine == "native":
            seconds[engine] = run_native(model, prompts, w)
        elif engine == "native_grpo":
            seconds[engine] = run_native(model, prompts, w, group_size=8)
        elif engine == "torchtune":
            seconds[engine] = run_torchtune(model, prompts, w)
        elif engine == "hf":
            hf = load_hf(model, dims, workdir / f"hf_{name}")
            seconds[engine] = run_hf(hf, prompts, w) if hf is not None else "skipped"
            del hf
        elif engine == "vllm":
            write_hf_checkpoint(model, workdir / f"hf_{name}", dims)
            seconds[engine] = run_vllm(workdir / f"hf_{name}", prompts, w)
    tps = {k: tokens / v for k, v in seconds.items() if isinstance(v, float)}
    rows = {}
    for engine, value in seconds.items():
        if not isinstance(value, float):
            rows[engine] = {"status": value}
            continue
        rows[engine] = {
            "seconds": value,
            "tokens_per_second": tps[engine],
            "vs_torchtune": tps[engine] / tps["torchtune"] if "torchtune" in tps else None,
            "vs_hf": tps[engine] / tps["hf"] if "hf" in tps else None,
            "fraction_of_flop_bound": tps[engine] / bound,
            "fraction_of_decode_bound": tps[engine] / decode_bound,
        }
    return {
        "shape": name, "dims": dims, "params": params, "batch": w.batch,
        "prompt_len": w.prompt_len, "new_tokens": w.new_tokens, "work_flops": work,
        "flop_bound_tokens_per_second": bound, "decode_matmul_flops_per_second": decode_rate,
        "decode_bound_tokens_per_second": decode_bound, "engines": rows,
    }


def print_table(result: dict, flops: float) -> None:
    print(f"\n{result['shape']}: {result['params'] / 1e6:.2f}M params, batch {result['batch']}, "
          f"{result['prompt_len']}-token prompts, {result['new_tokens']} new tokens; FLOP bound "
          f"{result['flop_bound_tokens_per_second']:.0f} tok/s at {flops / 1e9:.1f} GFLOP/s; "
          f"decode bound {result['decode_bound_tokens_per_second']:.0f} tok/s (decode matmuls "
          f"at {result['decode_matmul_flops_per_second'] / 1e9:.1f} GFLOP/s)")
    print(f"{'engine':<12} {'tok/s':>9} {'s':>8} {'x torchtune':>12} {'x HF':>7} {'of bound':>9} "
          f"{'of decode bound':>16}")
    for engine, row in result["engines"].items():
        if "status" in row:
            print(f"{engine:<12} {row['status']}")
            continue

        print(f"{engine:<12} {row['tokens_per_second']:>9.1f} {row['seconds']:>8.2f} "
              f"{harness.fmt(row['vs_torchtune']):>12} {harness.fmt(row['vs_hf']):>7} "
              f"{row['fraction_of_flop_bound']:>8.0%} {row['fraction_of_decode_bound']:>16.0%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 16, 32 new tokens")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's own choice)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--engines", nargs="+",
                        default=["native", "native_grpo", "torchtune", "hf", "vllm"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        # vLLM's CPU backend binds its own OpenMP threads: give it the same number of cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "0" if args.threads == 1 else f"0-{args.threads - 1}")
    w = Workload(batch=16, prompt_len=64, new_tokens=32) if args.quick else Workload(32, 64, 128)
    flops = harness.matmul_flops_per_second()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            results.append(bench_shape(name, SHAPES[name], w, flops, args.engines, Path(tmp)))
            print_table(results[-1], flops)
    flops_after = harness.matmul_flops_per_second()
    print(f"\nfp32 matmul rate: {flops / 1e9:.1f} GFLOP/s before, {flops_after / 1e9:.1f} after; "
          f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    if args.out:
        harness.write_json(args.out, {
            "matmul_flops_per_second": flops, "matmul_flops_per_second_after": flops_after,
            "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "quick": args.quick, "results": results,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
