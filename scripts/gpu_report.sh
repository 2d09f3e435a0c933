#!/usr/bin/env bash
# The measurements only a GPU can give, written to reports/gpu-<device>/ (or OUT):
#
#   scripts/gpu_report.sh [OUT]            # on a machine with an NVIDIA GPU, specaudit installed from this checkout
#   scripts/gpu_report.sh --dry-run [OUT]  # every step at toy size on the CPU: checks the script, measures nothing
#
#   1. bench (timed, nothing else running): the bench pair in bfloat16, B = 1 and 8, k = 4, acceptance 0.8,
#      every engine under its own name beside the reference and `batched`; then the fixed-shape engine
#      (fixedshape) with its passes captured as CUDA graphs, and again eagerly (--no-cuda-graphs). The
#      fixed-shape engine runs in processes of its own, so a capture that hangs cannot take the others' numbers.
#   2. audits (side by side, one process per engine and dtype): float64 (every engine exact) and bfloat16
#      (correct engines: 0 structural divergences) on the built-in dense pairs at B = 1 and 8, adversarial
#      prompts included.
#   3. faults (beside the audits): the planted-fault hunts in float64 and bfloat16 on the GPU
#      (SPECAUDIT_TEST_DEVICE=cuda): every test passes when every fault is caught and named.
#
# Each step has a time limit (seconds: BENCH_LIMIT, FIXEDSHAPE_LIMIT, AUDIT_LIMIT; a step past it is interrupted and keeps what it
# finished) and its own folder, so a step that fails leaves the others' results. steps.txt gives each step's exit
# status and seconds; commands.txt the commands.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ $dry = 1 ]; then
    device_name=cpu
    device=cpu
    out=${1:-/tmp/gpu-report-dry-run}
    bench_size=(--pair tiny-llama --num-prompts 2 --max-new-tokens 8 --repeats 1 --warmup 0 --batch-size 1 2)
    audit_size=(--pair tiny-llama --batch-size 2 --num-prompts 2 --max-new-tokens 8 --no-adversarial)
    fault_filter="planted_fault and bonus_token_dropped and not bfloat16"
else
    device_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) \
        || { echo "no CUDA device visible to torch (use --dry-run to check the script on the CPU)" >&2; exit 2; }
    device=cuda
    slug=$(echo "$device_name" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
    out=${1:-reports/gpu-$slug}
    bench_size=(--pair bench --batch-size 1 8 --num-prompts 32 --max-new-tokens 64 --repeats 3 --warmup 1)
    audit_size=(--pair tiny-llama --pair tiny-qwen3 --pair tiny-gpt2 --batch-size 1 8 --max-new-tokens 32)
    fault_filter="planted_fault"
fi
bench_limit=${BENCH_LIMIT:-600}
fixedshape_limit=${FIXEDSHAPE_LIMIT:-$bench_limit}
audit_limit=${AUDIT_LIMIT:-900}
mkdir -p "$out"
: >"$out/commands.txt"
: >"$out/steps.txt"
{
    echo "device: $device_name"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/specaudit at /'
    date -u +"%Y-%m-%d %H:%M UTC"
} >"$out/device.txt"
cat "$out/device.txt"

step() {  # $1: step name, $2: time limit (s), then the command; SIGINT at the limit (the command keeps what it finished)
    local name=$1 limit=$2; shift 2
    echo "+ $*" >>"$out/commands.txt"
    local started=$SECONDS
    timeout -s INT -k 30 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started))$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$out/steps.txt"
    return $rc
}
status=0
engines=(--engine reference --engine batched --engine eqspec --engine exspec --engine inplace)
common=(--draft-tokens 4 --acceptance 0.8 --dtype bfloat16 --device "$device")
step bench "$bench_limit" specaudit bench "${engines[@]}" "${bench_size[@]}" "${common[@]}" --out "$out/bench" || status=1
step bench-fixedshape "$fixedshape_limit" specaudit bench --engine fixedshape "${bench_size[@]}" "${common[@]}" \
    --out "$out/bench-fixedshape" || status=1
step bench-fixedshape-eager "$fixedshape_limit" specaudit bench --engine fixedshape --no-cuda-graphs "${bench_size[@]}" \
    "${common[@]}" --out "$out/bench-fixedshape-eager" || status=1

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # 11 processes side by side
pids=()
for dtype in float64 bfloat16; do
    for engine in batched eqspec exspec inplace fixedshape; do
        step "audit-$dtype-$engine" "$audit_limit" specaudit audit --engine "$engine" "${audit_size[@]}" \
            --dtype "$dtype" --device "$device" --no-progress --out "$out/audit-$dtype/$engine" &
        pids+=($!)
    done
done
step faults "$audit_limit" env SPECAUDIT_TEST_DEVICE="$device" python3 -m pytest -p no:cacheprovider \
    tests/property/test_faults.py -v -k "$fault_filter" -n "$([ $dry = 1 ] && echo 0 || echo 6)" \
    --junitxml="$out/faults.xml" &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
echo "wrote $out (steps.txt: each step's exit status)"
exit $status
