#!/usr/bin/env bash
# The main job: install, then audit the built-in engines on every built-in tiny pair in float64.
# Writes reports/builtin/{audit.json,report.md,report.html}; exit 0 only when all are equivalent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec specaudit audit \
    --engine eqspec --engine exspec \
    --pair tiny-llama --pair tiny-qwen3 --pair tiny-glm4 --pair tiny-gpt2 --pair tiny-opt --pair tiny-gpt-neox \
    --batch-size 1 4 16 --dtype float64 --max-new-tokens 32 --draft-tokens 4 \
    --out "${OUT:-reports/builtin}" "$@"
