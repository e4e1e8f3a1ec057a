"""Decode products: several mat-vecs of one input in one parallel region, into caller buffers.

A decoded token reads every weight once, so its cost is memory bandwidth plus, per product, a
parallel-region start (~3 µs on an idle 2-core machine, far more when a thread is descheduled)
and a Python call. :class:`MatvecGroup` runs the products that share an input — q, k and v;
gate and up — in *one* region: each thread takes its chunk of rows of every matrix, and for
gate/up it applies the activation to its own rows (``act(g)·u``) before the region ends. The
results go into a buffer the caller allocated once, so a token step allocates nothing.

The per-row serial bodies are the families' own (``rows`` for q8/f16/bf16/f32, ``q4``, ``vbit``, ``q1``),
so values are bit-for-bit those of the LinearOps. Matrices of different families, q1t (its
tiles and overlay run through its LinearOp) or the reference path run one after another through
their LinearOp (same values, more regions).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import _jit, q8i
from ._jit import PARALLEL, PARALLEL_ORDERED, SERIAL, SERIAL_ORDERED, threads
from ._jit import chunk as _chunk
from .q4 import R as TILE_R
from .q4 import _tail_rows, tiles_run
from .xprep import fill_x
from .q1 import q1_rows
from .rows import ALL_ROWS, fold_cols, row_dots
from .vbit import group_sums, pair_x, vbit_rows
from .vmath import gated_rows

ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "gelu_new": 1, "gelu_fast": 1, "gelu": 2,
        "relu": 3}
NO_ACT = -1


@numba.njit(**SERIAL)
def apply_act(Y, width, act, i0, i1):  # pragma: no cover - compiled
    """Y[0, i] = act(Y[0, i])·Y[0, width + i] for i in [i0, i1) (gate in the first half, up after):
    the batched products' own loop (``vmath.gated_rows``) on the first row, so the values agree."""
    gated_rows(Y[:1], width, act, i0, i1)


@numba.njit(**SERIAL)
def _act_chunk(Y, width, act, nt, j):  # pragma: no cover - compiled
    """Thread j's share of the gated activation (``act`` < 0: none), after its rows of gate/up."""
    if act >= 0:
        r0, r1 = _chunk(width, nt, j, 4)
        apply_act(Y, width, act, r0, r1)


@numba.njit(**SERIAL)
def _rows_chunk(ws, kind, ss, cols, X, Y, offs, rows, nt, j, act, width):  # pragma: no cover - compiled
    """Thread j's share: its chunk of rows of every matrix, then the activation of its gate rows."""
    for m in range(len(ws)):
        r0, r1 = _chunk(ws[m].shape[0], nt, j, 4)
        row_dots(ws[m], kind, ss[m], fold_cols(X, cols[m]), Y[:, offs[m]:], rows, r0, r1)
    _act_chunk(Y, width, act, nt, j)


@numba.njit(**PARALLEL)
def rows_group(ws, kind, ss, cols, X, Y, offs, rows, nt, act, width):  # pragma: no cover - compiled
    """Every matrix of ``ws`` (one dtype family) times X[0], one chunk of rows per thread
    (``rows``: :data:`~cmf.kernels.rows.ALL_ROWS`, every row in order)."""
    for j in prange(nt):
        _rows_chunk(ws, kind, ss, cols, X, Y, offs, rows, nt, np.int64(j), act, width)


@numba.njit(**SERIAL)
def rows_group_serial(ws, kind, ss, cols, X, Y, offs, rows, act, width):  # pragma: no cover - compiled
    """:func:`rows_group` on the calling thread (no parallel region to start: small products)."""
    _rows_chunk(ws, kind, ss, cols, X, Y, offs, rows, np.int64(1), np.int64(0), act, width)


@numba.njit(**SERIAL)
def _vbit_chunk(datas, widths, starts, soffs, X, xs, xp, Y, offs, rows, nt, j, act, width):  # pragma: no cover
    for m in range(len(datas)):
        r0, r1 = _chunk(widths[m].shape[0], nt, j, 4)
        vbit_rows(datas[m], widths[m], starts[m], soffs[m], X, xs, xp, Y[:, offs[m]:], rows, r0, r1)
    _act_chunk(Y, width, act, nt, j)


@numba.njit(**PARALLEL)
def vbit_group(datas, widths, starts, soffs, X, Y, offs, rows, nt, act, width):  # pragma: no cover - compiled
    """vbit / vbit_ro matrices times X[0] (x's group sums and deinterleaved copy made once)."""
    xs = group_sums(X)
    xp = pair_x(X)
    for j in prange(nt):
        _vbit_chunk(datas, widths, starts, soffs, X, xs, xp, Y, offs, rows, nt, np.int64(j), act, width)


