"""The fused LinearOp families by dtype: one table, filled by the families themselves.

Each family module declares its class with :func:`family` — the dtypes it runs and nothing else.
This module imports no family (they import it): :mod:`.families` imports every family module and
is where lookups go (:func:`~cmf.kernels.families.family_for`). Adding a dtype at full speed
therefore touches its codec (``quant``), its kernel module (a
:class:`~cmf.kernels._base.FusedLinear` subclass decorated here) and, for a new module, the
import line of :mod:`.families`. Grouped and batched products ask the op itself
(``FusedLinear.group_family``) which compiled group kernel can take it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..format.constants import Dtype

if TYPE_CHECKING:
    from ._base import FusedLinear

_TABLE: dict[Dtype, type] = {}


def family(*dtypes: Dtype) -> Callable[[type], type]:
    """Class decorator: ``cls`` is the fused LinearOp for ``dtypes`` (each at most one family)."""
    def register(cls: type) -> type:
        for d in dtypes:
            other = _TABLE.get(d)
            if other is not None and other is not cls:
                raise ValueError(f"dtype {Dtype(d).label} already runs through {other.__name__}")
            _TABLE[Dtype(d)] = cls
        cls.DTYPES = tuple(Dtype(d) for d in dtypes)
        return cls
    return register


def family_for(dtype: Dtype, shape: tuple[int, ...]) -> "type[FusedLinear] | None":
    """The family class for a stored matrix among those registered so far, or None (no kernel
    for the dtype, or the family declines the shape: ``FusedLinear.accepts``)."""
    cls = _TABLE.get(Dtype(dtype))
    if cls is None or not cls.accepts(Dtype(dtype), shape):
        return None
    return cls


def registered() -> dict[Dtype, type]:
    """A copy of the table as registered so far (:mod:`.families`: all of them)."""
    return dict(_TABLE)


__all__ = ["family", "family_for", "registered"]
