#!/usr/bin/env bash
# The tests of every private torch name snn_explorer uses (snn_explorer/compat.py), on the newest
# torch of compat.TESTED_TORCH, in a second venv .venv-torch2.14 (scripts/test.sh runs the whole
# suite on torch 2.13.0 in .venv). torch 2.14.1 is a CUDA build that also runs on the CPU; with its
# CUDA libraries it is ~3 GB to install (about 2.5 minutes from a local package index).
# With test paths as arguments, runs those instead.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_NEXT=2.14.1
VENV=.venv-torch2.14
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_NEXT"
"$VENV/bin/python" -m pip install -q -e '.[test]'
installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$installed" != "$TORCH_NEXT" ]; then
    echo "test_torch_next: $VENV has torch $installed, expected $TORCH_NEXT" >&2
    exit 1
fi
# compat's own tests (each guarded name on the code that uses it, and the error a torch without it
# gets), and StorageMeter (a TorchDispatchMode) against torch's MemTracker on every zoo model.
TESTS=(tests/unit/test_compat.py tests/ranks/test_compat_ranks.py
       tests/unit/test_estimate_meter.py::test_meter_peak_equals_memtracker
       tests/unit/test_estimate_meter.py::test_meter_releases_freed_storages)
[ "$#" -gt 0 ] && TESTS=("$@")
exec "$VENV/bin/python" -m pytest -n 0 -q -rfE "${TESTS[@]}"