@numba.njit(**SERIAL)
def vbit_group_serial(datas, widths, starts, soffs, X, Y, offs, rows, act, width):  # pragma: no cover - compiled
    """:func:`vbit_group` on the calling thread."""
    _vbit_chunk(datas, widths, starts, soffs, X, group_sums(X), pair_x(X), Y, offs, rows, np.int64(1), np.int64(0), act, width)


@numba.njit(**SERIAL)
def _q1_chunk(kinds, tiles, ptrs, ents, X, xs, Y, offs, rows, nt, j, act, width):  # pragma: no cover
    for m in range(len(tiles)):
        r0, r1 = _chunk(tiles[m].shape[0], nt, j, 4)
        q1_rows(kinds[m], tiles[m], ptrs[m], ents[m], X, xs, Y[:, offs[m]:], rows, r0, r1)
    _act_chunk(Y, width, act, nt, j)


@numba.njit(**PARALLEL)
def q1_group(kinds, tiles, ptrs, ents, X, Y, offs, rows, nt, act, width):  # pragma: no cover - compiled
    """q1 / q1s matrices (sign-bit groups read in place) times X[0] (x's group sums made once)."""
    xs = group_sums(X)
    for j in prange(nt):
        _q1_chunk(kinds, tiles, ptrs, ents, X, xs, Y, offs, rows, nt, np.int64(j), act, width)


@numba.njit(**SERIAL)
def q1_group_serial(kinds, tiles, ptrs, ents, X, Y, offs, rows, act, width):  # pragma: no cover - compiled
    """:func:`q1_group` on the calling thread."""
    _q1_chunk(kinds, tiles, ptrs, ents, X, group_sums(X), Y, offs, rows, np.int64(1), np.int64(0), act, width)


@numba.njit(**SERIAL_ORDERED)
def _tiled_chunk(kinds, planes, scs16, cws, lads, params, exp2tabs, readys, srcs, scss, css, tiles, xp, xs, xv, xd,
                 Y, offs, nt, j, act, width, has_tail):  # pragma: no cover - compiled
    # Without an activation the threads split the group's tiles as one list (q/k/v: 9 + 3 + 3
    # tiles as 8 and 7, not 5+2+2 and 4+1+1); with one, each thread needs the same rows of gate
    # and up, so each matrix is split alike.
    total = 0
    for m in range(len(planes)):
        total += planes[m].shape[0]
    g0, g1 = _chunk(total, nt, j, 1)
    base = 0
    for m in range(len(planes)):
        n = planes[m].shape[0]
        if act >= 0:
            t0, t1 = _chunk(n, nt, j, 1)
        else:
            t0, t1 = max(g0 - base, 0), min(g1 - base, n)
        base += n
        if t1 > t0:  # (a padding slot has no tiles)
            tiles_run(tiles, t0, t1, kinds[m], planes[m], scs16[m], cws[m], lads[m], params[m], exp2tabs[m],
                      readys[m], srcs[m], scss[m], css[m], xp, xs, xv, xd, Y[:, offs[m]:])
    if act >= 0 and not has_tail:
        t0, t1 = _chunk(planes[0].shape[0], nt, j, 1)
        apply_act(Y, width, act, t0 * TILE_R, t1 * TILE_R)


@numba.njit(**SERIAL_ORDERED)
def _tiled_tails(X, kinds, srcs, scss, css, params, exp2tabs, tails, Y, offs, act, width):  # pragma: no cover
    """Rows past the last whole tile of each matrix (decoded from the stored layout), then the
    activation over all rows when the gate has such rows."""
    for m in range(len(tails)):
        if tails[m].shape[0]:
            _tail_rows(X, tails[m], kinds[m], srcs[m], scss[m], css[m], params[m], exp2tabs[m], Y[:, offs[m]:])
    if act >= 0:
        apply_act(Y, width, act, np.int64(0), width)


@numba.njit(**SERIAL)
def _any_tail(tails):  # pragma: no cover - compiled
    for m in range(len(tails)):
        if tails[m].shape[0]:
            return True
    return False


@numba.njit(**PARALLEL_ORDERED)
def tiled_group(kinds, planes, scs16, cws, lads, params, exp2tabs, readys, srcs, scss, css, tails, tiles, X, xp, xs,
                q8, xv, xd, zero, Y, offs, nt, act, width):  # pragma: no cover - compiled
    """The 4-bit family: every matrix shares one regrouped (or int8) x (same code width)."""
    fill_x(X, xp, xs, q8, xd, zero)
    has_tail = _any_tail(tails)
    # (np.int64: the parfor pass retypes the prange index, and the chunk would compile twice)
    for j in prange(nt):
        _tiled_chunk(kinds, planes, scs16, cws, lads, params, exp2tabs, readys, srcs, scss, css, tiles, xp, xs, xv,
                     xd, Y, offs, nt, np.int64(j), act, width, has_tail)
    if has_tail:
        _tiled_tails(X, kinds, srcs, scss, css, params, exp2tabs, tails, Y, offs, act, width)


