#!/usr/bin/env bash
# The GPU check (issue 47): one command for the lent GPU machine (one H100 or H200, no network,
# Python 3.12 and torch 2.11 in its image), ending within 8 minutes, everything under $OUT.
#
#   bash scripts/device_kit.sh            # once, where PyPI is reachable: .device_kit/ (< 60 MiB)
#   bash scripts/gpu_check.sh             # on the lent machine (carry .device_kit)
#   bash scripts/gpu_check.sh --device cpu --tiny   # the same parts on CPU, GPU-only ones skipped
#
# It puts the kit (.device_kit/site-packages, or $DEVICE_KIT), the repository and recipes/ on
# PYTHONPATH (so nothing is installed: `tune` runs as `python3 -m torchtune._cli.tune`, the
# recipes as top-level modules) and runs benchmarks/gpu_check.py: a preflight (imports, the
# CUDA device; one `error: ...` line and exit 2 when something is wrong), then the risky parts
# first: (1) one step of each bf16 AdamW on a one-rank FSDP2 layer of the 3B shape; (2) decode
# ms and host syncs per token at 16 and 64 rows; (3) GRPO steps of grpo/qwen2_5_3B_full's
# settings at its shape, random weights: seconds per phase, peak memory against the estimate;
# (4) the bf16 engine-trainer log-prob gap; (5) the quickstart; (6) a one-rank NCCL FSDP2 decode
# through gathered_for_inference. Each part writes its figures to $OUT as they come. Time guards
# skip, by name, what no longer fits the budget (--budget, default 450 s). Other options: --out
# DIR (default $OUT, else outputs/gpu_check), --dtype, --skip PART..., --help.
# docs/performance.md, section "The GPU check", has the details.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
KIT=${DEVICE_KIT:-$REPO/.device_kit/site-packages}
PYTHON=${PYTHON:-python3}
export DEVICE_KIT=$KIT
export PYTHONPATH="$KIT:$REPO:$REPO/recipes${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v "$PYTHON" > /dev/null; then
    echo "error: no $PYTHON on PATH (set PYTHON=/path/to/python3)" >&2
    exit 2
fi
cd "$REPO"
exec "$PYTHON" "$REPO/benchmarks/gpu_check.py" --python "$(command -v "$PYTHON")" "$@"
