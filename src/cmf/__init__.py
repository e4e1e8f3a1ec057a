"""pycmf: CMF v2 model containers — reader, writer, quantization, conversion and runtime."""

from __future__ import annotations

__version__ = "0.1.0"

from .format import errors
from .format.errors import CmfError
from .format.hash64 import hash64
from .format.reader import CmfFile, QTensor
from .format.reader import open as open  # noqa: A004 - `cmf.open(path)` is the public contract
from .format.writer import CmfWriter

__all__ = ["CmfError", "CmfFile", "CmfWriter", "QTensor", "errors", "hash64", "open", "__version__"]
