"""Seconds and peak memory of one GRPO step, driven through the real ``GRPORecipe``.

Shape (the "whole step" shape of the issue): a 2-layer, dim-128 Llama 3.2 decoder with the
full Llama 3 vocabulary of 128,256 ids (tied embeddings, ~16.5M parameters, almost all of them
in the embedding), 4 GSM8K prompts x 8 samples x 32 new tokens, ``kl_coeff: 0.01`` (so the
reference model runs), fp32 on CPU, ``ppo_epochs: 1``, one micro-batch of 32 rows, AdamW with
``fused: True`` (as the dev recipe's own config has it; the peer runs with the same).

Tokenizer: a Llama 3 tokenizer of 128,256 ids cannot be had offline, so the byte-level tiny
tokenizer (269 ids, :mod:`torchtune_grpo.quickstart.tiny`) is used with the 128,256-id model. The
allowed-token mask then restricts sampling to those 269 ids; every logit and log-prob is still
computed over all 128,256 ids, so the output-layer cost is that of the real vocabulary. Prompts
are GSM8K questions from ``../shared/data/gsm8k/train.jsonl`` when present (byte-level, with the
question as the chat user message, at most 200 tokens; the table prints their mean length),
otherwise synthetic questions of similar length.

Variants, each in a fresh subprocess (so each has its own peak RSS):

* ``optimized``: the recipe as shipped.
* ``baseline``: the same recipe and weights with two pieces swapped back to the designs of
  torchtune's dev GRPO recipe: log-probs from the full ``[N, P + T, V]`` float32 logits of every
  position (no chunking, no recomputation), and generation through torchtune's own KV cache
  (``setup_caches`` per micro-batch, every decode step attending over the whole max-length
  cache, every row prefilling its own copy of the prompt). Measured in the same run, so the
  ratio between the two is this machine's, not an anchor.

The step is split as the recipe times it: generation (rollout), scoring (decode + rewards +
advantages), reference (log-probs of the frozen model) and update (forward + backward +
optimizer step). The first step is a warm-up; the mean of the next ``--steps`` is reported.
Peak memory is the process's peak resident set size (``VmHWM``, see
``torchtune_grpo.backends.memory.peak_rss_bytes``) on CPU, or ``torch.cuda.max_memory_allocated`` on
CUDA.

Peer, in the same invocation (``--peer torchtune-dev``): torchtune's original dev GRPO recipe
(``recipes/dev/grpo_full_finetune_distributed.py`` of a torchtune source tree, run unchanged
by ``benchmarks/peers/torchtune_dev_step.py`` with its own Python, see
``benchmarks/peers/setup_torchtune_dev.sh``) at the same shape, on the same prompt token ids
step by step, with the same model weights. The table prints the optimized variant's ratio
against it: only ratios measured this way are quoted in the docs. When the peer's Python
cannot import the recipe, the script says how to install it and exits with status 2.

Bounds: every phase is printed next to its FLOP count and the time that count takes at this
machine's fp32 rate, measured in the same invocation (best of 8 square ``1024^3`` matmuls,
:func:`benchmarks.harness.matmul_flops_per_second`). FLOPs count real tokens only (no padding):
the body's linear layers (``2 x body params`` per token), the output projection (``2 x V x D``)
where a log-prob or a sample is needed, and causal attention (``4 x layers x D_attn`` per
query-key pair). Generation prefills each distinct prompt once and decodes every row; reference
is one forward; update is the forward plus a backward of twice its cost (``3x``; the update
keeps the forward's softmax for the backward at this shape, ``logprob_keep_probs_mib``, so
nothing is recomputed). Generation also gets a decode bound: its decode steps at the rate this
model's own weights reach as ``[rows, D] @ W`` matmuls (``decode_matmul_flops_per_second``, the
faster of ``F.linear`` and oneDNN on reordered weights, which the native engine decodes with on
CPU).

Usage::

    python benchmarks/step.py                 # 1 warm-up + 2 timed steps per variant
    python benchmarks/step.py --quick         # 1 warm-up + 1 timed step, 16 new tokens
    python benchmarks/step.py --out step.json --device cuda
    python benchmarks/step.py --threads 2 --variants optimized --peer torchtune-dev
    GRPO_STEP_OVERRIDES="packed_forward=false" python benchmarks/step.py --variants optimized

``GRPO_STEP_OVERRIDES`` (space-separated ``key=value``, values parsed as YAML) changes this
benchmark's config for an A/B run of one recipe option; ``baseline`` always runs with
``packed_forward: false`` (the padded rectangles it was written for).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/step.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from benchmarks.harness import GSM8K, REPO, PeerUnavailable  # noqa: E402

PEER_SCRIPT = REPO / "benchmarks" / "peers" / "torchtune_dev_step.py"
PEER_SETUP = "bash benchmarks/peers/setup_torchtune_dev.sh /path/to/torchtune-checkout"
DIMS = {"vocab_size": 128256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "embed_dim": 128, "max_seq_len": 1024}


def _synthetic_gsm8k(path: Path, rows: int = 64) -> Path:
    """GSM8K-format rows whose questions are 150-250 bytes (byte-level tokens)."""
    rng = random.Random(0)
    words = ["apples", "boxes", "each", "costs", "dollars", "friends", "gave", "more", "than",
             "half", "of", "his", "her", "sold"]
    with path.open("w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(25, 45)))
            f.write(json.dumps({"question": f"{text} {i}?", "answer": f"so {i}\n#### {i}"}) + "\n")
    return path


def build_config(workdir: Path, device: str, new_tokens: int):
    """The GRPO config of this benchmark (checkpoint written into ``workdir``)."""
    from omegaconf import OmegaConf

    data = GSM8K if GSM8K.exists() else _synthetic_gsm8k(workdir / "synthetic.jsonl")
    return OmegaConf.create({
        "output_dir": str(workdir / "run"), "model_dir": str(workdir / "model"), "seed": 0,
        "device": device, "dtype": "fp32",
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2", **DIMS},
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": "${model_dir}/tokenizer.model",
                      "special_tokens_path": "${model_dir}/tokenizer.json",
                      "max_seq_len": 1024},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": "${model_dir}",
                         "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA3_2",
                         "output_dir": "${output_dir}"},
        "dataset": {"_component_": "torchtune_grpo.datasets.gsm8k_dataset",
                    "source": str(data), "split": "train", "max_prompt_tokens": 200,
                    "invalid_rows": "skip", "template": {"user": "{question}"}},
        "rewards": [{"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
                     "weight": 1.0, "success": True}],
        "loss": {"_component_": "torchtune_grpo.algorithm.loss.GRPOLoss", "epsilon": 0.2,
                 "aggregation": "sequence_mean", "kl_coeff": 0.01},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-5, "weight_decay": 0.0,
                      "fused": True},
        "lr_scheduler": None, "metric_logger": None,
        "batch_size": 4, "group_size": 8, "forward_batch_size": 32,
        "max_generated_tokens": new_tokens, "temperature": 1.0, "top_k": None,
        "ppo_epochs": 1, "num_steps": 100, "save_every_n_steps": None,
        "clip_grad_norm": 1.0, "log_every_n_steps": 1, "progress_bar": False,
    })


# ---------------------------------------------------------------------------- baseline
def install_baseline() -> None:
    """Swap in full-logits log-probs and torchtune-cache generation (see module docstring)."""
    import torch
    from torchtune.modules.common_utils import delete_kv_caches

    from torchtune_grpo.algorithm.trajectory import Trajectory
    from torchtune_grpo.policy import forward as fwd
    from torchtune_grpo.policy.head import OutputHead, ResponseLogProbs
    from torchtune_grpo.policy.logprobs import naive_token_logprobs
    from torchtune_grpo.policy.positions import position_ids
    from torchtune_grpo.rollout import native as gen

    answer = OutputHead.__call__

    def full_logits_head(self, h, request=None):
        if not isinstance(request, ResponseLogProbs):
            return answer(self, h, request)
        logits = self.logits(h)  # [N, P + T - 1, V], every position
        t = request.targets.shape[1]
        return naive_token_logprobs(logits[:, request.start : request.start + t],
                                    request.targets, request.temperature, request.logit_bias,
                                    request.return_entropy)

    OutputHead.__call__ = full_logits_head

    @torch.no_grad()
    def torchtune_cache_micro_batch(model, request, *, seeds=None, **_unused):
        prompt_tokens, prompt_mask = request.prompt_tokens, request.prompt_mask
        max_generated_tokens, temperature, top_k = (request.max_generated_tokens,
                                                    request.temperature, request.top_k)
        stop_tokens, pad_id, logit_bias = request.stop_tokens, request.pad_id, request.logit_bias
        all_done = request.all_done or gen._always_local
        cache_dtype = request.cache_dtype
        n, p = prompt_tokens.shape
        total = p + max_generated_tokens
        model.setup_caches(batch_size=n, dtype=cache_dtype or torch.float32,
                           decoder_max_seq_len=total)
        try:
            valid = torch.ones(n, total, dtype=torch.bool)
            valid[:, :p] = prompt_mask
            pos = position_ids(valid)
            cols, rows = torch.arange(total), torch.arange(p)
            mask = ((cols[None] <= rows[:, None])[None] & valid[:, None]) | (
                cols[None] == rows[:, None])[None]
            logits = fwd.last_logits(model, prompt_tokens, mask=mask, input_pos=pos[:, :p])
            toks, lps, ms = [], [], []
            stopped = torch.zeros(n, dtype=torch.bool)
            for t in range(max_generated_tokens):
                tok, lp = gen.sample_next_token(logits[:, -1], temperature=temperature,
                                                top_k=top_k, logit_bias=logit_bias,
                                                seeds=seeds, counter=t)
                active = ~stopped
                toks.append(tok.masked_fill(stopped, pad_id))
                lps.append(lp.masked_fill(stopped, 0.0))
                ms.append(active)
                stopped |= active & torch.isin(tok, stop_tokens)
                if t + 1 == max_generated_tokens or all_done(bool(stopped.all())):
                    break
                step_mask = (valid & (cols <= p + t)).unsqueeze(1)  # full-length, every step
                logits = model(toks[-1][:, None], mask=step_mask,
                               input_pos=pos[:, p + t : p + t + 1])
        finally:
            delete_kv_caches(model)
        return Trajectory(tokens=torch.cat([prompt_tokens, torch.stack(toks, 1)], 1),
                          prompt_mask=prompt_mask.clone(), response_mask=torch.stack(ms, 1),
                          logprobs=torch.stack(lps, 1), stopped=stopped, pad_id=pad_id)

    gen.generate_micro_batch = torchtune_cache_micro_batch


# ---------------------------------------------------------------------------- worker
def worker(variant: str, workdir: Path, device: str, steps: int, new_tokens: int,
           threads: int | None) -> dict:
    """Run ``1 + steps`` GRPO steps of ``variant``; return timings and peak memory."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if variant == "baseline":
        install_baseline()
    from torchtune_grpo.training.recipe import GRPORecipe

    cfg = build_config(workdir, device, new_tokens)
    if variant == "baseline":  # padded rectangles, as before packing existed
        cfg.packed_forward = False
    import yaml

    for override in os.environ.get("GRPO_STEP_OVERRIDES", "").split():
        key, _, value = override.partition("=")  # e.g. packed_forward=false (A/B runs)
        cfg[key] = yaml.safe_load(value)
    recipe = GRPORecipe(cfg)
    recipe.setup()
    params = sum(p.numel() for p in recipe.model.parameters())
    rows, prompts = [], []
    for step in range(1 + steps):
        batch = recipe.batches.batch(recipe.step)
        phases = harness.Phases()
        with phases("generation"):
            traj = recipe.rollout(batch)
        with phases("scoring"):
            adv = recipe.advantages(recipe.score(traj, batch), traj)
        with phases("reference"):
            ref = recipe.reference_logprobs(traj)
        with phases("update"):
            recipe.update(traj, adv.advantages.to(recipe.device), ref)
        recipe.step += 1
        times = {**phases.seconds, "total": sum(phases.seconds.values())}
        times["prompt_len"] = traj.prompt_len
        times["mean_prompt_tokens"] = float(traj.prompt_mask.sum(1).float().mean())
        times["generated_tokens"] = int(traj.response_mask.sum())
        times["flops"] = phase_flops(recipe.model, traj, recipe.group_size)
        prompts.append(harness.batch_prompts(batch))
        if step > 0:
            rows.append(times)
    mean = harness.mean_of(rows, [k for k in rows[0] if k != "flops"])
    mean["flops"] = harness.mean_of([r["flops"] for r in rows])
    return {"variant": variant, "params": params, "steps": rows, "mean": mean,
            "prompts": prompts, "peak_memory_bytes": harness.peak_memory_bytes(recipe.device),
            "memory_kind": "cuda_max_allocated" if recipe.device.type == "cuda" else "peak_rss"}


