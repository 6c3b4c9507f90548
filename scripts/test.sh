#!/usr/bin/env bash
# Install everything into .venv, lint, and run the test tiers on torch 2.13.0 (tests/tiers.py says what goes
# where): tests/unit (one process, no ranks: what plain `pytest` runs), tests/sweeps (the same, the checks that
# take minutes: sweeps over many plans, models or fresh interpreters), tests/ranks (real gloo ranks and
# launches), tests/system (the
# README, browser and set-up script tests, then the README's set-up in a fresh clone of HEAD with every example
# notebook under nbval in its .venv: scripts/fresh_clone_check.sh; then the tests of every private torch name on
# torch 2.14.1: scripts/test_torch_next.sh, a second venv). Fails if any run fails.
#   bash scripts/test.sh [pytest options]                           lint and every tier (what .ci/run runs)
#   bash scripts/test.sh unit|sweeps|ranks|system [pytest options]  one tier
#   bash scripts/test.sh tests/unit/test_planner.py [...]    only pytest, on those paths
set -euo pipefail
cd "$(dirname "$0")/.."
# Step times in the notebooks are predicted on a datasheet profile, so that their outputs do not
# depend on this machine's calibration (estimate() without hardware= would calibrate it).
export SNN_EXPLORER_HARDWARE="${SNN_EXPLORER_HARDWARE:-A100-SXM-80GB}"
tiers=(unit sweeps ranks system)
case "${1:-}" in
    unit|sweeps|ranks|system) tiers=("$1"); shift ;;
esac
bash scripts/setup.sh --test
for arg in "$@"; do
    if [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ]; then
        exec .venv/bin/python -m pytest "$@"
    fi
done
status=0
if [ "${#tiers[@]}" -gt 1 ]; then
    echo "== lint (ruff, rules in pyproject.toml) =="
    .venv/bin/ruff check snn_explorer tests benchmarks || status=$?
fi
for tier in "${tiers[@]}"; do
    start=$SECONDS
    echo "== tier $tier: tests/$tier =="
    # unit and sweeps: one xdist worker per core (addopts in pyproject.toml). ranks: 3 workers on 2 cores, each with
    # its warm pool, the longest files first (tests/tiers.py): its tests also wait (heartbeats, restarts, timeouts),
    # so a third worker fills the cores; gloo groups form reliably side by side since every rank waits for all to
    # join (snn_explorer.ranks.init_process_group). system: 2 workers (docs pages and the browser in parallel).
    case "$tier" in
        ranks) workers=(-n 3 --dist loadfile) ;;
        system) workers=(-n 2 --dist loadfile) ;;
        *) workers=() ;;
    esac
    .venv/bin/python -m pytest --durations=25 "${workers[@]}" "$@" "tests/$tier" || status=$?
    echo "test.sh: tier $tier (tests/$tier) $((SECONDS - start)) s"
done
if [[ " ${tiers[*]} " == *" system "* ]]; then
    # The notebooks run once, under nbval, in the fresh clone's .venv (a second run in this .venv would check
    # the same cells against the same torch).
    echo "== the README's set-up in a fresh clone, then every notebook under nbval in its .venv (scripts/fresh_clone_check.sh) =="
    bash scripts/fresh_clone_check.sh "$@" || status=$?
    echo "== private torch names (snn_explorer/compat.py) on torch 2.14.1 =="
    bash scripts/test_torch_next.sh || status=$?
fi
exit $status
