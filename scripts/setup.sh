#!/usr/bin/env bash
# Install specaudit (editable, with its `test` extra) and the newest versions of what it needs that pyproject.toml allows.
# An installed torch is kept (pinned by a constraint, so nothing replaces the build); with none,
# torch 2.13.0 is installed first.
# uv does the installs (fetched with pip, it resolves in seconds where pip reads every large index page for half
# a minute), given the indexes, find-links and constraints of pip's own configuration (scripts/uv_args.py);
# pip does them where uv cannot be had or fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --quiet --root-user-action=ignore --disable-pip-version-check "$@"; }
uv_options=()
uv_env=()
if pip_install uv >/dev/null 2>&1 && "$PYTHON" -m uv --version >/dev/null 2>&1; then
    while IFS= read -r line; do
        case $line in
            SSL_CERT_FILE=*) uv_env+=("$line") ;;
            *) uv_options+=("$line") ;;
        esac
    done < <("$PYTHON" scripts/uv_args.py)
fi
uv_install() {  # uv_install ARGS...: `uv pip install ARGS...` with pip's sources; fails where uv is missing
    [ ${#uv_options[@]} -gt 0 ] || return 1
    env "${uv_env[@]}" "$PYTHON" -m uv pip install --quiet --python "$PYTHON" "${uv_options[@]}" "$@" \
        || { echo "uv could not install $*: pip does" >&2; return 1; }
}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    uv_install torch==2.13.0 || pip_install torch==2.13.0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PYTHON" -c "import torch; print('torch==' + torch.__version__)" >"$constraints"
# uv's --upgrade upgrades every requirement, as pip's eager strategy does
uv_install --upgrade --constraint "$constraints" -e ".[test]" \
    || pip_install --upgrade --upgrade-strategy eager --constraint "$constraints" -e ".[test]"
