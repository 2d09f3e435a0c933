#!/usr/bin/env bash
# Install specaudit (editable) and what it needs. An installed torch is kept; with none,
# torch 2.13.0 is installed first, so no dependency pulls a different build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --root-user-action=ignore torch==2.13.0
fi
"$PYTHON" -m pip install --quiet --root-user-action=ignore --disable-pip-version-check -e .