@numba.njit(**SERIAL_ORDERED)
def tiled_group_serial(kinds, planes, scs16, cws, lads, params, exp2tabs, readys, srcs, scss, css, tails, tiles, X, xp,
                       xs, q8, xv, xd, zero, Y, offs, act, width):  # pragma: no cover - compiled
    """:func:`tiled_group` on the calling thread."""
    fill_x(X, xp, xs, q8, xd, zero)
    has_tail = _any_tail(tails)
    # (int64 thread count and index, as tiled_group passes: literals would compile the chunk again, ~4 s)
    _tiled_chunk(kinds, planes, scs16, cws, lads, params, exp2tabs, readys, srcs, scss, css, tiles, xp, xs, xv, xd,
                 Y, offs, np.int64(1), np.int64(0), act, width, has_tail)
    if has_tail:
        _tiled_tails(X, kinds, srcs, scss, css, params, exp2tabs, tails, Y, offs, act, width)


# The compiled group products take each matrix's arrays as tuples, and numba compiles one
# specialization per tuple length: 10 s each for the 4-bit family's parallel driver, 3 s for the
# row kernels', paid on the first run after an install once for qkv (3), gate/up (2) and o/down
# (1). Groups of up to GROUP_SLOTS matrices are padded with empty slots (zero rows of the first
# matrix's arrays, which the kernels skip), so each family compiles one specialization.
GROUP_SLOTS = 3


def _pad(entries: tuple, empty: object) -> tuple:
    """``entries`` padded with ``empty`` to GROUP_SLOTS (longer tuples as they are)."""
    return entries + (empty,) * max(0, GROUP_SLOTS - len(entries))


def _pad_arrays(entries: tuple) -> tuple:
    """Per-matrix arrays padded with a zero-row slice of the first (same type: dtype, ndim,
    layout, read-only flag)."""
    return _pad(entries, entries[0][:0])


# group kernel name (FusedLinear.group_family before any ":") -> (parallel, serial) drivers; "tiled"
# has its own call (x prepared once for the group, see MatvecGroup.bind)
GROUP_KERNELS = {"rows": (rows_group, rows_group_serial), "vbit": (vbit_group, vbit_group_serial),
                 "q1": (q1_group, q1_group_serial), "tiled": (tiled_group, tiled_group_serial),
                 "q8i": (q8i.group_par, q8i.group_serial)}


