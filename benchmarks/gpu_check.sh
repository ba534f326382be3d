#!/usr/bin/env bash
# The one-GPU check (benchmarks/gpu_check.py): device, CIFAR-10 ResNet-32 epoch time for CE
# and LCCN, ResNet-50 images/s against a plain torchvision loop (synthetic and real shards),
# GPU memory. Writes benchmarks/results/gpu.md (and gpu.json).
#
#   bash benchmarks/gpu_check.sh [--cifar PATH/cifar10-jpeg.tar.gz] [more gpu_check.py options]
#
# Runs on a node with only a CUDA PyTorch image: the project's pure-Python dependencies it
# needs (webdataset, braceexpand) are installed offline from wheels in .whl/ when that
# folder exists (pip download --no-deps webdataset braceexpand -d .whl on a machine with
# network). Fails within seconds, with one line, when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: $PY not found (set PYTHON=...)" >&2; exit 2; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
        || { echo "gpu_check: installing the wheels in .whl/ failed" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py --out benchmarks/results/gpu.md \
    --json benchmarks/results/gpu.json "$@"
