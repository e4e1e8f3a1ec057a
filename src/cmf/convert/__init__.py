"""Converters into and out of CMF: Hugging Face checkpoints in (``convert``), HF safetensors out
(``export``). GGUF import/export live in ``cmf.convert.gguf`` (separate module).

    plan = cmf.convert.plan("Qwen/Qwen3-0.6B", quant="q4tp")      # metadata only
    result = cmf.convert.convert("path/to/hf-folder", "model.cmf", quant="q8")
    cmf.convert.export("model.cmf", "out-folder", dtype="bf16")

No runtime imports: this package sits between the container/codecs and the tools.
"""

from __future__ import annotations

from typing import Any

from .errors import ConvertError

__all__ = ["ConvertError", "ConvertResult", "ExportResult", "Plan", "convert", "execute", "export", "plan"]


def __getattr__(name: str) -> Any:
    # Lazy: `import cmf.convert` stays cheap (no safetensors / numpy-heavy imports until used).
    if name in ("convert", "plan", "execute", "Plan", "ConvertResult"):
        from . import hf

        return getattr(hf, name)
    if name in ("export", "ExportResult"):
        from . import export as _export

        return getattr(_export, name)
    raise AttributeError(f"module 'cmf.convert' has no attribute {name!r}")
