"""A product's arguments bound once into one compiled object, so a token step's call unboxes one
value instead of dozens of arrays.

numba's dispatcher converts every argument of every call from Python: a 4-bit group product
takes ~40 arrays (each matrix's arrays padded to three slots), and converting them cost ~3.7 µs a
call whatever the product's size — for SmolLM2-135M, 120 products a token, ~8% of a decode step
(docs/PERFORMANCE.md, "Binding a product's arguments"). A token step's products see the same
arrays every time (the layer's buffers, the matrices), so :func:`prebind` stores the argument
tuple once in a numba structref and returns :func:`run_bound`, which takes that one value and
calls the same compiled driver with the same arguments: the same code on the same memory, the
same results. The structref keeps its arrays alive and writes go to the caller's buffers.

Each driver has its own structref type (``driver`` names it), so compiled code that holds a
bound product — :func:`run_bound`, or a whole layer (``runtime/layer_step.py``) — calls it
through :func:`run` and numba picks the driver at compile time. Adding a group kernel: one class
below per driver, its entry in ``_KINDS`` and a constructor at the same place in ``_NEW``.
"""

from __future__ import annotations

from typing import Any

import numba
from numba.core import types
from numba.experimental import structref
from numba.extending import overload

from . import q8i
from ._jit import SERIAL
from .gemv import (q1_group, q1_group_serial, rows_group, rows_group_serial, tiled_group, tiled_group_serial,
                   vbit_group, vbit_group_serial)


class _BoundType(types.StructRef):
    """A bound product's numba type: one field, ``args``; ``driver`` is what :func:`run` calls."""

    driver: Any = None


@structref.register
class TiledBound(_BoundType):
    driver = tiled_group


@structref.register
class TiledSerialBound(_BoundType):
    driver = tiled_group_serial


@structref.register
class RowsBound(_BoundType):
    driver = rows_group


@structref.register
class RowsSerialBound(_BoundType):
    driver = rows_group_serial


@structref.register
class VbitBound(_BoundType):
    driver = vbit_group


@structref.register
class VbitSerialBound(_BoundType):
    driver = vbit_group_serial


@structref.register
class Q1Bound(_BoundType):
    driver = q1_group


@structref.register
class Q1SerialBound(_BoundType):
    driver = q1_group_serial


@structref.register
class Q8iBound(_BoundType):
    driver = q8i.group_par


@structref.register
class Q8iSerialBound(_BoundType):
    driver = q8i.group_serial


_KINDS = (TiledBound, TiledSerialBound, RowsBound, RowsSerialBound, VbitBound, VbitSerialBound, Q1Bound,
          Q1SerialBound, Q8iBound, Q8iSerialBound)
KIND_OF = {cls.driver: kind for kind, cls in enumerate(_KINDS)}  # driver -> its index in _KINDS


class BoundArgs(structref.StructRefProxy):
    """A compiled product's argument tuple, converted from Python once (any driver's)."""


for _cls in _KINDS:
    structref.define_boxing(_cls, BoundArgs)


def _make(args, kind):  # noqa: ANN001, ANN202 - compiled only, through the overload below
    raise NotImplementedError("compiled code only")


@overload(_make)
def _make_impl(args, kind):  # noqa: ANN001, ANN202
    if not isinstance(kind, types.IntegerLiteral):
        raise numba.errors.TypingError("the bound kind must be a compile-time constant")
    typ = _KINDS[kind.literal_value]([("args", args)])

    def impl(args, kind):  # pragma: no cover - compiled
        b = structref.new(typ)
        b.args = args
        return b
    return impl


# One constructor per kind, each cached by numba (a structref's own Python constructor would
# compile anew in every process; a kind passed as an argument and made literal re-dispatches
# slowly on every call). Written out, not made in a loop: numba keys its cache by a function's
# name and line, so generated twins would share entries and load each other's kind.
@numba.njit(**SERIAL)
def _new_tiled(args):  # pragma: no cover - compiled
    return _make(args, 0)


@numba.njit(**SERIAL)
def _new_tiled_serial(args):  # pragma: no cover - compiled
    return _make(args, 1)


@numba.njit(**SERIAL)
def _new_rows(args):  # pragma: no cover - compiled
    return _make(args, 2)


@numba.njit(**SERIAL)
def _new_rows_serial(args):  # pragma: no cover - compiled
    return _make(args, 3)


@numba.njit(**SERIAL)
def _new_vbit(args):  # pragma: no cover - compiled
    return _make(args, 4)


@numba.njit(**SERIAL)
def _new_vbit_serial(args):  # pragma: no cover - compiled
    return _make(args, 5)


@numba.njit(**SERIAL)
def _new_q1(args):  # pragma: no cover - compiled
    return _make(args, 6)


@numba.njit(**SERIAL)
def _new_q1_serial(args):  # pragma: no cover - compiled
    return _make(args, 7)


@numba.njit(**SERIAL)
def _new_q8i(args):  # pragma: no cover - compiled
    return _make(args, 8)


@numba.njit(**SERIAL)
def _new_q8i_serial(args):  # pragma: no cover - compiled
    return _make(args, 9)


_NEW = (_new_tiled, _new_tiled_serial, _new_rows, _new_rows_serial, _new_vbit, _new_vbit_serial,  # _KINDS' order
        _new_q1, _new_q1_serial, _new_q8i, _new_q8i_serial)


def run(b):  # noqa: ANN001, ANN201 - compiled only, through the overload below
    """Call a bound product's driver with its arguments (in compiled code)."""
    raise NotImplementedError("compiled code only")


@overload(run)
def _run_impl(b):  # noqa: ANN001, ANN202
    if not isinstance(b, _BoundType):
        return None
    driver = type(b).driver

    def impl(b):  # pragma: no cover - compiled
        driver(*b.args)
    return impl


@numba.njit(**SERIAL)
def run_bound(b):  # pragma: no cover - compiled
    """A bound product called from Python: its driver on its arguments."""
    run(b)


def prebind(call: tuple | None) -> tuple | None:
    """``(function, arguments)`` of a bound product (``MatvecGroup.bind``) as ``(run_bound,
    (BoundArgs,))`` computing the same thing, or the call unchanged when its driver has no bound
    kind. Only for calls made many times: binding converts the arguments and builds the
    structref (tens of µs)."""
    if call is None:
        return None
    fn, args = call
    kind = KIND_OF.get(fn)
    if kind is None:
        return call
    return run_bound, (_NEW[kind](args),)


__all__ = ["BoundArgs", "KIND_OF", "prebind", "run", "run_bound"]
