#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release, no UI, no network features) from the llama.cpp
# source that the PyPI sdist of llama-cpp-python vendors, and cache it with the converter
# (`convert_hf_to_gguf.py` + `gguf-py`) that the end-to-end test uses:
#
#   ~/.cache/specaudit/llama.cpp/<version>/bin/llama-server
#   ~/.cache/specaudit/llama.cpp/<version>/convert_hf_to_gguf.py
#   ~/.cache/specaudit/llama.cpp/<version>/gguf-py/
#
# Only the first run builds (11 to 26 minutes on two shared cores); later runs find the cache and
# print its path. Prints the cache directory on stdout as its last line.
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36, which vendors llama.cpp 0c1e570),
# SPECAUDIT_CACHE (default ~/.cache/specaudit), BUILD_JOBS (default 2), PYTHON (default python3).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE_ROOT=${SPECAUDIT_CACHE:-$HOME/.cache/specaudit}
DEST="$CACHE_ROOT/llama.cpp/$VERSION"
JOBS=${BUILD_JOBS:-2}
PYTHON=${PYTHON:-python3}

if [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/convert_hf_to_gguf.py" ] && [ -d "$DEST/gguf-py" ]; then
    echo "$DEST"
    exit 0
fi

if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "llama.cpp: installing cmake and g++ (Debian packages)" >&2
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make >&2
    else
        echo "llama.cpp: the build needs cmake and a C++ compiler (g++)" >&2
        exit 1
    fi
fi

mkdir -p "$CACHE_ROOT/llama.cpp"
work=$(mktemp -d "$CACHE_ROOT/llama.cpp/build-$VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

echo "llama.cpp: fetching the llama-cpp-python==$VERSION sdist" >&2
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
    "llama-cpp-python==$VERSION" -d "$work/sdist" >&2
tar -xzf "$work"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "llama.cpp: no vendor/llama.cpp in the sdist" >&2; exit 1; }

echo "llama.cpp: building llama-server with $JOBS jobs (11 to 26 minutes on two shared cores)" >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF >&2
cmake --build "$work/build" --config Release --target llama-server -j "$JOBS" >&2

# Install into a sibling directory, then rename it into place, so that an interrupted run never
# leaves a half-filled cache behind.
stage="$work/stage"
mkdir -p "$stage/bin"
cp "$work/build/bin/llama-server" "$stage/bin/"
cp "$src/convert_hf_to_gguf.py" "$stage/"
cp -r "$src/gguf-py" "$stage/gguf-py"
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$stage/conversion"
echo "llama-cpp-python==$VERSION; built in $(( $(date +%s) - start )) s on $(nproc) cores with -j$JOBS" \
    >"$stage/BUILD_INFO"
rm -rf "$DEST"
mv "$stage" "$DEST"
echo "llama.cpp: built in $(( $(date +%s) - start )) s" >&2
echo "$DEST"
