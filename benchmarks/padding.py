"""Update time on the padded rectangle, trimmed to each micro-batch's extent, and packed.

The update of a GRPO step runs, for every micro-batch of ``forward_batch_size`` rows of the
rollout, :func:`torchtune_grpo.policy.forward.micro_batch_logprobs` (forward through the model,
per-token log-probs and entropy of the response), :class:`torchtune_grpo.algorithm.loss.GRPOLoss`
over a global normaliser, and the backward. The rollout is a ``[N, P + T]`` rectangle: prompts
left-padded to ``P``, responses right-padded to ``T``. This script times that loop three ways
in the same process, on the same model and the same length-varied rollout (CPU, float32):

* ``untrimmed``: every micro-batch runs on the whole ``[n, P + T]`` rectangle (``trim=False``).
* ``trimmed``: every micro-batch runs on its own extent only (``trim=True``, the recipe with
  ``packed_forward: false``): the leading columns that are padding in all its rows and the
  columns past its longest response are dropped
  (:func:`torchtune_grpo.policy.positions.trim_to_extent`).
* ``packed``: every micro-batch's real tokens run as one row, attention per row
  (``pack=True``, the recipe's default ``packed_forward: true``;
  :func:`torchtune_grpo.policy.forward.packed_micro_batch_logprobs`).

The micro-batch order is a seeded random permutation, as in the recipe. The variants take
turns within each repeat (the order rotates from repeat to repeat), so that drifting load on a
shared machine hits all alike; the script reports the median seconds of each and the ratios
to ``untrimmed``. Absolute seconds depend on the machine's load; only the ratios from one
invocation are meaningful. Before timing, it checks that every variant gives the same loss and
parameter gradients as ``untrimmed`` (loss relative 1e-5; gradients ``GRAD_TOLERANCE``).

Usage::

    python benchmarks/padding.py                 # 4 layers, D=256, V=32000, 32 rows, 5 repeats
    python benchmarks/padding.py --quick         # smaller model and rollout, seconds
    python benchmarks/padding.py --threads 1 --out padding.json
    python benchmarks/padding.py --bucketed      # micro-batches of similar lengths (not the
                                                 # recipe's order: what bucketing would add)

Exit status 1 if the variants disagree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _rollout(rows: int, prompt_range: tuple[int, int], response_range: tuple[int, int],
             vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [N, P + T], prompt_mask [N, P], response_mask [N, T])`` with prompt and
    response lengths drawn uniformly from the given inclusive ranges."""
    from torchtune_grpo.algorithm.trajectory import prompt_mask

    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (rows,), generator=gen)
    response_lengths = torch.randint(response_range[0], response_range[1] + 1, (rows,),
                                     generator=gen)
    p_len, t_len = int(prompt_lengths.max()), int(response_lengths.max())
    p_mask = prompt_mask(torch.zeros(rows, p_len, dtype=torch.long), prompt_lengths)
    r_mask = torch.arange(t_len)[None, :] < response_lengths[:, None]
    mask = torch.cat([p_mask, r_mask], dim=1)
    tokens = torch.randint(1, vocab, mask.shape, generator=gen)
    return torch.where(mask, tokens, 0), p_mask, r_mask


VARIANTS = ("untrimmed", "trimmed", "packed")
#: largest gradient difference over the largest gradient entry, per parameter, that still counts
#: as float rounding: the unit tests (tests/unit/policy/test_trimming.py) hold 1e-5 on a 2-layer
#: model;
#: this 4-layer one, 32 rows of up to 248 tokens, differs by up to ~4e-5 for trimmed and packed
#: alike (another reduction order in attention and the matmuls)
GRAD_TOLERANCE = 1e-4


