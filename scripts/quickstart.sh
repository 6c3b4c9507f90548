#!/usr/bin/env bash
# Install what the main job needs into .venv (no test tools) and run it: analyze -> compare plans -> apply on 4 gloo ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m snn_explorer.quickstart "$@"
