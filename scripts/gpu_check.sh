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
# CUDA device; one `error: ...` line and exit 2 when something is wrong), benchmarks/gpu.py on
# the 0.5B shape, the quickstart for 20 steps on the device in bf16 with held-out accuracy
# before and after, and a 2-process FSDP2 run (skipped, with the reason, on one GPU). Time
# guards skip, by name, what no longer fits the budget (--budget, default 450 s). Other
# options: --out DIR (default $OUT, else outputs/gpu_check), --dtype, --help.
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
