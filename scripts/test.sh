#!/usr/bin/env bash
# Set up a virtual environment from scratch (if missing) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
exec .venv/bin/python -m pytest -q "$@"
