#!/usr/bin/env bash
# What the sampled audit, `--device auto` and the diagnosis by observation do on a GPU, in one lease-sized call:
#
#   scripts/gpu_checks.sh [OUT]            # on a machine with an NVIDIA GPU: at most STEP_LIMIT seconds
#   scripts/gpu_checks.sh --dry-run [OUT]  # every step at toy size on the CPU: checks the script, shows nothing
#
# Run from a checkout with specaudit installed from it (`pip install -e .`; the observed engines live in tests/).
#
#   1. sampled: the sampled audit on CUDA in bfloat16 and in float64 (the fixed-shape engine, with captured
#      passes, and EQSPEC), and a planted sampler (the bonus token drawn from the draft) in bfloat16: a correct
#      engine passes below float64, the planted one is rejected.
#   2. device-auto: the greedy audit with `--device auto` (accelerate places the pair), bfloat16.
#   3. observed: the diagnosis by observation on engines run on CUDA (tests/observed_engines.py), float64 and
#      bfloat16: the hooks and replays on the GPU name the bugs as on the CPU.
#
# Each step has its own folder and a time limit (STEP_LIMIT seconds, default 150); steps.txt gives each step's
# exit status and seconds (rc=124: cut at its limit), commands.txt the commands, device.txt the device line.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
if [ $# -gt 1 ] || [[ "${1:-}" == -* ]]; then
    echo "usage: scripts/gpu_checks.sh [--dry-run] [OUT]   (--help says more)" >&2
    exit 2
fi
if [ $mode = dry ]; then
    device=cpu; device_name=cpu; out=${1:-/tmp/gpu-checks-dry-run}
    samples=40; observed_size=(--num-prompts 4 --max-new-tokens 8); greedy_size=(--num-prompts 2 --max-new-tokens 8)
else
    device_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) \
        || { echo "no CUDA device visible to torch (--dry-run checks the script on the CPU)" >&2; exit 2; }
    device=cuda
    slug=$(echo "$device_name" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
    out=${1:-reports/gpu-$slug/checks}
    # tiny models on a GPU are paced by kernel launches (~20 ms a pass, slower with the steps side by side)
    samples=400; observed_size=(--num-prompts 8 --max-new-tokens 12 --diagnosis-budget 45)
    greedy_size=(--num-prompts 8 --max-new-tokens 16)
fi
limit=${STEP_LIMIT:-150}
mkdir -p "$out"
: >"$out/commands.txt"
: >"$out/steps.txt"
{
    echo "device: $device_name"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/specaudit at /'
    date -u '+%Y-%m-%d %H:%M UTC'
} >"$out/device.txt"

step() {  # step NAME COMMAND...: run it under the limit, log to NAME.log, record its status and seconds
    local name=$1; shift
    echo "+ $*" >>"$out/commands.txt"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$out/steps.txt"
}

sampled=(--pair tiny-llama --temperature 0.7 --top-k 8 --samples "$samples" --max-new-tokens 4 --num-prompts 1
         --draft-tokens 2 --batch-size 8 --device "$device" --no-progress)
observed=(--engine observed_engines:holes_all_slots --engine observed_engines:loop_padded_positions
          --engine observed_engines:generate_all_ones --engine observed_engines:holes
          --pair tiny-gpt2 --batch-size 4 "${observed_size[@]}" --device "$device" --no-progress)

step sampled-bfloat16 specaudit audit --engine fixedshape --engine eqspec "${sampled[@]}" --dtype bfloat16 \
    --out "$out/sampled-bfloat16" &
step sampled-float64 specaudit audit --engine fixedshape --engine eqspec "${sampled[@]}" --dtype float64 \
    --out "$out/sampled-float64" &
step sampled-planted env PYTHONPATH=tests specaudit audit --engine sample_engines:make_sampled_bonus_from_draft \
    "${sampled[@]}" --dtype bfloat16 --out "$out/sampled-planted" &
step device-auto specaudit audit --engine eqspec --engine fixedshape --pair tiny-llama \
    --batch-size 8 "${greedy_size[@]}" --dtype bfloat16 --device auto --no-progress --out "$out/device-auto" &
step observed-float64 env PYTHONPATH=tests specaudit audit "${observed[@]}" --dtype float64 \
    --out "$out/observed-float64" &
step observed-bfloat16 env PYTHONPATH=tests specaudit audit "${observed[@]}" --dtype bfloat16 \
    --out "$out/observed-bfloat16" &
wait
echo "finished: $(date -u '+%H:%M:%S UTC')" >>"$out/device.txt"
