"""Converters into and out of CMF: Hugging Face checkpoints in (``convert``), HF safetensors out
(``export``). GGUF import/export live in ``cmf.convert.gguf`` (separate module).

    plan = cmf.convert.plan("Qwen/Qwen3-0.6B", quant="q4tp")      # metadata only
    result = cmf.convert.convert("path/to/hf-folder", "model.cmf", quant="q8")
    cmf.convert.export("model.cmf", "out-folder", dtype="bf16")

No runtime imports: this package sits between the container/codecs and the tools. (The name
``export`` is the function; the module behind it is ``sys.modules["cmf.convert.export"]``.)
"""

from __future__ import annotations

from .errors import ConvertError
from .export import ExportResult, export
from .hf import ConvertResult, Plan, convert, execute, plan

__all__ = ["ConvertError", "ConvertResult", "ExportResult", "Plan", "convert", "execute", "export", "plan"]
