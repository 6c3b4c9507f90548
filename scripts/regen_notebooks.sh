#!/usr/bin/env bash
# Re-execute the example notebooks in place with the venv's kernel, so their committed outputs
# are what `pytest --nbval` compares against. Usage: bash scripts/regen_notebooks.sh [notebook ...]
set -euo pipefail
cd "$(dirname "$0")/.."
# Step times in the notebooks are predicted on a datasheet profile, so that their outputs do not
# depend on this machine's calibration (estimate() without hardware= would calibrate it).
export SNN_EXPLORER_HARDWARE="${SNN_EXPLORER_HARDWARE:-A100-SXM-80GB}"
[ -x .venv/bin/python ] || bash scripts/setup.sh
# The notebooks' kernelspec is "python3": make it the venv's interpreter for this run.
KERNELS=$(mktemp -d)
trap 'rm -rf "$KERNELS"' EXIT
.venv/bin/python -m ipykernel install --prefix "$KERNELS" --name python3 --display-name "Python 3 (ipykernel)" >/dev/null
export JUPYTER_PATH="$KERNELS/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
export PYTHONHASHSEED=0
if [ "$#" -eq 0 ]; then
    set -- notebooks/[0-9][0-9]_*.ipynb
fi
for nb in "$@"; do
    echo "executing $nb"
    .venv/bin/jupyter execute --inplace --timeout=600 "$nb"
done
