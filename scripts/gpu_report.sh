#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and specaudit installed: the measurements only a GPU can give, written to
# reports/gpu-<device>/ (or $1). Not yet run on a GPU: untimed.
#   1. the bench pair in bfloat16, B = 1 and 8, k = 4, acceptance 0.8: every engine under its own name,
#      the fixed-shape engine (fixedshape) with its passes captured as CUDA graphs, and again uncaptured
#      (--no-cuda-graphs, which only the fixed-shape engine reads)
#   2. the bfloat16 audit of EQSPEC, EXSPEC, INPLACE and fixedshape on the built-in dense pairs at B = 1, 8 and 16:
#      correct engines must get 0 structural divergences
#   3. the planted-fault hunts in float64 and bfloat16 on the GPU (SPECAUDIT_TEST_DEVICE=cuda): every fault
#      caught and named
# Each step writes its own folder, so a step that fails leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
device=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) \
    || { echo "no CUDA device visible to torch" >&2; exit 2; }
slug=$(echo "$device" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
out=${1:-reports/gpu-$slug}
mkdir -p "$out"
{
    echo "device: $device"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/specaudit at /'
} >"$out/device.txt"
cat "$out/device.txt"
status=0
bench() {  # $1: folder, then extra options
    local folder=$1; shift
    echo "+ specaudit bench ... $* --out $out/$folder" | tee -a "$out/commands.txt"
    specaudit bench "${engines[@]}" \
        --pair bench --batch-size 1 8 --draft-tokens 4 --acceptance 0.8 --num-prompts 32 --max-new-tokens 64 \
        --repeats 3 --warmup 1 --dtype bfloat16 --device cuda "$@" --out "$out/$folder" || status=1
}
engines=(--engine reference --engine batched --engine eqspec --engine exspec --engine inplace --engine fixedshape)
bench bench-cuda-graphs
engines=(--engine fixedshape)
bench bench-fixedshape-uncaptured --no-cuda-graphs
audit_command=(specaudit audit --engine eqspec --engine exspec --engine inplace --engine fixedshape --pair tiny-llama --pair tiny-qwen3
               --pair tiny-gpt2 --batch-size 1 8 16 --dtype bfloat16 --device cuda --max-new-tokens 32
               --out "$out/audit-bf16")
echo "+ ${audit_command[*]}" | tee -a "$out/commands.txt"
"${audit_command[@]}" || status=1
echo "+ SPECAUDIT_TEST_DEVICE=cuda python3 -m specaudit.testing.faults.table --out $out/faults.md" | tee -a "$out/commands.txt"
SPECAUDIT_TEST_DEVICE=cuda python3 -m specaudit.testing.faults.table --out "$out/faults.md" || status=1
exit $status
