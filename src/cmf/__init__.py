"""pycmf: CMF v2 model containers — reader, writer, quantization, conversion and runtime.

Public names are loaded lazily (PEP 562) so that ``cmf --help`` starts without numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _codecs():  # noqa: ANN202 - the cmf.quant module
    from . import quant

    return quant


# The container (cmf.format) decodes and encodes quantized tensors through cmf.hooks; the codecs
# that do it (cmf.quant) sit above it, so the wiring is done here, before any cmf module runs.
from . import hooks as _hooks  # noqa: E402 - after __version__, which the CLI reads first

_hooks.set_codec_provider(_codecs)

_LAZY = {
    "open": ("cmf.format.reader", "open"),
    "CmfFile": ("cmf.format.reader", "CmfFile"),
    "QTensor": ("cmf.format.reader", "QTensor"),
    "CmfError": ("cmf.format.errors", "CmfError"),
    "errors": ("cmf.format.errors", None),
    "hash64": ("cmf.format.hash64", "hash64"),
    "CmfWriter": ("cmf.format.writer", "CmfWriter"),
    "load": ("cmf.runtime.model", "load"),
    "Model": ("cmf.runtime.model", "Model"),
}

if TYPE_CHECKING:  # pragma: no cover
    from .format import errors
    from .format.errors import CmfError
    from .format.hash64 import hash64
    from .format.reader import CmfFile, QTensor, open
    from .format.writer import CmfWriter
    from .runtime.model import Model, load


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'cmf' has no attribute {name!r}") from None
    import importlib

    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["CmfError", "CmfFile", "CmfWriter", "Model", "QTensor", "errors", "hash64", "load", "open",
           "__version__"]
