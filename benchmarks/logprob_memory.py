"""Peak memory of per-token log-probs: full logits vs. chunked + checkpointed (CPU, float32).

Both variants compute ``sum(w * log p(target))`` for ``N * T`` response tokens with a
``[V, D]`` output projection and run forward + backward:

* ``naive``: ``logits = hidden @ W.T`` (``[N, T, V]``), log-softmax, gather
  (:func:`torchtune_grpo.policy.logprobs.naive_token_logprobs`).
* ``chunked``: :func:`torchtune_grpo.policy.logprobs.chunked_token_logprobs` with
  ``checkpoint=True``.

How memory is measured: each variant runs in its own fresh subprocess. After building the inputs
and the projection, the worker reads its current resident set size (``/proc/self/statm``); after
forward + backward it reads the process's peak resident set size (``VmHWM`` from
``/proc/self/status``, maintained by the kernel, so no short-lived peak is missed). The reported
number is ``peak - resident before``: the extra memory forward + backward needed, including the
weight's gradient. A separate process per variant keeps one variant's allocator caches and
high-water mark from hiding the other's. ``torch.cuda`` memory stats do not exist on CPU,
``tracemalloc`` does not see tensor storage and the profiler's memory view does not give a
process-wide peak; ``VmHWM`` does, at page granularity, which is plenty for gigabyte-sized
tensors. The workers run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every tensor
above 64 KiB from its own mapping and unmaps it on free, so the resident size follows the live
tensors (by default glibc raises that threshold at run time and keeps freed chunk-sized blocks
resident, which inflates the chunked variant's number with memory that is free but not
returned).

The workers save the loss and both gradients (w.r.t. the hidden states and the projection
weight); the parent checks that they agree (relative to the largest entry, 1e-5).

Usage::

    python benchmarks/logprob_memory.py                  # V=128256, 8 x 1024 tokens, D=256
    python benchmarks/logprob_memory.py --quick          # smaller shapes, seconds
    python benchmarks/logprob_memory.py --out results.json

Exit status 1 if the paths disagree or the ratio misses ``--target``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_RATIO = 0.3


def _rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``VmHWM``)."""
    from torchtune_grpo.backends.memory import peak_rss_bytes

    return peak_rss_bytes()


def _mem_available_bytes() -> int | None:
    from torchtune_grpo.backends.memory import proc_field_bytes

    return proc_field_bytes("/proc/meminfo", "MemAvailable")


def _worker(args: argparse.Namespace) -> None:
    """Run one variant's forward + backward and save its measurements and gradients."""
    import torch
    from torch import nn

    from torchtune_grpo.policy.logprobs import chunked_token_logprobs, naive_token_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, t, d, v = args.sequences, args.tokens, args.hidden_dim, args.vocab
    head = nn.Linear(d, v, bias=False)
    hidden = torch.randn(n, t, d, requires_grad=True)
    targets = torch.randint(0, v, (n, t))
    weights = torch.randn(n, t)

    rss_before = _rss_bytes()
    peak_before = _peak_rss_bytes()
    start = time.perf_counter()
    if args.worker == "naive":
        logp, _ = naive_token_logprobs(head(hidden), targets)
    else:
        logp, _ = chunked_token_logprobs(
            hidden, head, targets, chunk_size=args.chunk_size, checkpoint=True
        )
    loss = (logp * weights).sum() / (n * t)
    loss.backward()
    seconds = time.perf_counter() - start
    peak_after = _peak_rss_bytes()

    torch.save(
        {"loss": loss.detach(), "grad_hidden": hidden.grad, "grad_weight": head.weight.grad},
        args.result + ".pt",
    )
    with open(args.result + ".json", "w") as f:
        json.dump(
            {
                "peak_delta_bytes": max(0, peak_after - rss_before),
                # If the run never exceeded the earlier high-water mark, the delta is a lower
                # bound only; flag it.
                "lower_bound_only": peak_after <= peak_before,
                "rss_before_bytes": rss_before,
                "peak_rss_bytes": peak_after,
                "seconds": seconds,
            },
            f,
        )


