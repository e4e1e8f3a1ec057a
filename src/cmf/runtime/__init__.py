"""The CPU runtime: run models straight from the mapped file.

``Model``, ``load`` and ``ContextOverflow`` load lazily (PEP 562): tools that only need a light
submodule (``cmf info`` reads ``runtime.features``) do not import numba and the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .model import ContextOverflow, Model, load

__all__ = ["ContextOverflow", "Model", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'cmf.runtime' has no attribute {name!r}")
