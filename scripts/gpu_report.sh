#!/usr/bin/env bash
# The measurements only a GPU can give, written to reports/gpu-<device>/ (or OUT):
#
#   scripts/gpu_report.sh [OUT]            # sized for a 15-minute lease: about 8 minutes on an H200
#   scripts/gpu_report.sh --full [OUT]     # the whole workload: far longer (reports/gpu-h200/README.md)
#   scripts/gpu_report.sh --dry-run [OUT]  # every step at toy size on the CPU: checks the script, measures nothing
#
# On a machine with an NVIDIA GPU and specaudit installed from this checkout (`pip install -e .`; the fault
# hunts import the planted faults, which only the checkout holds).
#
#   1. bench (timed, nothing else running): the bench pair in bfloat16, B = 1 and 8, k = 4, acceptance 0.8,
#      every engine under its own name beside the reference and `batched`, the fixed-shape engine (fixedshape)
#      with its passes captured as CUDA graphs; then the fixed-shape engine alone with eager passes
#      (--no-cuda-graphs).
#   2. audits (side by side, one process per engine and dtype): float64 (every engine exact) on the built-in
#      dense pairs at B = 1 and 8; bfloat16 (correct engines: 0 structural divergences) at B = 8 (--full: the
#      float64 set); adversarial prompts included.
#   3. faults (beside the audits): the planted-fault hunts on the GPU (SPECAUDIT_TEST_DEVICE=cuda) in float64
#      (--full: and bfloat16): every test passes when every fault is caught and named.
#
# Measured on the H200 (reports/gpu-h200/): an eager pass of the bench pair's target costs ~20 ms there
# (host-bound), so the full workload's bench alone outlasts a lease. Each step has a time limit (seconds:
# BENCH_LIMIT, EAGER_BENCH_LIMIT, AUDIT_LIMIT; a lease's add up to ~10 minutes); a step past it is interrupted
# and keeps what it finished. Each step has its own folder, so a step that fails or is cut leaves the others'
# results. steps.txt gives each step's exit status and seconds
# (rc=124: cut at its limit); commands.txt the commands; device.txt the device line; summary.md the goals
# beside what was measured and every audit's and hunt's outcome (scripts/gpu_summary.py).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=lease
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --full) mode=full; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
if [ $# -gt 1 ] || [[ "${1:-}" == -* ]]; then
    echo "usage: scripts/gpu_report.sh [--full | --dry-run] [OUT]   (--help says more)" >&2
    exit 2
fi
dense_pairs=(--pair tiny-llama --pair tiny-qwen3 --pair tiny-gpt2)
case $mode in
    dry)
        device_name=cpu; device=cpu
        out=${1:-/tmp/gpu-report-dry-run}
        bench_size=(--pair tiny-llama --num-prompts 2 --max-new-tokens 8 --repeats 1 --warmup 0 --batch-size 1 2)
        float64_size=(--pair tiny-llama --batch-size 2 --num-prompts 2 --max-new-tokens 8 --no-adversarial)
        bfloat16_size=("${float64_size[@]}")
        fault_filter="planted_fault_is_caught and bonus_token_dropped and not bfloat16"
        workers=0 ;;
    lease|full)
        device_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) \
            || { echo "no CUDA device visible to torch (--dry-run checks the script on the CPU)" >&2; exit 2; }
        device=cuda
        slug=$(echo "$device_name" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
        out=${1:-reports/gpu-$slug}
        workers=6
        float64_size=("${dense_pairs[@]}" --batch-size 1 8 --max-new-tokens 32)
        if [ $mode = full ]; then
            bench_size=(--pair bench --batch-size 1 8 --num-prompts 32 --max-new-tokens 64 --repeats 3 --warmup 1)
            bfloat16_size=("${float64_size[@]}")
            fault_filter="planted_fault"
        else
            bench_size=(--pair bench --batch-size 1 8 --num-prompts 8 --max-new-tokens 32 --repeats 3 --warmup 1)
            bfloat16_size=(--pair tiny-llama --pair tiny-gpt2 --batch-size 8 --max-new-tokens 32)
            fault_filter="planted_fault_is_caught and not bfloat16"
        fi ;;
esac
if [ $mode = full ]; then limits=(3600 3600 3600); else limits=(240 90 240); fi  # at most ~10 minutes a lease
bench_limit=${BENCH_LIMIT:-${limits[0]}}
eager_limit=${EAGER_BENCH_LIMIT:-${limits[1]}}
audit_limit=${AUDIT_LIMIT:-${limits[2]}}
mkdir -p "$out"
: >"$out/commands.txt"
: >"$out/steps.txt"
{
    echo "device: $device_name"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/specaudit at /'
    echo "mode: $mode"
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
common=(--draft-tokens 4 --acceptance 0.8 --dtype bfloat16 --device "$device")
step bench "$bench_limit" specaudit bench --engine reference --engine batched --engine eqspec --engine exspec \
    --engine inplace --engine fixedshape "${bench_size[@]}" "${common[@]}" --out "$out/bench" || status=1
step bench-fixedshape-eager "$eager_limit" specaudit bench --engine fixedshape --no-cuda-graphs "${bench_size[@]}" \
    "${common[@]}" --out "$out/bench-fixedshape-eager" || status=1

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # 11 processes side by side
pids=()
for engine in batched eqspec exspec inplace fixedshape; do
    step "audit-float64-$engine" "$audit_limit" specaudit audit --engine "$engine" "${float64_size[@]}" \
        --dtype float64 --device "$device" --no-progress --out "$out/audit-float64/$engine" &
    pids+=($!)
    step "audit-bfloat16-$engine" "$audit_limit" specaudit audit --engine "$engine" "${bfloat16_size[@]}" \
        --dtype bfloat16 --device "$device" --no-progress --out "$out/audit-bfloat16/$engine" &
    pids+=($!)
done
step faults "$audit_limit" env SPECAUDIT_TEST_DEVICE="$device" python3 -m pytest -p no:cacheprovider -v \
    tests/property/test_faults.py -k "$fault_filter" -n "$workers" --junitxml="$out/faults.xml" &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
python3 scripts/gpu_summary.py "$out" >/dev/null || status=1
echo "wrote $out (summary.md: the goals beside what was measured; steps.txt: each step's exit status)"
exit $status