def phase_flops(model, traj, group_size: int) -> dict:
    """FLOPs of generation, reference and update for the real tokens of ``traj``.

    See the module docstring for what is counted. Returns ``{"generation", "generation_decode",
    "reference", "update"}``; ``generation_decode`` is the decode steps' share of generation.
    """
    import torch

    decoder = model
    emb = decoder.tok_embeddings.weight
    v, d = emb.shape
    linear = sum(m.weight.numel() for m in decoder.modules()
                 if isinstance(m, torch.nn.Linear) and m is not getattr(decoder, "output", None))
    attn = decoder.layers[0].attn
    d_attn = attn.num_heads * attn.head_dim
    layers = len(decoder.layers)
    prompt_lens = traj.prompt_mask.sum(1).double()  # [N]
    resp_lens = traj.response_mask.sum(1).double()  # [N]
    body, out = 2.0 * linear, 2.0 * v * d

    def attention(first: torch.Tensor, last: torch.Tensor) -> float:
        # query positions first+1 .. last, each attending to itself and all before it
        return float((4 * layers * d_attn * (last * (last + 1) - first * (first + 1)) / 2).sum())

    distinct = prompt_lens[::group_size]
    prefill = float(distinct.sum()) * body + len(distinct) * out + attention(
        torch.zeros_like(distinct), distinct)
    decode = float(resp_lens.sum()) * (body + out) + attention(prompt_lens,
                                                               prompt_lens + resp_lens)
    forward = (float((prompt_lens + resp_lens).sum()) * body + float(resp_lens.sum()) * out
               + attention(torch.zeros_like(prompt_lens), prompt_lens + resp_lens))
    return {"generation": prefill + decode, "generation_decode": decode, "reference": forward,
            "update": 3 * forward}


