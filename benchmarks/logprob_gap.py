"""The bf16 gap between the native engine's log-probs and the trainer's, on the real SmolLM2.

One rollout of ``grpo/smollm2_gsm8k_cpu`` in bf16 (default 8 GSM8K prompts x 4 samples x 64
new tokens, temperature 1) through ``GRPORecipe``: the engine returns a log-prob per sampled
token. The same trajectory then goes through the trainer's log-prob pass
(``PolicyUpdate.policy_logprobs``, what the update sees as the current policy) of that bf16
model and of the same checkpoint loaded in fp32. Per response token, max and mean of
``|a - b|`` for each pair::

    python -m benchmarks.logprob_gap [--prompts 8] [--group 4] [--tokens 64] [--out out.json]

The model folder is the one ``tune-grpo prepare-model smollm2`` writes (``--model-dir`` or env
``SMOLLM2_DIR``). The figures of issue 53 ran this module on the code before and after the
float32 output projection.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/logprob_gap.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

#: The pairs compared: (name, first, second) over the keys of :func:`measure`'s log-probs.
PAIRS = [("engine bf16 vs trainer bf16", "engine", "trainer_bf16"),
         ("engine bf16 vs trainer fp32", "engine", "trainer_fp32"),
         ("trainer bf16 vs trainer fp32", "trainer_bf16", "trainer_fp32")]


def _recipe(workdir: Path, model_dir: Path, args: argparse.Namespace, dtype: str):
    from benchmarks import real_step
    from torchtune_grpo.training.recipe import GRPORecipe

    (workdir / dtype).mkdir(parents=True, exist_ok=True)
    cfg = real_step.build_config(workdir / dtype, model_dir, args.tokens)
    cfg.dtype, cfg.batch_size, cfg.group_size, cfg.seed = dtype, args.prompts, args.group, 0
    if args.data is not None:
        cfg.dataset.source = str(args.data)
    recipe = GRPORecipe(cfg)
    recipe.setup()
    return recipe


def measure(model_dir: Path, args: argparse.Namespace) -> dict:
    """``{pair name: {"max": float, "mean": float}, "tokens": int}`` over the response tokens of
    one bf16 rollout (see the module docstring)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        recipe16 = _recipe(Path(tmp), model_dir, args, "bf16")
        traj = recipe16.rollout(recipe16.batches.batch(0))
        logprobs = {"engine": traj.logprobs.float(),
                    "trainer_bf16": recipe16.policy_update.policy_logprobs(traj)}
        del recipe16
        recipe32 = _recipe(Path(tmp), model_dir, args, "fp32")
        logprobs["trainer_fp32"] = recipe32.policy_update.policy_logprobs(traj)
    mask = traj.response_mask
    out: dict = {"tokens": int(mask.sum())}
    for name, a, b in PAIRS:
        gap = (logprobs[a] - logprobs[b])[mask].abs().double()
        out[name] = {"max": float(gap.max()), "mean": float(gap.mean())}
    out["all_finite"] = bool(all(torch.isfinite(v[mask]).all() for v in logprobs.values()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("SMOLLM2_DIR", harness.SMOLLM2_DIR)))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--data", type=Path, default=None,
                        help="GSM8K-style jsonl (default: the shared GSM8K, else synthetic)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if harness.smollm2_missing(args.model_dir):
        return 2
    result = measure(args.model_dir, args)
    result.update(harness.run_metadata("logprob_gap", argv))
    if args.out:
        harness.write_json(args.out, result)
    rows = "".join(f"| {name} | {result[name]['max']:.4f} | {result[name]['mean']:.5f} |\n"
                   for name, _, _ in PAIRS)
    print(f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.group} x {args.tokens} tokens,"
          f" {result['tokens']} response tokens\n| pair | max | mean |\n|---|---|---|\n{rows}",
          end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