def _run_variant(variant: str, args: argparse.Namespace, tmp: str) -> dict:
    result = os.path.join(tmp, variant)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--result",
        result,
        "--vocab",
        str(args.vocab),
        "--tokens",
        str(args.tokens),
        "--sequences",
        str(args.sequences),
        "--hidden-dim",
        str(args.hidden_dim),
        "--chunk-size",
        str(args.chunk_size),
        "--threads",
        str(args.threads),
    ]
    # A fixed glibc mmap threshold makes every allocation above 64 KiB its own mapping that is
    # unmapped on free, so RSS follows the live tensors instead of freed-but-kept heap blocks
    # (glibc otherwise raises the threshold dynamically and keeps chunk-sized blocks around).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024))
    subprocess.run(cmd, check=True, env=env)
    with open(result + ".json") as f:
        out = json.load(f)
    out["tensors"] = result + ".pt"
    return out


def _max_rel_diff(a, b) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per sequence")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="V=32000, 4 x 512 tokens, chunk 128")
    parser.add_argument("--target", type=float, default=TARGET_RATIO)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=str, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        _worker(args)
        return 0
    if args.quick:
        args.vocab, args.tokens, args.sequences, args.chunk_size = 32000, 512, 4, 128
    for name in ("vocab", "tokens", "sequences", "hidden_dim", "chunk_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    logits_bytes = args.sequences * args.tokens * args.vocab * 4
    available = _mem_available_bytes()
    # Full logits, their log-softmax and two gradients of that size are alive at once.
    if available is not None and 4 * logits_bytes > 0.9 * available:
        print(
            f"the naive variant needs about {4 * logits_bytes / 2**30:.1f} GiB but only "
            f"{available / 2**30:.1f} GiB is available; use --quick or fewer --sequences",
            file=sys.stderr,
        )
        return 2

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        results = {v: _run_variant(v, args, tmp) for v in ("naive", "chunked")}
        naive_t = torch.load(results["naive"].pop("tensors"))
        chunked_t = torch.load(results["chunked"].pop("tensors"))
    diffs = {k: _max_rel_diff(chunked_t[k], naive_t[k]) for k in naive_t}
    ratio = results["chunked"]["peak_delta_bytes"] / max(1, results["naive"]["peak_delta_bytes"])
    equal = all(d <= 1e-5 for d in diffs.values())

    print(
        f"V={args.vocab} N={args.sequences} T={args.tokens} D={args.hidden_dim} "
        f"chunk={args.chunk_size} float32, CPU, {args.threads} threads; "
        f"one [N*T, V] float32 tensor = {logits_bytes / 2**30:.2f} GiB"
    )
    print(f"{'variant':<10}{'peak extra memory (GiB)':>26}{'fwd+bwd (s)':>14}")
    for name, r in results.items():
        flag = " (lower bound)" if r["lower_bound_only"] else ""
        print(f"{name:<10}{r['peak_delta_bytes'] / 2**30:>26.3f}{r['seconds']:>14.2f}{flag}")
    print(f"ratio chunked/naive = {ratio:.3f} (target < {args.target})")
    print(
        "max relative difference (chunked vs naive): "
        + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
        + (" -> equal" if equal else " -> MISMATCH")
    )

    report = {
        "shape": {
            "vocab": args.vocab,
            "sequences": args.sequences,
            "tokens": args.tokens,
            "hidden_dim": args.hidden_dim,
            "chunk_size": args.chunk_size,
            "dtype": "float32",
            "device": "cpu",
            "threads": args.threads,
        },
        "method": "subprocess per variant; VmHWM after fwd+bwd minus RSS before",
        "results": results,
        "ratio_chunked_over_naive": ratio,
        "target_ratio": args.target,
        "max_relative_diff": diffs,
        "equal": equal,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if equal and ratio < args.target else 1


if __name__ == "__main__":
    sys.exit(main())
