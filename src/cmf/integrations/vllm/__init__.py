"""Serving CMF files with vLLM (docs/SCALING.md).

``prepare(path)`` writes the config/tokenizer folder vLLM reads (no weights); with vLLM's
``load_format="cmf"`` the plugin's loader streams the tensors from the CMF file recorded in it.
This package imports vLLM only inside :mod:`.loader`, which vLLM's plugin hook loads.
"""

from __future__ import annotations

from .errors import IntegrityRefused, StaleFolder, UnsupportedSelection, VllmPluginError
from .materialize import cache_root, prepare, read_source
from .weights import LoaderOptions, check_integrity, iter_hf_weights

__all__ = ["IntegrityRefused", "LoaderOptions", "StaleFolder", "UnsupportedSelection", "VllmPluginError",
           "cache_root", "check_integrity", "iter_hf_weights", "prepare", "read_source"]
