#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with its test extra. Idempotent.
#
#   bash scripts/setup.sh [--simd]
#
# --simd: then build pillow-simd (AVX2) in place of Pillow, last (scripts/pillow_simd.sh;
# Pillow stays, with one line saying why, if it does not build).
set -euo pipefail
cd "$(dirname "$0")/.."
SIMD=0
for arg in "$@"; do
  case "$arg" in
    --simd) SIMD=1 ;;
    *) echo "setup: unknown option $arg (usage: bash scripts/setup.sh [--simd])" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 not found (set PYTHON=...)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/python -c 'import torch, torchvision, ray, webdataset, mlflow; print(f"setup: torch {torch.__version__}, ray {ray.__version__}, mlflow {mlflow.__version__}")'
if [ "$SIMD" = 1 ]; then
  bash scripts/pillow_simd.sh .venv/bin/python
fi
