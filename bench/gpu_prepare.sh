#!/usr/bin/env bash
# Prepare what bench/gpu_check.py needs on the lent GPU machine (Python 3.12, torch 2.11 + CUDA 13, no network):
# DeepSpeed (an sdist: it builds there against that torch, its ops JIT-compile at first use) and those of its
# pure-Python dependencies the image lacks, downloaded here into the ignored folder .carry/.
#
#   bash bench/gpu_prepare.sh            # once, on this machine; then pass carry=[".carry"] to the device tool
#
# On the device machine, start every command with the line this script prints last (the install, then the
# PYTHONPATH that puts this checkout and the installed packages first). The image already holds torch, numpy,
# transformers, safetensors, tensorboard, psutil, ninja, einops, msgpack, py-cpuinfo, tqdm, pytest, pytest-timeout;
# not torchao, which this script adds.
# Versions follow this machine's pins, so both sides run the same DeepSpeed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.carry
# .gitignore lists /.carry/: the device tool sends it only when a call names it in `carry`.
rm -rf "$DEST" && mkdir -p "$DEST"

version() { python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
pin() { local v; v=$(version "$1"); if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi; }

# DeepSpeed as source: its setup.py imports the torch it is installed against (the device's 2.11).
python -m pip download -q --no-deps --no-binary :all: -d "$DEST" "$(pin deepspeed)"
# Its dependencies missing from the image, as wheels for CPython 3.12 on x86-64 Linux.
WHEEL_OPTS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
            --platform any -d "$DEST")
# torchao: precision="fp8" (float8 training) in gpu_check's no_offload rows; the image lacks it (~3.4 MB). Its
# compiled extensions may not load against the device's torch (torchao then warns); float8 training is Python on
# torch._scaled_mm and should not need them: not yet checked on a GPU (a failure is an error row).
for pkg in hjson pydantic pydantic_core annotated_types typing_inspection torchao; do
    python -m pip download -q "${WHEEL_OPTS[@]}" "$(pin "$pkg")"
done
du -sh "$DEST"
ls "$DEST"
echo
echo "device command prefix:"
echo '[ -d /tmp/site/deepspeed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/*.whl && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .carry/deepspeed-*.tar.gz; } || exit 1; export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1;'
