"""Serving CMF files with vLLM (docs/SCALING.md).

``prepare(path)`` writes the config/tokenizer folder vLLM reads (no weights); with vLLM's
``load_format="cmf"`` the plugin's loader streams the tensors from the CMF file recorded in it.
vLLM may also be given the ``.cmf`` itself: the plugin calls ``prepare`` for it (:mod:`.direct`).
This package imports vLLM only inside :mod:`.loader`, which vLLM's plugin hook loads.
"""

from __future__ import annotations

from .errors import (CmfFileNotFound, IntegrityRefused, NotACmfFile, StaleFolder, UnsupportedSelection,
                     VllmPluginError)
from .materialize import cache_root, prepare, read_source
from .weights import LoaderOptions, check_integrity, iter_hf_weights

__all__ = ["CmfFileNotFound", "IntegrityRefused", "LoaderOptions", "NotACmfFile", "StaleFolder", "UnsupportedSelection", "VllmPluginError",
           "cache_root", "check_integrity", "iter_hf_weights", "prepare", "read_source"]
