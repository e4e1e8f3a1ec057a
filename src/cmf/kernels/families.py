"""Every fused LinearOp family, registered: importing this module imports each family module
(each declares its class in :mod:`.registry`), so the lookups below see the whole table. A new
family module is added to the import line here."""

from __future__ import annotations

from . import floats, q1, q8, tiled, vbit  # noqa: F401 - each registers its family on import
from .registry import family_for, registered

__all__ = ["family_for", "registered"]