def run_peer(workdir: Path, args, prompts: list[dict]) -> dict:
    """Run torchtune's dev recipe at this shape in its own Python (``--peer-python``)."""
    python, source = args.peer_python, args.torchtune_src
    probe = subprocess.run(
        [str(python), "-c", "import sys, importlib.util; p = sys.argv[1]; "
         "s = importlib.util.spec_from_file_location('r', p); "
         "s.loader.exec_module(importlib.util.module_from_spec(s))",
         str(Path(source) / "recipes" / "dev" / "grpo_full_finetune_distributed.py")],
        capture_output=True, text=True) if Path(python).exists() else None
    if probe is None or probe.returncode != 0:
        reason = (f"{python} does not exist" if probe is None
                  else probe.stderr.strip().splitlines()[-1] if probe.stderr.strip()
                  else f"exit {probe.returncode}")
        raise PeerUnavailable(
            f"torchtune's dev GRPO recipe cannot be run with --peer-python {python} and "
            f"--torchtune-src {source} ({reason}). Install it once with:\n    {PEER_SETUP}\n"
            "(a torchtune checkout at HEAD, e.g. git clone https://github.com/pytorch/torchtune)")
    spec = {"model_dir": str(workdir / "model"), "dims": DIMS, "device": args.device,
            "gsm8k_file": str(GSM8K if GSM8K.exists() else workdir / "synthetic.jsonl"),
            "batch_size": 4, "group_size": 8, "new_tokens": args.new_tokens,
            "steps": args.steps, "threads": args.threads, "torchtune_src": str(source),
            "prompts_per_step": prompts}
    peer_dir = workdir / "peer"
    peer_dir.mkdir()
    (peer_dir / "spec.json").write_text(json.dumps(spec))
    out = peer_dir / "result.json"
    return harness.run_json([python, PEER_SCRIPT, "--spec", peer_dir / "spec.json", "--out", out],
                            out)


