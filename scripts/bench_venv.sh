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
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON"} .venv-bench/bin/python -m pip install -q 'llama-cpp-python[server]'
fi
.venv-bench/bin/python -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