class MatvecGroup:
    """``out[0, off_m : off_m + rows_m] = W_m · x`` for every matrix m, or, with ``act``, the
    gated activation ``act(W_0·x)·(W_1·x)`` in ``out[0, :rows]`` (``out`` then holds 2·rows).

    ``ops`` are LinearOps over the same input width; one parallel region when they share a
    family, else one product after another.
    """

    def __init__(self, ops: list, act: str | None = None) -> None:
        self.ops = list(ops)
        self.in_features = self.ops[0].in_features
        if any(o.in_features != self.in_features for o in self.ops):
            raise ValueError("a MatvecGroup needs matrices of one input width")
        self.sizes = [o.out_features for o in self.ops]
        self.offs = np.cumsum([0] + self.sizes[:-1]).astype(np.int64)
        self.out_features = int(sum(self.sizes))
        self.act = NO_ACT if act is None else ACTS[act]
        if act is not None and (len(self.ops) != 2 or self.sizes[0] != self.sizes[1]):
            raise ValueError("a gated activation needs two matrices of the same shape (gate, up)")
        self.width = self.sizes[0] if act is not None else 0
        self.nbytes = sum(int(getattr(o, "nbytes", 0)) for o in self.ops)
        self.work = sum(int(getattr(o, "work", getattr(o, "nbytes", 0))) for o in self.ops)  # see FusedLinear.work
        fams = {getattr(o, "group_family", None) for o in self.ops}
        self.family = fams.pop() if len(fams) == 1 else None
        self.kernel = None if self.family is None else self.family.partition(":")[0]
        if self.kernel not in (None, *GROUP_KERNELS):
            raise ValueError(f"group family {self.family!r}: no such group kernel (one of {GROUP_KERNELS})")
        # the row kernels' index (vbit/q1: 0, 1, ...; "rows": empty, i.e. every row in order)
        self.row_index = ALL_ROWS if self.kernel == "rows" else np.arange(max(self.sizes), dtype=np.int64)
        # the offsets padded to GROUP_SLOTS, as the compiled kernels take them
        self.slot_offsets = np.concatenate([self.offs, np.zeros(max(0, GROUP_SLOTS - len(self.ops)), np.int64)])
        arrays = list(zip(*(o.group_arrays() for o in self.ops))) if self.kernel else []
        if self.kernel == "tiled":
            o0 = self.ops[0]
            gpr = self.in_features // 32
            self._xp = np.empty((1, o0.phases, gpr, o0.width), np.float32)
            # x as int8 pieces only when every matrix of the group takes the same number
            pieces = o0.pieces if all(o.pieces == o0.pieces for o in self.ops) else 0
            self._xs = np.empty((1, gpr * max(pieces, 1)), np.float32)
            self._q8 = np.empty(o0.x8_shape(1 if pieces else 0, pieces), np.int8)
            self._xv = self._q8.reshape(self._q8.shape[0], -1).view(np.int32) if pieces else \
                np.empty((0, gpr * 8), np.int32)
            self._xd = np.empty((1, gpr), np.float32)
            self._tiles = np.arange(max(o.ntiles for o in self.ops) or 1, dtype=np.int64)
            kinds = _pad(arrays[0], arrays[0][0])
            tup = (kinds, *(_pad_arrays(a) for a in arrays[1:]))
            # the arguments around x, built once (the call then only adds x, out and nt)
            self._before = (*tup, self._tiles)
            self._after = (self._xp, self._xs, self._q8, self._xv, self._xd, o0.zero)
        elif self.kernel == "q8i":  # q8 with int8 activations: x quantized once for the group
            self.int8_group = q8i.Int8Group([o.int8_mats() for o in self.ops], self.in_features, self.act, self.width)
            self._bufs = q8i.buffers(1, self.int8_group.gpr)
        elif self.kernel == "vbit":  # (data, widths, starts, soff)
            self._tup = (*(_pad_arrays(a) for a in arrays[:3]), _pad(arrays[3], np.int64(0)))
        elif self.kernel == "q1":  # (kind, tiles, ptr, ent)
            self._tup = (_pad(arrays[0], arrays[0][0]), *(_pad_arrays(a) for a in arrays[1:]))
        elif self.kernel == "rows":  # (rows, kind, scales, column field): one kind per group
            self._tup = (_pad_arrays(arrays[0]), arrays[1][0], _pad_arrays(arrays[2]), _pad_arrays(arrays[3]))

    @property
    def row_args(self) -> tuple:
        """The row-dot kernels' per-matrix arguments (padded rows, kind, scales, column fields):
        what :mod:`.gemv_batch` passes to its own drivers of :func:`~cmf.kernels.rows.row_dots`."""
        if self.kernel != "rows":
            raise ValueError(f"group of family {self.family!r} has no row-dot arguments")
        return self._tup

    def bind(self, x: np.ndarray, out: np.ndarray, nt: int) -> tuple | None:
        """(compiled function, its arguments) computing ``self(x, out, nt)``, or None when the
        matrices run one after another (no single call). A token step binds its buffers once and
        then makes the call directly: the Python around each product, run with caches the weight
        stream has just evicted, cost more than the call itself."""
        kernel = self.kernel
        if kernel is None:
            return None
        if nt > 1 and self.work < _jit.PARALLEL_MIN_BYTES:
            nt = 1
        offs, act, width = self.slot_offsets, self.act, self.width
        if kernel == "tiled":
            if x.strides[1] != 4:  # the int8 preparation loads each group of x as one vector
                return None
            if nt > 1:
                return tiled_group, (*self._before, x, *self._after, out, offs, nt, act, width)
            return tiled_group_serial, (*self._before, x, *self._after, out, offs, act, width)
        if kernel == "q8i":
            if x.shape[1] % q8i.GROUP or not x.flags.c_contiguous or x.shape[0] != 1:
                return None
            return self.int8_group.bind(x, out, nt, self._bufs)
        par, serial = GROUP_KERNELS[kernel]
        if nt > 1:
            return par, (*self._tup, x, out, offs, self.row_index, nt, act, width)
        return serial, (*self._tup, x, out, offs, self.row_index, act, width)

    def __call__(self, x: np.ndarray, out: np.ndarray, nt: int | None = None) -> np.ndarray:
        """x: [1, in] float32 (C-contiguous); out: [1, out_features] float32. Returns ``out``.

        ``nt``: the thread count (numba's current one when None; a token step reads it once)."""
        if nt is None:
            nt = threads()
        if self.family is not None and x.strides[1] != 4:
            x = np.ascontiguousarray(x)
        call = self.bind(x, out, nt)
        if call is not None:
            call[0](*call[1])
            return out
        for o, off, n in zip(self.ops, self.offs, self.sizes):
            out[:, off:off + n] = o(x)
        if self.act != NO_ACT:
            apply_act(out, self.width, self.act, 0, self.width)
        return out


__all__ = ["MatvecGroup", "ACTS"]
