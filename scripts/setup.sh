#!/usr/bin/env bash
# Install specaudit (editable, with its `test` extra) and the newest versions of what it needs that pyproject.toml allows.
# An installed torch is kept (pinned by a constraint, so nothing replaces the build); with none,
# torch 2.13.0 is installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --quiet --root-user-action=ignore --disable-pip-version-check "$@"; }
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    pip_install torch==2.13.0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PYTHON" -c "import torch; print('torch==' + torch.__version__)" >"$constraints"
pip_install --upgrade --upgrade-strategy eager --constraint "$constraints" -e ".[test]"
