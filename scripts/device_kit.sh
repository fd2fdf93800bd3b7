#!/usr/bin/env bash
# The device kit (issue 47): every Python package this project needs beyond the lent GPU
# machine's image, as one git-ignored folder that travels with the working tree (the machine
# reaches no package registry and takes at most 64 MiB of git-ignored files).
#
#   bash scripts/device_kit.sh                         # .device_kit/ for Python 3.12 (the image)
#   bash scripts/device_kit.sh --python-version 3.11   # for a Python 3.11 imitation of it
#   bash scripts/device_kit.sh --dest /tmp/kit         # another folder
#
# The image has Python 3.12, torch 2.11.0+cu130, transformers, numpy, pandas, pyarrow, sympy,
# tiktoken, tokenizers, safetensors, sentencepiece, huggingface-hub, tqdm, pytest and what
# those pulled in (requests, pyyaml, jinja2, fsspec, filelock, packaging, ...). The kit adds what
# is missing, each pinned, downloaded as a wheel with
#   pip download --only-binary=:all: --python-version X.Y --no-deps
# and unpacked into .device_kit/site-packages (dist-info included, so importlib.metadata sees
# the versions). PYTHONPATH=.device_kit/site-packages is all it takes; scripts/gpu_check.sh
# sets it. Pure-Python packages are fetched with --platform any, so a package that also ships a
# compiled build (torchao) comes as its pure-Python wheel; the few compiled ones are fetched for
# x86_64 Linux (manylinux tags up to glibc 2.28) and this Python version.
#
# Groups (why each package is here):
#   torchtune's imports at `import torchtune` / `tune run`: torchtune, torchao (pure build: its
#     C++/CUDA kernels are not used by this project), omegaconf, datasets (+ dill, multiprocess,
#     xxhash), psutil (torchtune.training), kagglehub (+ kagglesdk, protobuf: torchtune's CLI
#     imports its `download` command); torchdata (declared by torchtune and this project,
#     imported by torchtune's data utilities when called)
#   this project's own dependencies: gguf, math-verify (+ latex2sympy2_extended,
#     antlr4-python3-runtime)
# Left out: Pillow (20 MiB unpacked; torchtune imports it only for its vision models and
# `load_image`, which this project does not use), matplotlib (with contourpy, fonttools, kiwisolver: 60 MiB unpacked, more than the
# whole kit may be); only `tune-grpo plot` needs it, so plot the metric logs that the GPU check
# writes under $OUT on another machine.
#   the tests: hypothesis (+ attrs, sortedcontainers), pytest-timeout, accelerate
#     (transformers' GGUF loader, the reference of tests/unit/models/test_gguf_import.py)
# vLLM is not in the kit (too big to carry); benchmarks/gpu.py skips it with the reason.
#
# The folder is rebuilt from scratch on every run; the script ends by printing the kit's size
# and its list (also written to .device_kit/MANIFEST.txt) and fails if it exceeds 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
DEST=.device_kit
LIMIT_MIB=60
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYVER=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device_kit.sh: unknown argument '$1' (use --python-version X.Y, --dest DIR)" >&2
           exit 2 ;;
    esac
done
if ! [[ "$PYVER" =~ ^3\.[0-9]+$ ]]; then
    echo "device_kit.sh: --python-version must look like 3.12, got '$PYVER'" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}

# Pure-Python wheels (py3-none-any), fetched with --platform any.
PURE=(
    torchtune==0.6.1
    torchao==0.15.0
    omegaconf==2.4.0
    torchdata==0.11.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    kagglehub==1.0.3
    kagglesdk==0.1.38
    gguf==0.19.0
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    hypothesis==6.155.2
    attrs==26.1.0
    sortedcontainers==2.4.0
    pytest-timeout==2.4.0
    accelerate==1.16.0
)
# Compiled wheels, fetched for x86_64 Linux (glibc 2.28 or older tags) and Python $PYVER.
COMPILED=(
    xxhash==4.1.0
    psutil==7.2.2
    protobuf==7.36.2
)

rm -rf "$DEST"
mkdir -p "$DEST/site-packages"
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
common=(download --quiet --only-binary=:all: --no-deps --python-version "$PYVER"
        --dest "$WHEELS")
echo "device_kit.sh: downloading ${#PURE[@]} pure-Python and ${#COMPILED[@]} compiled wheels" \
     "for Python $PYVER ..."
"$PYTHON" -m pip "${common[@]}" --platform any "${PURE[@]}"
# pip does not widen a given --platform to older manylinux tags: name each one the image's
# glibc (2.28 or newer) runs.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
           manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip "${common[@]}" "${platforms[@]}" "${COMPILED[@]}"

# Unpack every wheel into site-packages (a wheel's .data/purelib and platlib go there too),
# then write the manifest.
"$PYTHON" - "$WHEELS" "$DEST" "$PYVER" <<'EOF'
import shutil
import sys
import zipfile
from pathlib import Path

wheels, dest, pyver = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
site = dest / "site-packages"
lines = []
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    name, version = wheel.name.split("-")[:2]
    lines.append(f"{name}=={version}  {wheel.name}")
for data in site.glob("*.data"):
    for sub in ("purelib", "platlib"):
        if (data / sub).is_dir():
            shutil.copytree(data / sub, site, dirs_exist_ok=True)
    shutil.rmtree(data)
header = f"# device kit for Python {pyver}: PYTHONPATH={site}\n"
(dest / "MANIFEST.txt").write_text(header + "\n".join(lines) + "\n")
EOF

size_kib=$(du -sk "$DEST" | cut -f1)
size_mib=$(( (size_kib + 1023) / 1024 ))
echo "device_kit.sh: $(grep -vc '^#' "$DEST/MANIFEST.txt") packages in $DEST (Python $PYVER):"
grep -v '^#' "$DEST/MANIFEST.txt" | cut -d' ' -f1 | sed 's/^/  /'
echo "device_kit.sh: size $(du -sh "$DEST" | cut -f1) ($size_kib KiB; limit $LIMIT_MIB MiB)"
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
    echo "device_kit.sh: error: the kit is $size_mib MiB, over the $LIMIT_MIB MiB limit" >&2
    exit 1
fi
