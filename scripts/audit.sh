#!/usr/bin/env bash
# The main job: install, then audit EQSPEC and EXSPEC in float64 on a representative subset of the
# built-in tiny pairs: one per way of deriving positions (RoPE: tiny-llama; learned absolute:
# tiny-gpt2; derived from the attention mask: tiny-opt), ragged batches of 4 and 16 (--full adds
# batch size 1 and every other built-in pair).
#
#   bash scripts/audit.sh            # the subset, about 2 minutes on 2 cores
#   bash scripts/audit.sh --full     # every built-in pair
#   bash scripts/audit.sh ... --num-prompts 8    # anything after is passed to `specaudit audit`
#
# The report goes to out/audit/ (git ignores it; OUT=DIR chooses another folder): audit.json,
# report.md, report.html. Exit 0 only when every run is equivalent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pairs=(--pair tiny-llama --pair tiny-gpt2 --pair tiny-opt)
batch_sizes=(4 16)
if [ "${1:-}" = "--full" ]; then
    shift
    batch_sizes=(1 4 16)
    pairs=()
    for name in $("${PYTHON:-python3}" -c "from specaudit.engines.models.zoo import builtin_pair_names as n; print(*n())"); do
        pairs+=(--pair "$name")
    done
fi
exec specaudit audit --engine eqspec --engine exspec "${pairs[@]}" \
    --batch-size "${batch_sizes[@]}" --dtype float64 --max-new-tokens 32 --draft-tokens 4 \
    --out "${OUT:-out/audit}" "$@"
