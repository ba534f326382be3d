#!/usr/bin/env bash
# Set up, then run the main job on its embedded default data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python jobs/quickstart_ray.py "$@"
