"""Estimated peak memory per rank of the shipped training configs (or of one config).

Prints the breakdown of :func:`torchtune_grpo.cli.memory_estimate.estimate_memory` (weights,
gradients, optimizer state, reference model, KV cache, activations, logits) and the peak. Each
shipped config is estimated for the ranks its header launches it with (``--nproc_per_node N``,
else 1).

    python benchmarks/memory_estimate.py                        # all shipped training configs
    python benchmarks/memory_estimate.py --all --out mem.json   # and write JSON
    python benchmarks/memory_estimate.py --config grpo/qwen2_5_3B_full --world-size 4 batch_size=2
    python benchmarks/memory_estimate.py --validate             # estimate vs. measured (CPU)

``--validate`` runs the recipe on two small CPU models in subprocesses (about a minute on two
cores) and prints estimated / measured peak memory; ``docs/memory.md`` quotes its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/memory_estimate.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from torchtune_grpo.backends.memory import measure_peak_memory  # noqa: E402
from torchtune_grpo.cli.memory_estimate import (  # noqa: E402
    MemoryEstimate,
    dump_json,
    estimate_memory,
    intended_world_size,
    summary_table,
    training_configs,
)
from torchtune_grpo.config.loading import load_config  # noqa: E402

#: Dimensions of the validation model: big enough that its weights dominate the baseline.
VALIDATION_DIMS = {"vocab_size": 32000, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                   "embed_dim": 512, "max_seq_len": 256}
#: Prompt length of the quickstart's addition problems (``<|begin_of_text|>3812+1111=``...).
VALIDATION_PROMPT_TOKENS = 13
#: Validation runs: name -> overrides of ``grpo/quickstart_cpu``.
VALIDATION_RUNS: dict[str, list[str]] = {
    "full (AdamW, 2 micro-batches, 2 PPO epochs)": [
        "batch_size=2", "group_size=8", "max_generated_tokens=24", "forward_batch_size=8",
        "ppo_epochs=2"],
    "LoRA (KL via disabled adapters)": [
        "batch_size=2", "group_size=8", "max_generated_tokens=32", "forward_batch_size=16",
        "loss.kl_coeff=0.05", "model._component_=torchtune.models.llama3_2.lora_llama3_2",
        "model.lora_attn_modules=[q_proj,v_proj]", "model.lora_rank=8", "model.lora_alpha=16"],
    "full + KL reference + activation checkpointing": [
        "batch_size=2", "group_size=8", "max_generated_tokens=24", "forward_batch_size=16",
        "loss.kl_coeff=0.05", "enable_activation_checkpointing=true", "ppo_epochs=2"],
}


def write_validation_model(directory: Path) -> Path:
    """Write the validation model (random weights) and the tiny tokenizer into ``directory``."""
    harness.write_tiny_model(directory, VALIDATION_DIMS)
    return directory


def validation_overrides(model_dir: Path, output_dir: Path, extra: list[str]) -> list[str]:
    """Overrides of ``grpo/quickstart_cpu`` for one validation run (one step, no eval)."""
    return [
        f"model_dir={model_dir}", f"output_dir={output_dir}", "progress_bar=false",
        "num_steps=1", "eval_every_n_steps=null", "eval_at_start=false",
        "logprob_chunk_size=256", *(f"model.{k}={v}" for k, v in VALIDATION_DIMS.items()),
        *extra,
    ]


def validate(names: list[str], threads: int = 2) -> list[dict]:
    """Estimated and measured peak memory of the named :data:`VALIDATION_RUNS`."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = write_validation_model(Path(tmp) / "base")
        for i, name in enumerate(names):
            overrides = validation_overrides(base, Path(tmp) / f"run{i}", VALIDATION_RUNS[name])
            est = estimate_memory(load_config("grpo/quickstart_cpu", overrides),
                                  prompt_tokens=VALIDATION_PROMPT_TOKENS, name=name)
            measured = measure_peak_memory("grpo/quickstart_cpu", overrides, threads=threads)
            rows.append({"run": name, "estimated_bytes": est.peak_bytes,
                         "measured_bytes": measured, "ratio": est.peak_bytes / measured,
                         "peak_phase": est.peak_phase})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="one config (default: every shipped training config)")
    parser.add_argument("--all", action="store_true", help="every shipped training config")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks (default: the config header's --nproc_per_node, else 1)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--validate", action="store_true",
                        help="compare estimates with measured CPU peak memory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (with --config)")
    args = parser.parse_args(argv)

    if args.validate:
        rows = validate(list(VALIDATION_RUNS), threads=args.threads)
        print("| run | estimated MB | measured MB | estimate / measured |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['estimated_bytes'] / 1e6:.0f} | "
                  f"{r['measured_bytes'] / 1e6:.0f} | {r['ratio']:.2f} |")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return 0

    names = [args.config] if args.config and not args.all else training_configs()
    estimates: list[MemoryEstimate] = []
    for name in names:
        world_size = args.world_size or intended_world_size(name)
        cfg = load_config(name, args.overrides if args.config else [])
        try:  # a folder not downloaded yet is sized from its model's known shape
            estimates.append(estimate_memory(cfg, world_size, prompt_tokens=args.prompt_tokens,
                                             name=name))
        except FileNotFoundError as exc:  # neither a config.json nor a known shape
            if len(names) == 1:
                raise
            print(f"skipped {name}: {exc}", file=sys.stderr)
    if len(estimates) == 1:
        print(estimates[0].table())
    else:
        print(summary_table(estimates))
    if args.out:
        dump_json(estimates, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
