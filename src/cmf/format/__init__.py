"""The CMF v2 container: reader, writer, integrity. No model knowledge lives here."""

from .constants import Dtype, Feature
from .errors import *  # noqa: F401,F403 - the error hierarchy is part of the public surface
from .errors import CmfError
from .hash64 import hash64, hash64_hex
from .reader import CmfFile, QTensor, open
from .writer import CmfWriter, write_file
from .growth import append, compact

__all__ = ["CmfError", "CmfFile", "CmfWriter", "Dtype", "Feature", "QTensor", "append", "compact",
           "hash64", "hash64_hex", "open", "write_file"]
