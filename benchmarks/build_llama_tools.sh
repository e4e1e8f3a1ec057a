#!/usr/bin/env bash
# llama.cpp's llama-imatrix / llama-quantize / llama-perplexity / llama-bench, built from the llama.cpp sources
# vendored in llama-cpp-python's sdist (the Python binding ships the library, not these tools).
# Used by benchmarks/quality_real.py --llama-bin. About 15 minutes on 2 cores.
#   bash benchmarks/build_llama_tools.sh [WORK_DIR]   -> prints the bin folder
# LLAMA_CPU=avx2 builds llama-bench and llama-quantize without AVX-512 (GGML_NATIVE off, AVX2 +
# FMA + F16C only) into build-avx2/: the peer of pycmf compiled for haswell (issue 27,
# benchmarks/avx2_peer.py). About 8 minutes on 2 cores.
# LLAMA_CPU=avx512 builds the same two tools for AVX-512 (+ VNNI, VBMI, BF16) without AMX into
# build-avx512/: on a host whose CPU has AMX but whose VM does not grant the tile state,
# -march=native builds die with SIGILL in llama-bench (the Intel Xeon host of 2026-12-06).
# The same folder holds libllama.so: llama-cpp-python can load it instead of compiling its own copy
# (another ~10 minutes): `CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install WORK_DIR/llama_cpp_python-$VERSION.tar.gz`,
# then run with `LLAMA_CPP_LIB_PATH=<bin folder>` (how the 2026-12-04 quality run was made).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/pycmf/llama-tools}"
mkdir -p "$WORK"
cd "$WORK"
if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . >&2
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF)
if [ "${LLAMA_CPU:-native}" = "avx2" ]; then
  cmake -S "$SRC" -B "$SRC/build-avx2" "${COMMON[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
    -DGGML_AVX_VNNI=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF >&2
  cmake --build "$SRC/build-avx2" --target llama-bench llama-quantize -j"$(nproc)" >&2
  echo "$SRC/build-avx2/bin"
  exit 0
fi
if [ "${LLAMA_CPU:-native}" = "avx512" ]; then
  cmake -S "$SRC" -B "$SRC/build-avx512" "${COMMON[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
    -DGGML_BACKEND_DL=OFF >&2
  cmake --build "$SRC/build-avx512" --target llama-bench llama-quantize -j"$(nproc)" >&2
  echo "$SRC/build-avx512/bin"
  exit 0
fi
cmake -S "$SRC" -B "$SRC/build" "${COMMON[@]}" -DGGML_NATIVE=ON >&2
cmake --build "$SRC/build" --target llama-imatrix llama-quantize llama-perplexity llama-bench -j"$(nproc)" >&2
echo "$SRC/build/bin"