def _run_variant(variant: str, workdir: Path, args) -> dict:
    out = workdir / f"{variant}.json"
    cmd = [sys.executable, __file__, "--worker", variant, "--workdir", str(workdir),
           "--device", args.device, "--steps", str(args.steps),
           "--new-tokens", str(args.new_tokens), "--worker-out", str(out)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return harness.run_json(cmd, out, env=harness.subprocess_env(REPO))


def main(argv: list[str] | None = None) -> int:
    """Run the variants (and the peer), print the table, the bounds and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 timed step, 16 new tokens")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=["optimized", "baseline"],
                        choices=["optimized", "baseline"])
    parser.add_argument("--peer", choices=["torchtune-dev"],
                        help="also run torchtune's original dev GRPO recipe at this shape")
    parser.add_argument("--peer-python", type=Path,
                        default=Path(os.environ.get("TORCHTUNE_DEV_PYTHON",
                                                    REPO / ".venv-torchtune-dev/bin/python")),
                        help="Python of the peer's environment (env TORCHTUNE_DEV_PYTHON)")
    parser.add_argument("--torchtune-src", type=Path,
                        default=Path(os.environ.get("TORCHTUNE_SRC",
                                                    REPO / ".venv-torchtune-dev/torchtune")),
                        help="torchtune source tree holding recipes/dev (env TORCHTUNE_SRC)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.new_tokens = 1, 16

    if args.worker:
        result = worker(args.worker, args.workdir, args.device, args.steps, args.new_tokens,
                        args.threads)
        args.worker_out.write_text(json.dumps(result))
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = harness.write_tiny_model(workdir / "model", DIMS)
        flops = harness.matmul_flops_per_second()
        decode_rate = harness.decode_matmul_flops_per_second(model, rows=32)
        if torch.backends.mkldnn.is_available():  # the native engine's packed weights
            decode_rate = max(decode_rate, harness.decode_matmul_flops_per_second(
                model, rows=32, kernel="onednn"))
        del model
        for variant in args.variants:
            print(f"running {variant} ...", flush=True)
            results[variant] = _run_variant(variant, workdir, args)
        if args.peer:
            print(f"running {args.peer} ...", flush=True)
            prompts = next(iter(results.values()))["prompts"] if results else None
            if prompts is None:
                print("--peer needs at least one of --variants (it replays their prompts)",
                      file=sys.stderr)
                return 2
            try:
                results[args.peer] = run_peer(workdir, args, prompts)
            except PeerUnavailable as e:
                print(f"error: {e}", file=sys.stderr)
                return 2

    parts = ["generation", "scoring", "reference", "update", "total"]
    first = next(iter(results.values()))
    print(f"\nGRPO step: {first['params'] / 1e6:.1f}M params (vocab {DIMS['vocab_size']}), "
          f"4 prompts x 8 samples x {args.new_tokens} new tokens, padded prompt length "
          f"{first['mean']['prompt_len']:.0f} (mean {first['mean']['mean_prompt_tokens']:.0f} "
          f"real tokens), kl_coeff 0.01, {args.device}, fp32, mean of {args.steps} step(s), "
          f"{args.threads or torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'variant':<14} " + " ".join(f"{p:>11}" for p in parts) + f" {'peak GB':>8}")
    for name, r in results.items():
        print(f"{name:<14} " + " ".join(f"{r['mean'][p]:>10.2f}s" for p in parts)
              + f" {r['peak_memory_bytes'] / 1e9:>8.2f}")

    summary: dict = {"matmul_flops_per_second": flops,
                     "decode_matmul_flops_per_second": decode_rate}
    ours = results.get("optimized", first)
    work = ours["mean"]["flops"]
    bounds = {"generation": (work["generation"] - work["generation_decode"]) / flops
              + work["generation_decode"] / decode_rate,
              "reference": work["reference"] / flops, "update": work["update"] / flops}
    print(f"\nEach phase against its bound ({flops / 1e9:.0f} GFLOP/s square fp32 matmuls, "
          f"{decode_rate / 1e9:.0f} GFLOP/s for this model's decode-shaped matmuls, both "
          "measured now):")
    print(f"{'phase':<11} {'GFLOP':>8} {'FLOP bound':>11} {'decode-shape bound':>19} "
          f"{'measured':>9} {'x bound':>8}")
    summary["bounds"] = {}
    for phase in ("generation", "reference", "update"):
        at_rate = work[phase] / flops
        measured = ours["mean"][phase]
        shaped = f"{bounds[phase]:>18.2f}s" if phase == "generation" else f"{'':>19}"
        print(f"{phase:<11} {work[phase] / 1e9:>8.1f} {at_rate:>10.2f}s {shaped} "
              f"{measured:>8.2f}s {measured / bounds[phase]:>7.1f}x")
        summary["bounds"][phase] = {"gflop": work[phase] / 1e9, "flop_bound_s": at_rate,
                                    "bound_s": bounds[phase], "measured_s": measured}

    s, gb = ours["mean"]["total"], ours["peak_memory_bytes"] / 1e9
    for other, label in (("torchtune-dev", "torchtune's dev GRPO recipe, same invocation"),
                         ("baseline", "same-run baseline (full logits, torchtune KV cache)")):
        if other not in results or other == ours["variant"]:
            continue
        base = results[other]
        bs, bgb = base["mean"]["total"], base["peak_memory_bytes"] / 1e9
        summary[f"vs_{other}"] = {"speedup": bs / s, "memory_fraction": gb / bgb,
                                  **{f"speedup/{p}": base["mean"][p] / max(ours["mean"][p], 1e-9)
                                     for p in parts if base["mean"][p] > 0}}
        print(f"\nvs. {label}: {bs / s:.2f}x faster per step, {gb / bgb:.1%} of its peak "
              f"memory; generation {base['mean']['generation'] / ours['mean']['generation']:.2f}x"
              f", reference {base['mean']['reference'] / ours['mean']['reference']:.2f}x, update "
              f"{base['mean']['update'] / ours['mean']['update']:.2f}x")
    if args.out:
        harness.write_json(args.out, {
            "dims": DIMS, "new_tokens": args.new_tokens, "device": args.device,
            "threads": args.threads or torch.get_num_threads(), "load_average": os.getloadavg(),
            "date": harness.utc_now(),
            "prompts": str(GSM8K) if GSM8K.exists() else "synthetic",
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "prompts"}
                        for k, v in results.items()},
            "summary": summary,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
