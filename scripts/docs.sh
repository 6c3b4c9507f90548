#!/usr/bin/env bash
# Build the documentation site strictly (mkdocs.yml; warnings are errors) into site/, in .venv-docs.
# .venv-docs holds only the `docs` extra of pyproject.toml (made here when missing or when that list changed):
# the API pages read the package's source statically, so neither the package nor torch is installed there.
# Usage: bash scripts/docs.sh [build|serve|venv] [mkdocs options...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-docs
export NO_MKDOCS_2_WARNING=1
action="${1:-build}"
[ $# -gt 0 ] && shift
requirements=$(python3 - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))
PY
)
stamp="$VENV/.docs-extra"
if [ ! -x "$VENV/bin/mkdocs" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]; then
    echo "== making $VENV from the docs extra of pyproject.toml =="
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet $(echo "$requirements" | sed "s/.*/'&'/" | xargs)
    printf '%s' "$requirements" > "$stamp"
fi
case "$action" in
    venv) ;;
    build) "$VENV/bin/mkdocs" build --strict "$@" ;;
    serve) "$VENV/bin/mkdocs" serve --strict "$@" ;;
    *) echo "usage: bash scripts/docs.sh [build|serve|venv] [mkdocs options...]" >&2; exit 2 ;;
esac
