#!/usr/bin/env bash
# Create .venv-bench for the benchmarks that run peers in the same process tree: pycmf (editable, with
# its torch/test extras) plus llama-cpp-python built from source for this CPU (about 5 minutes on 2
# cores). The test suite never needs it; benchmarks/*.py say "not run" for a peer that is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-bench/bin/python ]; then
  "$PY" -m venv .venv-bench
fi
.venv-bench/bin/python -m pip install -q --upgrade pip >/dev/null
.venv-bench/bin/python -m pip install -q -e '.[test,torch]' accelerate
if ! .venv-bench/bin/python -c 'import llama_cpp' 2>/dev/null; then
  # GGML_NATIVE: the same instruction set pycmf's kernels get from numba (set CMAKE_ARGS to override).
  # A CPU that lists AMX gets the native set spelled out without AMX: on the 2026-12-05 Intel Xeon
  # host (amx_tile/amx_int8 in /proc/cpuinfo) the native build's AMX kernels died with SIGILL on the
  # first request (the process may not use the tile state there); pycmf does not use AMX either.
  DEFAULT_ARGS="-DGGML_NATIVE=ON"
  if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then
    DEFAULT_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
    DEFAULT_ARGS+=" -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
    DEFAULT_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  # --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS
  CMAKE_ARGS=${CMAKE_ARGS:-$DEFAULT_ARGS} .venv-bench/bin/python -m pip install -q --no-cache-dir 'llama-cpp-python[server]'
fi
.venv-bench/bin/python -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