def _update(model, loss_fn, data: dict, order: torch.Tensor, batch: int, variant: str,
            chunk_size: int) -> float:
    """One pass of the update loop (gradients accumulate in ``model``); returns the loss."""
    from torchtune_grpo.policy.forward import micro_batch_logprobs

    tokens, p_mask, r_mask = data["tokens"], data["prompt_mask"], data["response_mask"]
    total = 0.0
    for i in range(0, tokens.shape[0], batch):
        idx = order[i : i + batch]
        logprobs, entropy = micro_batch_logprobs(
            model, tokens[idx], p_mask[idx], r_mask[idx], trim=variant != "untrimmed",
            pack=variant == "packed", temperature=1.0,
            chunk_size=chunk_size, return_entropy=True, entropy_grad=False,
        )
        loss, _ = loss_fn(logprobs, data["old"][idx], data["advantages"][idx], r_mask[idx],
                          normalizer=data["normalizer"], ref_logprobs=data["ref"][idx],
                          entropy=entropy)
        loss.backward()
        total += float(loss.detach())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--forward-batch-size", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="small model and rollout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucketed", action="store_true",
                        help="micro-batches of rows sorted by length instead of a random "
                             "permutation (what length bucketing would add; not the recipe's)")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args(argv)

    from torchtune_grpo.algorithm.loss import GRPOLoss
    from torchtune_grpo.policy.forward import micro_batch_logprobs
    from torchtune_grpo.policy.positions import trim_to_extent
    from torchtune_grpo.quickstart.tiny import tiny_llama

    torch.set_num_threads(args.threads)
    if args.quick:
        dims = dict(vocab_size=4000, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128,
                    max_seq_len=256)
        prompt_range, response_range = (10, 40), (4, 48)
    else:
        dims = dict(vocab_size=32000, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=256,
                    max_seq_len=512)
        prompt_range, response_range = (40, 120), (10, 128)
    torch.manual_seed(args.seed)
    model = tiny_llama(**dims)
    tokens, p_mask, r_mask = _rollout(args.rows, prompt_range, response_range,
                                      dims["vocab_size"], args.seed)
    rows, width = tokens.shape
    gen = torch.Generator().manual_seed(args.seed + 1)
    loss_fn = GRPOLoss(kl_coeff=0.04, aggregation="token_mean")
    with torch.no_grad():
        current = micro_batch_logprobs(model, tokens, p_mask, r_mask, trim=False)[0]
    data = dict(
        tokens=tokens, prompt_mask=p_mask, response_mask=r_mask,
        # the model's own log-probs plus noise: ratios near 1 and a small KL, as in a real
        # update, so that the equality check below compares non-degenerate gradients
        old=current + torch.randn(r_mask.shape, generator=gen) * 0.1,
        ref=current + torch.randn(r_mask.shape, generator=gen) * 0.1,
        advantages=torch.randn(rows, generator=gen),
        normalizer=loss_fn.normalizer_contribution(r_mask).float(),
    )
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(args.seed + 2))
    if args.bucketed:
        order = torch.cat([p_mask, r_mask], 1).sum(1).argsort(descending=True, stable=True)
    batch = args.forward_batch_size
    kept = [trim_to_extent(tokens[order[i : i + batch]], p_mask[order[i : i + batch]],
                           r_mask[order[i : i + batch]])
            for i in range(0, rows, batch)]
    columns = sum(k.tokens.shape[1] for k in kept) / (len(kept) * width)
    chunk_size = 2**25 // dims["vocab_size"]

    def run(variant: str) -> tuple[float, float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = _update(model, loss_fn, data, order, batch, variant, chunk_size)
        seconds = time.perf_counter() - start
        return seconds, loss, {n: p.grad for n, p in model.named_parameters()}

    # Equality check (also the warm-up).
    _, loss_full, grads_full = run("untrimmed")
    loss_rel = grad_rel = 0.0
    if loss_full == 0 or any(float(g.abs().max()) == 0 for g in grads_full.values()):
        print("degenerate workload: zero loss or a zero gradient", file=sys.stderr)
        return 1
    diffs = {}
    for variant in VARIANTS[1:]:
        _, loss_v, grads_v = run(variant)
        diffs[variant] = {
            "loss_rel": abs(loss_v - loss_full) / max(abs(loss_full), 1e-30),
            # per parameter: largest difference over the largest gradient entry
            "grad_max_rel": max(float((grads_v[n] - g).abs().max() / g.abs().max().clamp(
                min=1e-30)) for n, g in grads_full.items())}
        loss_rel = max(loss_rel, diffs[variant]["loss_rel"])
        grad_rel = max(grad_rel, diffs[variant]["grad_max_rel"])

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for k in range(len(VARIANTS)):
            variant = VARIANTS[(r + k) % len(VARIANTS)]
            times[variant].append(run(variant)[0])
    median = {k: statistics.median(v) for k, v in times.items()}
    result = dict(
        rows=rows, prompt_len=p_mask.shape[1], response_len=r_mask.shape[1],
        forward_batch_size=batch, threads=args.threads, model=dims, repeats=args.repeats,
        bucketed=args.bucketed,
        kept_column_fraction=columns,
        real_token_fraction=float(torch.cat([p_mask, r_mask], 1).float().mean()),
        seconds=times, median_seconds=median,
        ratio_trimmed_over_untrimmed=median["trimmed"] / median["untrimmed"],
        ratio_packed_over_untrimmed=median["packed"] / median["untrimmed"],
        ratio_packed_over_trimmed=median["packed"] / median["trimmed"],
        loss_rel_diff=loss_rel, grad_max_rel_diff=grad_rel, diffs_vs_untrimmed=diffs,
    )
    print(f"rollout [{rows}, {p_mask.shape[1]} + {r_mask.shape[1]}], micro-batches of {batch}; "
          f"trimmed micro-batches keep {columns:.1%} of the columns "
          f"({result['real_token_fraction']:.1%} of the rectangle is real tokens)")
    for variant, d in diffs.items():
        print(f"{variant} vs untrimmed: loss rel diff {d['loss_rel']:.2e}, max grad rel diff "
              f"{d['grad_max_rel']:.2e}")
    for k in VARIANTS:
        print(f"{k:>9}: median {median[k]:.3f} s  ({', '.join(f'{t:.2f}' for t in times[k])})")
    print(f"ratio trimmed / untrimmed: {result['ratio_trimmed_over_untrimmed']:.3f}; "
          f"packed / untrimmed: {result['ratio_packed_over_untrimmed']:.3f}; "
          f"packed / trimmed: {result['ratio_packed_over_trimmed']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if loss_rel <= 1e-5 and grad_rel <= GRAD_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
