#!/usr/bin/env bash
# Install, then run every test (two processes). Headless Chromium (Debian package `chromium`)
# renders the HTML report in one test; it is installed here when missing and apt is usable.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "could not install chromium: the browser test will fail" >&2
fi
exec "${PYTHON:-python3}" -m pytest -n 2 -q "$@"
