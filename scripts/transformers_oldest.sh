#!/usr/bin/env bash
# transformers at the oldest version pyproject allows (what GPU images ship), in its own cached venv, for
# tests/test_transformers_oldest.py: the engines and the reference must be exact there as on the newest.
#
#   ${SPECAUDIT_CACHE:-~/.cache/specaudit}/transformers-<version>/bin/python
#
# The venv holds transformers and what it needs (about 300 MB: numpy, tokenizers, huggingface-hub, ...),
# not torch and not specaudit: the test runs the venv's python with the calling environment's
# site-packages appended (`site.addsitedir`), so torch and the checkout's editable specaudit come from
# there while the venv's transformers comes first. Only the first run installs (about 15 s); later runs
# find the marker file `.specaudit-complete`. Prints the venv's python on stdout as its last line.
# Environment: TRANSFORMERS_OLDEST (default 5.17.0), SPECAUDIT_CACHE, PYTHON (default python3).
set -euo pipefail
VERSION=${TRANSFORMERS_OLDEST:-5.17.0}
CACHE_ROOT=${SPECAUDIT_CACHE:-$HOME/.cache/specaudit}
VENV="$CACHE_ROOT/transformers-$VERSION"
MARKER="$VENV/.specaudit-complete"
PYTHON=${PYTHON:-python3}
source "$(dirname "$0")/venv_install.sh"  # uv with pip's sources where this environment has it, else pip

if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
mkdir -p "$CACHE_ROOT"
start=$(date +%s)
rm -rf "$VENV"
echo "transformers: installing transformers==$VERSION into $VENV" >&2
"$PYTHON" -m venv "$VENV"
venv_install "$VENV/bin/python" "transformers==$VERSION" >&2
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '$VERSION', transformers.__version__" >&2
echo "transformers==$VERSION; installed in $(( $(date +%s) - start )) s" >"$MARKER"
echo "transformers: installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
