#!/usr/bin/env bash
# Gather here, on the CPU machine, what bench/gpu_check.py needs on a lent GPU machine (Python 3.12, torch 2.11 +
# CUDA 13, nvcc and ninja, no network, no DeepSpeed): into the ignored folder .carry/ (.gitignore lists /.carry/),
# which the device call carries. gpu_check.py installs it there itself, inside its 9-minute budget.
#
#   bash bench/gpu_prepare.sh     # before each device call: downloads once, then only refreshes .carry/COMMIT
#
# .carry/ holds: DeepSpeed's sdist (it builds there, ops not prebuilt, against the device's torch; its CPU Adam op
# JIT-builds at first use, which gpu_check does before measuring), the pure-Python wheels it needs that the image
# lacks (hjson, pydantic and its three, typing_extensions for pydantic), torchao (precision="fp8" in the compute
# slice), cut-cross-entropy and liger-kernel (the chunked loss's library rows), and COMMIT: the commit and the count of tracked files changed since (the device's copy of the tree has no
# .git). transformers (the Llama slices' plain-PyTorch rows, the Llama GPU tests) is on the GPU image already.
# Versions follow this machine's .venv, so both sides run the same DeepSpeed. Files of other versions are
# removed: two versions of one package stop the whole install there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.carry
LIMIT_MB=48  # the device tool carries 64 MiB in all, the tree included
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DEST"

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
# file names of a package: "-" or "_" between its words, any case; then "-VERSION" and "-" or "."
name_re() { echo "$1" | sed 's/[-_]/[-_]/g'; }
have() {  # the file of package $1 at version $2 already in $DEST, if any
    local f
    for f in "$DEST"/*; do
        f=$(basename "$f")
        if echo "$f" | grep -qiE "^$(name_re "$1")-${2//./\\.}[-.]"; then echo "$f"; fi
    done
}
drop_others() {  # remove files of package $1 at any version but $2
    local f
    for f in "$DEST"/*; do
        f=$(basename "$f")
        if echo "$f" | grep -qiE "^$(name_re "$1")-[0-9]" && ! echo "$f" | grep -qiE -- "-${2//./\\.}[-.]"; then
            rm -f "$DEST/$f"
            echo "removed $f (another version)"
        fi
    done
}

fetch_pinned() {  # fetch_pinned NAME VERSION: a pure-Python wheel this machine's .venv cannot hold
    drop_others "$1" "$2"
    if [ -n "$(have "$1" "$2")" ]; then return; fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform any -d "$DEST" "$1==$2"
    [ -n "$(have "$1" "$2")" ] || { echo "pip left no file for $1==$2 in $DEST" >&2; exit 1; }
}

fetch() {  # fetch NAME KIND: KIND sdist (DeepSpeed) or wheel (CPython 3.12, x86-64 Linux, or pure Python)
    local name=$1 kind=$2 ver
    ver=$(version "$name")
    if [ -z "$ver" ]; then
        echo "$name is not installed in $PY's environment: install it (pip install $name) first" >&2
        exit 1
    fi
    drop_others "$name" "$ver"
    if [ -n "$(have "$name" "$ver")" ]; then return; fi
    if [ "$kind" = sdist ]; then
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DEST" "$name==$ver"
    else
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d "$DEST" "$name==$ver"
    fi
    [ -n "$(have "$name" "$ver")" ] || { echo "pip left no file for $name==$ver in $DEST" >&2; exit 1; }
}

fetch deepspeed sdist
for pkg in hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions torchao; do
    fetch "$pkg" wheel
done
# the chunked loss's library kernels (model_zoo/loss.py "cce", "liger"; the compute slices' side-by-side rows):
# Triton kernels that need triton, absent from the CPU torch, so pinned here rather than taken from .venv
fetch_pinned cut_cross_entropy 25.1.1
fetch_pinned liger_kernel 0.8.5

# the commit measured: .carry/COMMIT (gpu_check.py reads it where git is missing)
dirty=$(git status --porcelain --untracked-files=no | wc -l)
printf '{"commit": "%s", "dirty_files": %d, "prepared_at": "%s"}\n' "$(git rev-parse HEAD)" "$dirty" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$DEST/COMMIT"

size_kb=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST"
echo "$DEST: $((size_kb / 1024)) MiB ($size_kb KiB); COMMIT: $(cat "$DEST/COMMIT")"
if [ "$size_kb" -gt $((LIMIT_MB * 1024)) ]; then
    echo "$DEST is over $LIMIT_MB MiB: the device call carries 64 MiB with the tree; remove what is not needed" >&2
    exit 1
fi
[ "$dirty" -eq 0 ] || echo "note: $dirty tracked files differ from HEAD; they travel and are measured too"
echo
echo "device call: run(command=\"PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --next --out \$OUT\","
echo "                carry=[\".carry\"], timeout_s=600), then give_back; afterwards, here:"
echo "  python bench/gpu_check.py --record <files_at>/gpu_<device>_<date>_*.json   # every slice the call ran"
