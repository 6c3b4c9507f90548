#!/usr/bin/env bash
# Install everything into .venv, lint, and run the whole test suite: tests/ (unit, multi-rank, browser) on
# torch 2.13.0; then the README's set-up command in a fresh clone of HEAD and every example notebook under
# nbval in its .venv (scripts/fresh_clone_check.sh); then the tests of every private
# torch name on torch 2.14.1 (scripts/test_torch_next.sh, a second venv). Fails if any run fails.
# With test paths as arguments (e.g. tests/test_planner.py), runs only pytest on those.
set -euo pipefail
cd "$(dirname "$0")/.."
# Step times in the notebooks are predicted on a datasheet profile, so that their outputs do not
# depend on this machine's calibration (estimate() without hardware= would calibrate it).
export SNN_EXPLORER_HARDWARE="${SNN_EXPLORER_HARDWARE:-A100-SXM-80GB}"
bash scripts/setup.sh --test
for arg in "$@"; do
    if [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ]; then
        exec .venv/bin/python -m pytest "$@"
    fi
done
status=0
echo "== lint (ruff, rules in pyproject.toml) =="
.venv/bin/ruff check snn_explorer tests benchmarks || status=$?
.venv/bin/python -m pytest --durations=25 "$@" || status=$?
# The notebooks run once, under nbval, in the fresh clone's .venv (a second run in this .venv would check
# the same cells against the same torch).
echo "== the README's set-up in a fresh clone, then every notebook under nbval in its .venv (scripts/fresh_clone_check.sh) =="
bash scripts/fresh_clone_check.sh "$@" || status=$?
echo "== private torch names (snn_explorer/compat.py) on torch 2.14.1 =="
bash scripts/test_torch_next.sh || status=$?
exit $status
