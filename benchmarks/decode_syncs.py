"""Host syncs and aten ops per decoded token of the native engine, and CPU rollout seconds
against ``stop_check_interval``.

Counts (a ``TorchDispatchMode``; ``Tensor.tolist`` wrapped, since on the CPU it reads memory
without an op) come from the difference between a 32- and a 16-token rollout of the quickstart's
tiny model whose rows never stop, so prefill and setup cancel. A host sync is an
``aten._local_scalar_dense`` or ``aten.is_nonzero`` (``.item()``, ``bool(t)``, ``int(t)``) or a
``tolist``: on a GPU each one drains the launch queue. Run it against another checkout (the
figure before a change) with ``PYTHONPATH=/path/to/checkout python benchmarks/decode_syncs.py``.

    python -m benchmarks.decode_syncs [--intervals 1 16] [--no-shrink] [--time] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _request(tokens: int, interval: int | None, rows: int = 8, temperature: float = 1.0,
             stops=(-1,)):
    from torchtune_grpo.rollout.protocol import GenerationRequest

    prompts = torch.randint(5, 300, (rows // 4, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(group_size=4, prompt_seeds=torch.arange(rows // 4), max_generated_tokens=tokens,
              temperature=temperature, stop_tokens=torch.tensor(list(stops)), pad_id=0)
    names = {f.name for f in dataclasses.fields(GenerationRequest)}
    if interval is not None and "stop_check_interval" in names:  # absent before issue 53
        kw["stop_check_interval"] = interval
    return GenerationRequest(prompts, torch.ones_like(prompts, dtype=torch.bool), **kw)


def count(model, interval: int | None, shrink: bool = True) -> dict[str, float]:
    """Host syncs per token and aten ops per token per layer (32- minus 16-token rollout)."""
    from torchtune_grpo.rollout.native import generate_trajectory

    reads = []
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: reads.append(1) or tolist(t)
    try:
        totals = []
        for tokens in (16, 32):
            n = len(reads)
            with _Ops() as mode:
                generate_trajectory(model, _request(tokens, interval), packed_weights=False,
                                    shrink_finished=shrink)
            syncs = sum(v for k, v in mode.ops.items() if k in SYNC_OPS) + len(reads) - n
            totals.append((syncs, sum(mode.ops.values())))
    finally:
        torch.Tensor.tolist = tolist
    layers = len(model.layers)
    return {"syncs_per_token": (totals[1][0] - totals[0][0]) / 16,
            "ops_per_token_per_layer": (totals[1][1] - totals[0][1]) / 16 / layers}


def rollout_seconds(model, interval: int, shrink: bool = True, repeats: int = 3) -> float:
    """Best-of seconds of a 128-token, 32-row rollout whose rows stop at varied steps."""
    from torchtune_grpo.rollout.native import generate_trajectory

    request = _request(128, interval, rows=32, temperature=40.0, stops=range(5, 12))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        generate_trajectory(model, request, shrink_finished=shrink)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    import torchtune_grpo
    from torchtune_grpo.quickstart.tiny import tiny_llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-shrink", action="store_true",
                        help="decode stopped rows to the end (the CUDA default)")
    parser.add_argument("--time", action="store_true", help="also time CPU rollouts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = tiny_llama().eval()
    result = {"code": torchtune_grpo.__file__, "rows": []}
    for interval in args.intervals:
        shrink = not args.no_shrink
        row = {"interval": interval, "shrink": shrink, **count(model, interval, shrink)}
        if args.time:
            row["rollout_s"] = rollout_seconds(model, interval, shrink)
        result["rows"].append(row)
        print(row, flush=True)
    if args.out:
        from benchmarks.harness import write_json

        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
