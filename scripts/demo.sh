#!/usr/bin/env bash
# The main job end to end: a small model (../shared/models/base, or a tiny one built offline),
# converted to .cmf, verified, signed, inspected, and run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
exec .venv/bin/python examples/quickstart.py "$@"
