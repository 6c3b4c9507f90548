#!/usr/bin/env bash
# The README's set-up, as a new user meets it: clone this repository's HEAD into a temporary folder, run
# the README's set-up command there (`bash scripts/quickstart.sh`: it installs .venv and runs the main
# job), and run every notebook under nbval in a kernel of that fresh .venv, with nothing else installed
# into it. nbval itself runs from this checkout's .venv (scripts/setup.sh --test installs it): it only
# drives the kernel, whose python is the clone's. Prints the seconds each part took. Fails if either fails.
#   bash scripts/fresh_clone_check.sh [pytest options]               both parts, in a temporary folder
#   bash scripts/fresh_clone_check.sh --set-up DIR                   the clone and its set-up only, into DIR
#   bash scripts/fresh_clone_check.sh --notebooks DIR [pytest options]  the notebooks of the clone in DIR
# (scripts/test.sh runs the set-up beside the first test tiers, and the notebooks after them.)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# As in scripts/test.sh: the notebooks' committed step times are predicted on a datasheet profile.
export SNN_EXPLORER_HARDWARE="${SNN_EXPLORER_HARDWARE:-A100-SXM-80GB}"
TOOLS=${TOOLS_PYTHON:-$ROOT/.venv/bin/python}
part=both
case "${1:-}" in
    --set-up|--notebooks) part=${1#--}; work=$2; shift 2 ;;
esac
if [ $part = both ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/snn-fresh-clone.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
# On a machine shared with other rank-spawning work, RANKS_LOCK names a lock file: the install then runs
# first, outside the lock (scripts/setup.sh, which quickstart.sh runs and, installed, then skips), and
# the rank-spawning parts (the main job, the notebooks) inside it. Unset (CI): exactly the README's command.
locked=()
[ -n "${RANKS_LOCK:-}" ] && locked=(flock "$RANKS_LOCK")

set_up() {
    mkdir -p "$work"
    git clone -q --no-hardlinks "$ROOT" "$work/clone"
    cd "$work/clone"
    local start=$SECONDS
    echo "== fresh clone of $(git rev-parse --short HEAD): bash scripts/quickstart.sh (the README's set-up) =="
    [ -n "${RANKS_LOCK:-}" ] && bash scripts/setup.sh
    "${locked[@]}" bash scripts/quickstart.sh
    # The clone's .venv holds the clone's package and none of the test tools (nothing else was installed).
    .venv/bin/python - "$work/clone" <<'PY'
import importlib.util, os, sys
import snn_explorer
assert os.path.realpath(snn_explorer.__file__).startswith(os.path.realpath(sys.argv[1])), snn_explorer.__file__
extra = [m for m in ("nbval", "pytest", "playwright") if importlib.util.find_spec(m)]
assert not extra, f"the set-up installed test tools: {extra}"
PY
    # A kernel spec naming the clone's python by its absolute path (jupyter_client would swap a bare
    # "python" for the tools' own interpreter).
    mkdir -p "$work/jupyter/kernels/snn-fresh-clone"
    cat > "$work/jupyter/kernels/snn-fresh-clone/kernel.json" <<JSON
{"argv": ["$work/clone/.venv/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
 "display_name": "fresh clone", "language": "python"}
JSON
    echo "fresh_clone_check: set-up $((SECONDS - start)) s"
}

notebooks() {
    [ -x "$work/clone/.venv/bin/python" ] || {
        echo "fresh_clone_check: no set-up clone in $work; run it with --set-up $work first" >&2; exit 2; }
    "$TOOLS" -c 'import nbval' 2>/dev/null || {
        echo "fresh_clone_check: $TOOLS has no nbval; run bash scripts/setup.sh --test first" >&2; exit 2; }
    cd "$work/clone"
    local start=$SECONDS status=0
    echo "== every notebook under nbval, in the fresh clone's .venv =="
    # Two notebooks at a time (a kernel each, one xdist worker per core), each notebook's cells in order on one worker.
    JUPYTER_PATH="$work/jupyter" "${locked[@]}" "$TOOLS" -m pytest -n 2 --dist loadfile "$@" --nbval \
        --nbval-kernel-name snn-fresh-clone --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks/ || status=$?
    echo "fresh_clone_check: notebooks $((SECONDS - start)) s"
    return $status
}

case $part in
    set-up) set_up ;;
    notebooks) notebooks "$@" ;;
    both) (set_up); notebooks "$@" ;;
esac
