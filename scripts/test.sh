#!/usr/bin/env bash
# Install everything into .venv, lint, and run the test tiers on torch 2.13.0 (tests/tiers.py says what goes
# where): tests/unit (one process, no ranks: what plain `pytest` runs), tests/sweeps (the same, the checks that
# take minutes: sweeps over many plans, models or fresh interpreters), tests/ranks (real gloo ranks and
# launches), tests/system (the README, browser and set-up script tests). With the system tier come two checks
# that run beside the tiers, each in its own venv, from the start: the README's set-up in a fresh clone of HEAD
# (scripts/fresh_clone_check.sh --set-up), whose every example notebook then runs under nbval after the system
# tier, and the tests of every private torch name on torch 2.14.1 (scripts/test_torch_next.sh). Their set-ups are
# single-threaded pip installs: beside the tiers they use the core the installs and the tiers' ends leave idle.
# Fails if any run fails; the last lines it prints say which step failed, and the tests that failed in it.
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
paths_only=false
for arg in "$@"; do
    [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ] && paths_only=true
done
with_system=false
[[ " ${tiers[*]} " == *" system "* ]] && ! $paths_only && with_system=true
side_pids=()
side=$(mktemp -d "${TMPDIR:-/tmp}/snn-test-side.XXXXXX")
trap 'for pid in "${side_pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; rm -rf "$side"' EXIT
summary=()
# The summary that ends the run (a failure in the rank tier is otherwise thousands of lines above the last
# line): record NAME CODE LOG keeps a step's result and the lines of LOG that name its failed tests.
record() {
    if [ "$2" = 0 ]; then
        summary+=("$1: passed")
    else
        status=$2
        summary+=("$1: FAILED (exit $2)")
        while IFS= read -r line; do summary+=("    $line"); done < <(grep -E '^(FAILED|ERROR) ' "$3")
    fi
}
# step NAME COMMAND...: runs the command, its output shown and kept for record.
step() {
    local name=$1 code=0
    shift
    "$@" 2>&1 | tee "$side/step.log" || code=$?
    record "$name" $code "$side/step.log"
}
if $with_system; then
    # Each in a session of its own, so that an interrupted run ends them with all they started. The fresh clone
    # installs into its own folder from the start; the torch-next venv installs this checkout (pip install -e .)
    # once .venv's own install of it is done.
    setsid -w bash scripts/fresh_clone_check.sh --set-up "$side/fresh" > "$side/fresh-set-up.log" 2>&1 &
    fresh_pid=$!
    side_pids+=("$fresh_pid")
fi
bash scripts/setup.sh --test
if $paths_only; then .venv/bin/python -m pytest "$@"; exit; fi
status=0
if $with_system; then
    setsid -w bash scripts/test_torch_next.sh > "$side/torch-next.log" 2>&1 &
    next_pid=$!
    side_pids+=("$next_pid")
fi
if [ "${#tiers[@]}" -gt 1 ]; then
    echo "== lint (ruff, rules in pyproject.toml) =="
    step "lint" .venv/bin/ruff check snn_explorer tests benchmarks
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
    step "tier $tier (tests/$tier)" .venv/bin/python -m pytest --durations=25 "${workers[@]}" "$@" "tests/$tier"
    echo "test.sh: tier $tier (tests/$tier) $((SECONDS - start)) s"
done
if $with_system; then
    # The notebooks run once, under nbval, in the fresh clone's .venv (a second run in this .venv would check
    # the same cells against the same torch).
    echo "== the README's set-up in a fresh clone (run beside the tiers; scripts/fresh_clone_check.sh) =="
    fresh=0
    wait "$fresh_pid" || fresh=$?
    cat "$side/fresh-set-up.log"
    record "fresh clone's set-up (scripts/fresh_clone_check.sh)" $fresh "$side/fresh-set-up.log"
    if [ $fresh = 0 ]; then
        step "notebooks (nbval, in the fresh clone)" bash scripts/fresh_clone_check.sh --notebooks "$side/fresh" "$@"
    fi
    echo "== private torch names (snn_explorer/compat.py) on torch 2.14.1 (run beside the tiers; scripts/test_torch_next.sh) =="
    next=0
    wait "$next_pid" || next=$?
    cat "$side/torch-next.log"
    record "torch 2.14.1 (scripts/test_torch_next.sh)" $next "$side/torch-next.log"
fi
echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $status
