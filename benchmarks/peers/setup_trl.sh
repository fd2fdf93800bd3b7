#!/usr/bin/env bash
# Install TRL (GRPOTrainer) as a benchmark peer for benchmarks/real_step.py, in its own venv.
#
#   bash benchmarks/peers/setup_trl.sh [VENV]
#
# VENV defaults to .venv-trl. The venv sees this machine's packages (torch, transformers,
# datasets, accelerate, ...) and gets trl itself with --no-deps, so pip never replaces the
# installed torch; any declared dependency that is missing is installed on its own afterwards
# (also --no-deps), and the script ends by importing GRPOTrainer.
set -euo pipefail
VENV=${1:-.venv-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps "trl==$TRL_VERSION"
# trl's declared requirements (accelerate, datasets, transformers, packaging): install only the
# ones this machine lacks, without their own dependencies (torch stays the system's).
for req in accelerate datasets transformers packaging; do
  "$VENV/bin/python" -c "import importlib, sys; importlib.import_module(sys.argv[1])" "$req" 2>/dev/null \
    || "$VENV/bin/pip" install -q --no-deps "$req"
done
"$VENV/bin/pip" check || echo "warning: pip check reports the above (the benchmark needs only the import below)" >&2
"$VENV/bin/python" -c "import torch, trl; from trl import GRPOConfig, GRPOTrainer; print(f'ok: trl {trl.__version__}, torch {torch.__version__}')"
echo "run: python benchmarks/real_step.py --threads 2 --peer trl --peer-python $VENV/bin/python"
