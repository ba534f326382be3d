#!/usr/bin/env bash
# Put pillow-simd (built with AVX2) in place of Pillow in a Python environment; if it does not
# build, put Pillow back and say so in one line. Then print which PIL the environment has.
#
#   bash scripts/pillow_simd.sh [PYTHON]          # default: .venv/bin/python
#
# Needs a C compiler and the libjpeg and zlib headers (Debian/Ubuntu: build-essential
# libjpeg-turbo8-dev or libjpeg62-turbo-dev, zlib1g-dev). Run it last: any later pip install
# that touches torchvision installs Pillow over it (pip sees no "pillow" distribution).
set -uo pipefail
PY="${1:-.venv/bin/python}"
VERSION="${PILLOW_SIMD_VERSION:-12.1.1.post0}"
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }
check() { "$PY" -m pipeline.data.pil_build "$@"; }

if check --require-simd >/dev/null 2>&1; then
  check
  exit 0
fi
before=$("$PY" -c 'import PIL; print(PIL.__version__)' 2>/dev/null || true)
pip uninstall --quiet --yes pillow >/dev/null 2>&1 || true
log=$(mktemp)
if CC="${CC:-cc} -mavx2" pip install --quiet --no-cache-dir --no-deps --no-binary pillow-simd \
    "pillow-simd==$VERSION" >"$log" 2>&1 && check --require-simd >/dev/null 2>&1; then
  rm -f "$log"
else
  reason=$(grep -iE 'error' "$log" | grep -viE 'subprocess-exited-with-error|^ *note' \
           | head -1 | sed 's/^ *//' | cut -c1-160)
  echo "pillow_simd: pillow-simd $VERSION did not build or import (${reason:-no error line from pip});" \
       "keeping Pillow ${before:-(latest)}" >&2
  rm -f "$log"
  pip uninstall --quiet --yes pillow-simd >/dev/null 2>&1 || true
  pip install --quiet "pillow${before:+==$before}" >/dev/null \
    || { echo "pillow_simd: could not reinstall Pillow either" >&2; exit 1; }
fi
check
