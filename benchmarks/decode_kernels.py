"""Rollout seconds with one decoding feature of the native engine off and on, A/B.

On a shared machine the speed drifts by tens of percent between runs, so the two settings are
timed alternately in one process: the recipe is built once, then ``--rollouts`` rollouts of
the same prompts are run with the feature off and on, in turn (after one warm-up rollout each).
Prints every time and the medians, and checks that both settings sample the same tokens.

Features (``--compare``):

* ``packed``: ``NativeGenerator.packed_weights`` (oneDNN-reordered weights, fused layers);
* ``decode-attention``: the fused layers' one-step attention
  (:func:`torchtune_grpo.backends.cpu_decode.attend_decode_step`) against their general path
  (``attend_projected`` after splitting the q|k|v product), packed weights on in both.

Shapes:

* ``--shape step``: ``benchmarks/step.py``'s (2 layers, dim 128, vocab 128,256, 4 prompts x 8
  samples x 32 new tokens, random weights);
* ``--shape smollm2``: ``benchmarks/real_step.py``'s (SmolLM2-135M-Instruct, 2 prompts x 4 x
  ``--new-tokens``; needs ``tune-grpo prepare-model smollm2``).

Usage::

    python benchmarks/decode_kernels.py --shape step --rollouts 4
    python benchmarks/decode_kernels.py --shape smollm2 --new-tokens 64 --rollouts 3
    python benchmarks/decode_kernels.py --shape smollm2 --new-tokens 64 --rollouts 6 \
        --compare decode-attention
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/decode_kernels.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402


def build_recipe(shape: str, workdir: Path, new_tokens: int, model_dir: Path,
                 overrides: dict | None = None):
    """A set-up ``GRPORecipe`` at ``shape`` (see the module docstring), with the top-level config
    keys of ``overrides`` set."""
    from torchtune_grpo.training.recipe import GRPORecipe

    if shape == "step":
        from benchmarks import step

        harness.write_tiny_model(workdir / "model", step.DIMS)
        cfg = step.build_config(workdir, "cpu", new_tokens)
    else:
        from benchmarks import real_step

        cfg = real_step.build_config(workdir, model_dir, new_tokens)
    for key, value in (overrides or {}).items():
        cfg[key] = value
    recipe = GRPORecipe(cfg)
    recipe.setup()
    return recipe


def _setter(recipe, compare: str):
    """``set(on: bool)`` that switches the compared feature of ``recipe``'s engine."""
    if compare == "packed":
        def set_packed(on: bool) -> None:
            recipe.generator.packed_weights = on
        return set_packed
    from torchtune_grpo.backends import cpu_decode as packed_decode

    step = packed_decode.attend_decode_step

    def set_decode_attention(on: bool) -> None:
        recipe.generator.packed_weights = True
        packed_decode.attend_decode_step = step if on else (lambda *a, **k: None)
    return set_decode_attention


def ab(recipe, rollouts: int, compare: str = "packed") -> dict:
    """``{False: [seconds], True: [seconds], "same_tokens": bool}`` over alternating rollouts
    with the ``compare`` feature off (False) and on (True)."""
    batch = recipe.batches.batch(0)
    switch = _setter(recipe, compare)
    times: dict = {False: [], True: []}
    tokens = {}
    try:
        for on in (False, True):  # warm-up of each setting
            switch(on)
            recipe.rollout(batch)
        for _ in range(rollouts):
            for on in (False, True):
                switch(on)
                t0 = time.perf_counter()
                traj = recipe.rollout(batch)
                times[on].append(time.perf_counter() - t0)
                tokens[on] = traj.tokens
    finally:
        switch(True)
    times["same_tokens"] = bool(tokens[False].shape == tokens[True].shape
                                and (tokens[False] == tokens[True]).all())
    return times


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the A/B, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["step", "smollm2"], default="step")
    parser.add_argument("--rollouts", type=int, default=4, help="timed rollouts per setting")
    parser.add_argument("--compare", choices=["packed", "decode-attention"], default="packed",
                        help="the feature switched off and on")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=harness.SMOLLM2_DIR)
    parser.add_argument("--out", type=Path, help="write the times as JSON")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.shape == "smollm2" and harness.smollm2_missing(args.model_dir):
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        recipe = build_recipe(args.shape, Path(tmp), args.new_tokens, args.model_dir)
        times = ab(recipe, args.rollouts, args.compare)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    labels = {"packed": ("F.linear", "packed (oneDNN)"),
              "decode-attention": ("attend_projected", "attend_decode_step")}[args.compare]
    for on, label in zip((False, True), labels):
        print(f"{label:<18} " + " ".join(f"{t:.2f}" for t in times[on])
              + f"  median {median(times[on]):.2f} s")
    print(f"{labels[1]} / {labels[0]}: {median(times[True]) / median(times[False]):.2f}; "
          f"same tokens: {times['same_tokens']}")
    if args.out:
        harness.write_json(args.out, {
            **harness.run_metadata("decode_kernels", argv),
            "compare": args.compare, "off_s": times[False], "on_s": times[True],
            "same_tokens": times["same_tokens"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
