#!/usr/bin/env bash
# Install specaudit (editable, with its `test` extra) and the newest versions of what it needs that pyproject.toml allows.
# An installed torch is kept (pinned by a constraint, so nothing replaces the build); with none,
# torch 2.13.0 is installed first. uv (installed here with pip) does the installs with pip's configured sources,
# pip where uv fails (scripts/venv_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
source scripts/venv_install.sh
"$PYTHON" -m pip install --quiet uv >/dev/null 2>&1 || echo "could not install uv: pip installs" >&2
# torch is looked up by its installed metadata, never imported: importing it before numpy is installed
# prints a warning, and costs seconds
installed_torch() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null; }
if ! installed_torch >/dev/null; then
    venv_install "$PYTHON" torch==2.13.0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$(installed_torch)" >"$constraints"
# uv's --upgrade upgrades every requirement, as pip's eager strategy does
PIP_UPGRADE_STRATEGY=eager venv_install "$PYTHON" --upgrade --constraint "$constraints" -e ".[test]"
