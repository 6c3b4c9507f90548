#!/usr/bin/env bash
# Install into .venv and run the main job: analyze -> compare plans -> apply on 4 gloo ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m snn_explorer.quickstart "$@"
