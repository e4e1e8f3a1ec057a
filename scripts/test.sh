#!/usr/bin/env bash
# Set up a virtual environment from scratch (if missing) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test,torch]'
exec .venv/bin/python -m pytest -q "$@"
