#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 first (so nothing pulls a CUDA build), then the package.
#   bash scripts/setup.sh          what the main job and every notebook need: torch, the package and its
#                                  dependencies, JupyterLab (the notebook extra) and spikingjelly
#   bash scripts/setup.sh --test   also the test extras, chromium for the browser test and .venv-docs for the docs test
# Re-running skips pip when neither pyproject.toml nor this script changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
target=main
[ "${1:-}" = "--test" ] && target=test
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.snn-setup-$target
digest=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    if [ $target = test ]; then
        .venv/bin/python -m pip install -q -e '.[notebook,test]'
    else
        .venv/bin/python -m pip install -q -e '.[notebook]'
    fi
    # spikingjelly (notebook 04, the spikingjelly tests) without its dependency list, which would
    # replace the CPU torch with a CUDA build; its core modules need only loguru, tqdm and h5py.
    .venv/bin/python -m pip install -q --no-deps spikingjelly==2.0.0
    .venv/bin/python -m pip install -q loguru tqdm h5py
    # Build matplotlib's font cache now, not inside a notebook cell under nbval.
    .venv/bin/python -c 'import matplotlib.pyplot' 2>/dev/null
    echo "$digest" > "$stamp"
fi
[ $target = test ] || exit 0
# The browser test drives Debian's chromium through Playwright (Playwright cannot download its own
# browser here); install it when missing (CI runs as root).
if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium \
        || echo "setup: could not install chromium (/usr/bin/chromium); tests/system/test_browser.py will fail" >&2
fi
# The docs site's test (tests/test_docs.py) builds with mkdocs in .venv-docs, a venv of the `docs` extra alone
# (no torch); scripts/docs.sh makes it, or remakes it when that extra changed.
bash scripts/docs.sh venv
