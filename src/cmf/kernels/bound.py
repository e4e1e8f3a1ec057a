"""A product's arguments bound once into one compiled object, so a token step's call unboxes one
value instead of dozens of arrays.

numba's dispatcher converts every argument of every call from Python: a 4-bit group product
takes ~40 arrays (each matrix's arrays padded to three slots), and converting them cost ~3.7 µs a
call whatever the product's size — for SmolLM2-135M, 120 products a token, ~8% of a decode step
(docs/PERFORMANCE.md, "Binding a product's arguments"). A token step's products see the same
arrays every time (the layer's buffers, the matrices), so :func:`prebind` stores the argument
tuple once in a numba structref and returns a runner that takes that one value and calls the
same compiled driver with the same arguments: the same code on the same memory, the same
results. The structref keeps its arrays alive and writes go to the caller's buffers.
"""

from __future__ import annotations

from typing import Any, Callable

import numba
from numba.core import types
from numba.experimental import structref

from . import q8i
from ._jit import SERIAL
from .gemv import (q1_group, q1_group_serial, rows_group, rows_group_serial, tiled_group, tiled_group_serial,
                   vbit_group, vbit_group_serial)


@structref.register
class BoundArgsType(types.StructRef):
    """The numba type of :class:`BoundArgs`: one field, the argument tuple."""


class BoundArgs(structref.StructRefProxy):
    """A compiled product's argument tuple, converted from Python once."""


structref.define_constructor(BoundArgs, BoundArgsType, ["args"])
structref.define_boxing(BoundArgsType, BoundArgs)


@numba.njit(**SERIAL)
def _new(args):  # pragma: no cover - compiled
    """Cached (a structref's own Python constructor compiles anew in every process)."""
    return BoundArgs(args)


# One runner per driver: a runner must name its callee (a function held in a field would be a
# first-class function value, which numba does not cache).
@numba.njit(**SERIAL)
def _run_tiled(b):  # pragma: no cover - compiled
    tiled_group(*b.args)


@numba.njit(**SERIAL)
def _run_tiled_serial(b):  # pragma: no cover - compiled
    tiled_group_serial(*b.args)


@numba.njit(**SERIAL)
def _run_rows(b):  # pragma: no cover - compiled
    rows_group(*b.args)


@numba.njit(**SERIAL)
def _run_rows_serial(b):  # pragma: no cover - compiled
    rows_group_serial(*b.args)


@numba.njit(**SERIAL)
def _run_vbit(b):  # pragma: no cover - compiled
    vbit_group(*b.args)


@numba.njit(**SERIAL)
def _run_vbit_serial(b):  # pragma: no cover - compiled
    vbit_group_serial(*b.args)


@numba.njit(**SERIAL)
def _run_q1(b):  # pragma: no cover - compiled
    q1_group(*b.args)


@numba.njit(**SERIAL)
def _run_q1_serial(b):  # pragma: no cover - compiled
    q1_group_serial(*b.args)


@numba.njit(**SERIAL)
def _run_q8i(b):  # pragma: no cover - compiled
    q8i.group_par(*b.args)


@numba.njit(**SERIAL)
def _run_q8i_serial(b):  # pragma: no cover - compiled
    q8i.group_serial(*b.args)


RUNNERS: dict[Any, Callable] = {
    tiled_group: _run_tiled, tiled_group_serial: _run_tiled_serial, rows_group: _run_rows,
    rows_group_serial: _run_rows_serial, vbit_group: _run_vbit, vbit_group_serial: _run_vbit_serial,
    q1_group: _run_q1, q1_group_serial: _run_q1_serial, q8i.group_par: _run_q8i, q8i.group_serial: _run_q8i_serial,
}


def prebind(call: tuple | None) -> tuple | None:
    """``(function, arguments)`` of a bound product (``MatvecGroup.bind``) as ``(runner,
    (BoundArgs,))`` computing the same thing, or the call unchanged when its driver has no
    runner. Only for calls made many times: binding converts the arguments and builds the
    structref (tens of µs)."""
    if call is None:
        return None
    fn, args = call
    runner = RUNNERS.get(fn)
    if runner is None:
        return call
    return runner, (_new(args),)


__all__ = ["BoundArgs", "RUNNERS", "prebind"]
