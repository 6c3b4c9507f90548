#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 first (so nothing pulls a CUDA build), then the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
# spikingjelly without its dependency list (which would replace the CPU torch); its core modules need only these.
.venv/bin/python -m pip install -q --no-deps spikingjelly==2.0.0
.venv/bin/python -m pip install -q loguru tqdm h5py
# Build matplotlib's font cache now, not inside a notebook cell under nbval.
.venv/bin/python -c 'import matplotlib.pyplot' 2>/dev/null
# The browser test drives Debian's chromium through Playwright (Playwright cannot download its own
# browser here); install it when missing (CI runs as root).
if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium \
        || echo "setup: could not install chromium (/usr/bin/chromium); tests/test_browser.py will fail" >&2
fi
