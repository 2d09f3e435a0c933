#!/usr/bin/env bash
# llama.cpp for the end-to-end test and docs/llamacpp.md: a `llama-server` and llama.cpp's HF-to-GGUF
# converter (`convert_hf_to_gguf.py` + `conversion/` + `gguf-py`), cached in one directory:
#
#   $SPECAUDIT_CACHE/llama.cpp/<name>/bin/llama-server
#   $SPECAUDIT_CACHE/llama.cpp/<name>/convert_hf_to_gguf.py, conversion/, gguf-py/
#
# Two ways to get the server (SPECAUDIT_LLAMACPP):
#   prebuilt (default)  PyPI's `xllamacpp` wheel, which ships llama.cpp's C++ server compiled: installed
#                       into its own venv in the cache; bin/llama-server runs scripts/xllamacpp_server.py
#                       there, which takes llama-server's flags. Nothing is compiled. <name> is
#                       xllamacpp-<version>.
#   source              built with cmake from the llama.cpp source that the PyPI sdist of
#                       llama-cpp-python vendors (7 to 26 minutes on two shared cores). <name> is
#                       the llama-cpp-python version.
# Both take the converter from that sdist (downloaded and unpacked, never compiled). Only the first
# run fetches or builds; later runs find the cache. Prints the cache directory on stdout as its last line.
#
# Environment: SPECAUDIT_LLAMACPP (prebuilt|source), XLLAMACPP_VERSION (default 2026.10.11549, which
# ships llama.cpp b11549), LLAMA_CPP_PYTHON_VERSION (default 0.3.36, which vendors llama.cpp 0c1e570),
# SPECAUDIT_CACHE (default ~/.cache/specaudit), BUILD_JOBS (default 2), PYTHON (default python3).
set -euo pipefail
MODE=${SPECAUDIT_LLAMACPP:-prebuilt}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
XLLAMACPP_VERSION=${XLLAMACPP_VERSION:-2026.10.11549}
CACHE_ROOT=${SPECAUDIT_CACHE:-$HOME/.cache/specaudit}
JOBS=${BUILD_JOBS:-2}
PYTHON=${PYTHON:-python3}
LAUNCHER="$(cd "$(dirname "$0")" && pwd)/xllamacpp_server.py"

case "$MODE" in
    prebuilt) DEST="$CACHE_ROOT/llama.cpp/xllamacpp-$XLLAMACPP_VERSION" ;;
    source) DEST="$CACHE_ROOT/llama.cpp/$VERSION" ;;
    *) echo "llama.cpp: SPECAUDIT_LLAMACPP must be 'prebuilt' or 'source', not '$MODE'" >&2; exit 2 ;;
esac

converter_ok() { [ -f "$1/convert_hf_to_gguf.py" ] && [ -d "$1/gguf-py" ]; }

if [ -x "$DEST/bin/llama-server" ] && converter_ok "$DEST"; then
    # the launcher is copied into the cache: refresh it when the repository's copy changed
    if [ "$MODE" = prebuilt ] && ! cmp -s "$LAUNCHER" "$DEST/xllamacpp_server.py"; then
        cp "$LAUNCHER" "$DEST/xllamacpp_server.py"
    fi
    echo "$DEST"
    exit 0
fi

mkdir -p "$CACHE_ROOT/llama.cpp"
work=$(mktemp -d "$CACHE_ROOT/llama.cpp/fetch-$MODE.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
stage="$work/stage"
mkdir -p "$stage/bin"

# 1. the llama-cpp-python sdist: its vendored llama.cpp has the converter (and the source for MODE=source)
# (--no-binary for this one package only: with ':all:' pip also builds the sdist's build requirements
# from source to read its metadata, which ran over 20 minutes with no pip cache and never finished)
echo "llama.cpp: fetching the llama-cpp-python==$VERSION sdist (76 MB) for the converter" >&2
"$PYTHON" -m pip download -qq --disable-pip-version-check --no-binary llama-cpp-python --no-deps \
    "llama-cpp-python==$VERSION" -d "$work/sdist" >&2
tar -xzf "$work"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/convert_hf_to_gguf.py" ] || { echo "llama.cpp: no vendor/llama.cpp in the sdist" >&2; exit 1; }
cp "$src/convert_hf_to_gguf.py" "$stage/"
cp -r "$src/gguf-py" "$stage/gguf-py"
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$stage/conversion"

# 2. the server
if [ "$MODE" = prebuilt ]; then
    echo "llama.cpp: installing xllamacpp==$XLLAMACPP_VERSION (prebuilt llama.cpp server) into its own venv" >&2
    # moved with the stage below: only its bin/python is run, which finds its site-packages through
    # the pyvenv.cfg beside it wherever the venv lies (moving breaks console-script shebangs only)
    "$PYTHON" -m venv "$stage/venv"
    "$stage/venv/bin/python" -m pip install -qq --disable-pip-version-check "xllamacpp==$XLLAMACPP_VERSION" >&2
    cp "$LAUNCHER" "$stage/xllamacpp_server.py"
    cat >"$stage/bin/llama-server" <<'WRAPPER'
#!/usr/bin/env bash
# llama.cpp's server from the xllamacpp wheel, with llama-server's flags (see xllamacpp_server.py)
here="$(cd "$(dirname "$0")/.." && pwd)"
exec "$here/venv/bin/python" "$here/xllamacpp_server.py" "$@"
WRAPPER
    chmod +x "$stage/bin/llama-server"
    echo "xllamacpp==$XLLAMACPP_VERSION (llama.cpp b${XLLAMACPP_VERSION##*.}); converter from llama-cpp-python==$VERSION" \
        >"$stage/BUILD_INFO"
else
    if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            echo "llama.cpp: installing cmake and g++ (Debian packages)" >&2
            apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make >&2
        else
            echo "llama.cpp: the build needs cmake and a C++ compiler (g++)" >&2
            exit 1
        fi
    fi
    echo "llama.cpp: building llama-server with $JOBS jobs (7 to 26 minutes on two shared cores)" >&2
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF >&2
    cmake --build "$work/build" --config Release --target llama-server -j "$JOBS" >&2
    cp "$work/build/bin/llama-server" "$stage/bin/"
    echo "llama-cpp-python==$VERSION; built in $(( $(date +%s) - start )) s on $(nproc) cores with -j$JOBS" \
        >"$stage/BUILD_INFO"
fi

# 3. rename the stage into place, so that an interrupted run never leaves a half-filled cache behind
rm -rf "$DEST"
mv "$stage" "$DEST"
echo "llama.cpp ($MODE): ready in $(( $(date +%s) - start )) s" >&2
echo "$DEST"
