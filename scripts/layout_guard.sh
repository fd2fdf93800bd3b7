#!/usr/bin/env bash
# Bitwise guard for refactors that must not change behaviour (issue 30): runs the quickstart,
# the tools quickstart and the async quickstart for a few steps with the checkout at SRC,
# from the same prepared models, and writes their metrics (time and memory keys dropped) and
# the SHA-256 of every weight file of the final step to OUT/fingerprint.txt. Run it on the old
# and on the new tree, then `diff` the two files: any difference is a behaviour change.
#
#   bash scripts/layout_guard.sh /path/to/old/checkout /tmp/guard_old
#   bash scripts/layout_guard.sh /path/to/new/checkout /tmp/guard_new
#   diff /tmp/guard_old/fingerprint.txt /tmp/guard_new/fingerprint.txt && echo identical
#
# With the prepared SmolLM2-135M-Instruct folder (REAL_MODEL, default
# /tmp/tune_grpo_models/SmolLM2-135M-Instruct; `tune-grpo prepare-model smollm2`) it also runs 2
# steps of grpo/smollm2_arithmetic_cpu (batch 2 x group 8) on one thread: with two threads the
# same code differs from run to run from the second step (measured: loss 0.12737308 vs
# 0.12737273), with one it is bitwise stable. REAL=0 skips it.
#
# The prepared models (MODELS, default /tmp/layout_guard_models) are written once, by the
# first checkout that runs, and reused by the others, so that both runs start from the same
# bytes; their hashes are part of the fingerprint.
set -euo pipefail
SRC=$(cd "$1" && pwd)
OUT=$2
MODELS=${MODELS:-/tmp/layout_guard_models}
STEPS=${STEPS:-6}
export PYTHONPATH="$SRC:$SRC/recipes${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# MKL picks kernels by memory alignment unless told not to: a refactor that moves allocations
# around then changes float32 sums in the last bit (measured: the same code is bitwise stable
# run to run, two layouts differ from step 2 on at ~1e-7). Conditional numerical
# reproducibility makes the comparison about the code, not about where tensors landed.
export MKL_CBWR=${MKL_CBWR:-COMPATIBLE}
rm -rf "$OUT" && mkdir -p "$OUT"
cd "$OUT"

tune_grpo() {
  # the CLI entry point moved in the redesign; run whichever this checkout has
  if [ -f "$SRC/torchtune_grpo/cli/main.py" ]; then
    python -m torchtune_grpo.cli.main "$@"
  else
    python -m torchtune_grpo._cli "$@"
  fi
}

if [ ! -d "$MODELS/base" ]; then
  tune_grpo prepare-quickstart --output-dir "$MODELS/base" > "$OUT/prepare.log" 2>&1
fi
if [ ! -d "$MODELS/tools" ]; then
  tune_grpo prepare-quickstart --tools --output-dir "$MODELS/tools" > "$OUT/prepare_tools.log" 2>&1
fi

common="num_steps=$STEPS save_every_n_steps=$STEPS progress_bar=false"
tune run grpo_full_finetune_distributed --config grpo/quickstart_cpu \
  model_dir="$MODELS/base" output_dir="$OUT/quickstart" $common eval_every_n_steps=3 \
  > "$OUT/quickstart.log" 2>&1
tune run grpo_full_finetune_distributed --config grpo/quickstart_cpu_tools \
  model_dir="$MODELS/tools" output_dir="$OUT/tools" $common eval_every_n_steps=3 \
  > "$OUT/tools.log" 2>&1
tune run --nproc_per_node 3 async_grpo_full_finetune_distributed --config grpo/quickstart_cpu_async \
  model_dir="$MODELS/base" output_dir="$OUT/async" $common \
  > "$OUT/async.log" 2>&1

RUNS="quickstart:$STEPS tools:$STEPS async:$STEPS"
REAL_MODEL=${REAL_MODEL:-/tmp/tune_grpo_models/SmolLM2-135M-Instruct}
if [ "${REAL:-1}" != 0 ] && [ -f "$REAL_MODEL/config.json" ]; then
  OMP_NUM_THREADS=1 tune run grpo_full_finetune_distributed --config grpo/smollm2_arithmetic_cpu \
    model_dir="$REAL_MODEL" output_dir="$OUT/smollm2" num_steps=2 save_every_n_steps=2 \
    eval_every_n_steps=null eval_at_start=false batch_size=2 group_size=8 forward_batch_size=16 \
    progress_bar=false > "$OUT/smollm2.log" 2>&1
  RUNS="$RUNS smollm2:2"
fi

python - "$OUT" "$MODELS" "$RUNS" > "$OUT/fingerprint.txt" <<'EOF'
import hashlib, pathlib, re, sys
out, models = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
runs = [run.split(":") for run in sys.argv[3].split()]
volatile = re.compile(r"^(time/|memory/|peak_|async/|weight_sync/seconds|.*per_second|.*tokens_per_s|.*_seconds$)")
def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()
for folder in sorted(p for p in models.rglob("*") if p.is_file()):
    print("model", folder.relative_to(models), digest(folder))
for run, steps in runs:
    logs = sorted((out / run / "logs").glob("*.txt"))
    if not logs:
        sys.exit(f"no metric log in {out / run / 'logs'}")
    for line in logs[-1].read_text().splitlines():
        step, _, rest = line.partition(" | ")
        kept = sorted(kv for kv in rest.split() if not volatile.match(kv.split(":")[0]))
        print(run, step, " ".join(kept))
    step_dir = out / run / f"step_{steps}"
    files = sorted(p for p in step_dir.rglob("*") if p.is_file()
                   and p.suffix in (".safetensors", ".bin"))
    if not files:
        sys.exit(f"no weight files in {step_dir}")
    for f in files:
        print(run, "weights", f.relative_to(out / run), digest(f))
    # the recipe state holds wall-clock figures; compare its tensors (optimizer, RNG) instead
    import torch
    state = torch.load(step_dir / "recipe_state.pt", map_location="cpu", weights_only=True)
    def tensors(value, prefix=""):
        if isinstance(value, torch.Tensor):
            yield prefix, value
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                yield from tensors(value[key], f"{prefix}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from tensors(item, f"{prefix}/{i}")
    for name, tensor in tensors(state):
        print(run, "state", name, hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
EOF
echo "fingerprint: $OUT/fingerprint.txt ($(wc -l < "$OUT/fingerprint.txt") lines)"
