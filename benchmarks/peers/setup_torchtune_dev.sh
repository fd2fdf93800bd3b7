#!/usr/bin/env bash
# Install torchtune's original dev GRPO recipe as a benchmark peer, in its own venv.
#
#   bash benchmarks/peers/setup_torchtune_dev.sh /path/to/torchtune-checkout [VENV]
#
# The checkout is torchtune's repository at HEAD (git clone https://github.com/pytorch/torchtune;
# measured with bd2a0fc). VENV defaults to .venv-torchtune-dev. The venv sees this machine's
# packages (torch, omegaconf, datasets, tiktoken, torchdata, ...) and gets, on top of them:
#   * torchtune from the checkout (--no-deps: its declared vllm==0.8.4/ray are not needed on CPU),
#   * torchao 0.18 (torchtune HEAD imports NF4Tensor from torchao.quantization, which 0.18 has),
#   * a stub `torchvision`: torchtune.data imports it at module level for image transforms the
#     GRPO recipe never calls, and PyPI has no CPU torchvision wheel built for torch 2.13.
# The recipe file itself is run unchanged from the checkout (recipes/dev/...), so
# benchmarks/step.py needs --torchtune-src pointing at the checkout (default: VENV/torchtune).
set -euo pipefail
SRC=${1:?usage: setup_torchtune_dev.sh /path/to/torchtune-checkout [VENV]}
VENV=${2:-.venv-torchtune-dev}
SRC=$(cd "$SRC" && pwd)
test -f "$SRC/recipes/dev/grpo_full_finetune_distributed.py" || {
  echo "error: $SRC/recipes/dev/grpo_full_finetune_distributed.py not found (not a torchtune checkout?)" >&2; exit 2; }
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps "$SRC"
"$VENV/bin/pip" install -q --no-deps "torchao==0.18.0"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for d in torchvision torchvision/transforms torchvision/transforms/v2; do
  mkdir -p "$SITE/$d"
  cat > "$SITE/$d/__init__.py" <<'PY'
"""Stub installed by benchmarks/peers/setup_torchtune_dev.sh: torchtune imports torchvision for
image transforms that its GRPO recipe never uses; any use raises."""


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        return _Unavailable(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {self._name} is not available")


def __getattr__(name):
    return _Unavailable(name)
PY
done
cp "$SITE/torchvision/__init__.py" "$SITE/torchvision/transforms/v2/functional.py"
ln -sfn "$SRC" "$VENV/torchtune"
"$VENV/bin/python" - "$SRC" <<'PY'
import importlib.util, sys
path = f"{sys.argv[1]}/recipes/dev/grpo_full_finetune_distributed.py"
spec = importlib.util.spec_from_file_location("recipe", path)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(f"ok: {path} imports in this venv")
PY
echo "run: python benchmarks/step.py --threads 2 --variants optimized --peer torchtune-dev --peer-python $VENV/bin/python --torchtune-src $SRC"
