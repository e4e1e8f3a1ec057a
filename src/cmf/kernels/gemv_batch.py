"""Decode products for a batch of sequences: several mat-vecs of B inputs in one parallel region.

The server's decode step multiplies B token vectors (one per sequence) by every matrix. Read
once per step, each weight serves all B rows: every thread takes its chunk of rows of every
matrix — the same chunks as the one-token :class:`~cmf.kernels.gemv.MatvecGroup` — and for each
group of four rows (a quarter of the chunk apart, so the prefetchers see four long streams) it
computes the dot products with all B inputs while the rows sit in L1. Each (row, input) sum is
the one-token kernel's ``dot_ir.dot4`` on the same data (both run :mod:`.rows`' one body), so a
sequence's products are bit-for-bit those it gets alone, whatever else is in the batch. The
paired kernel (``dot_ir.dot22``) converts each weight block once for two inputs, in the same summation order (``dot_ir``: one order written in IR
for every kernel and CPU); a group uses it from
``PAIRED_MIN_T`` inputs on (below, the weight stream bounds the step and the plain kernel's four
rows in flight keep more of it going) after checking, once, that it reproduces the one-token
products exactly on this CPU (2 cores, 16 inputs: 15% less time per pass than the plain one). q8,
f16/bf16 and f32 run here; other families run their LinearOps one after another (their batched
path: no such guarantee past ``fused_max_t``).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

import logging
import os

from . import _jit
from ._jit import PARALLEL, SERIAL
from ._jit import chunk as _chunk
from .gemv import NO_ACT, MatvecGroup
from .rows import fold_cols, row_dots, row_dots_pairs
from .q8i import GROUP as Q8I_GROUP
from .vmath import gated_rows

log = logging.getLogger(__name__)

# The paired kernel (two vectors per pass over the weights, dot_ir.dot22) where it is bit-identical
# to the one-token products; CMF_BATCH_PAIRED=0 keeps the plain one everywhere.
PAIRED = os.environ.get("CMF_BATCH_PAIRED", "1").strip().lower() not in ("0", "false", "off", "no")
# Below this many inputs the plain kernel runs: still bound by the weight stream there, and its four
# rows in flight (against the paired kernel's two) keep more of it going (measured on 2 cores: 2
# inputs 12.5 against 16.6 ms per pass over the benchmark model, 8 even, 16: 61.5 against 52.1).
PAIRED_MIN_T = 8


@numba.njit(**SERIAL)
def _batch_chunk(ws, kind, ss, cols, X, Y, offs, rows, nt, j, act, width, paired):  # pragma: no cover - compiled
    for m in range(len(ws)):
        r0, r1 = _chunk(ws[m].shape[0], nt, j, 4)
        if paired:
            row_dots_pairs(ws[m], kind, ss[m], fold_cols(X, cols[m]), Y[:, offs[m]:], rows, r0, r1)
        else:
            row_dots(ws[m], kind, ss[m], fold_cols(X, cols[m]), Y[:, offs[m]:], rows, r0, r1)
    if act >= 0:
        r0, r1 = _chunk(width, nt, j, 4)
        gated_rows(Y, width, act, r0, r1)


@numba.njit(**PARALLEL)
def rows_group_batch(ws, kind, ss, cols, X, Y, offs, rows, nt, act, width, paired):  # pragma: no cover - compiled
    """Every matrix of ``ws`` (one dtype family) times every row of X, one chunk of rows per thread
    (``paired``: through :func:`~cmf.kernels.rows.row_dots_pairs`)."""
    for j in prange(nt):
        _batch_chunk(ws, kind, ss, cols, X, Y, offs, rows, nt, np.int64(j), act, width, paired)


@numba.njit(**SERIAL)
def rows_group_batch_serial(ws, kind, ss, cols, X, Y, offs, rows, act, width, paired):  # pragma: no cover
    """:func:`rows_group_batch` on the calling thread."""
    _batch_chunk(ws, kind, ss, cols, X, Y, offs, rows, np.int64(1), np.int64(0), act, width, paired)


class BatchGroup:
    """:class:`~cmf.kernels.gemv.MatvecGroup` for B inputs: ``Y[b] = group(X[b])`` (the matrices'
    outputs side by side, or the gated activation ``act(W_0·x)·(W_1·x)`` in the first half)."""

    def __init__(self, ops: list, act: str | None = None) -> None:
        self.group = MatvecGroup(ops, act)
        self.direct = self.group.kernel in ("rows", "q8i")
        self.out_features = self.group.out_features
        self.width = self.group.width
        self.paired: bool | None = None  # whether the paired kernel matches here (checked on first use)

    @property
    def ops(self) -> list:
        return self.group.ops

    def __call__(self, X: np.ndarray, nt: int | None = None) -> np.ndarray:
        """X: [B, in] float32 → [B, out_features] float32 (a new array)."""
        g = self.group
        nt = _jit.threads() if nt is None else nt
        X = np.ascontiguousarray(X, dtype=np.float32)
        Y = np.empty((X.shape[0], g.out_features), np.float32)
        if not self.direct:
            for o, off, n in zip(g.ops, g.offs, g.sizes):
                Y[:, off:off + n] = o(X)
            if g.act != NO_ACT:
                gated_rows(Y, g.width, g.act, 0, g.width)
            return Y
        if g.kernel == "q8i":  # int8 activations: one arithmetic per (row, vector) for any batch
            return g.int8_group.run(X, Y, nt)
        if nt > 1 and g.work < _jit.PARALLEL_MIN_BYTES:  # MatvecGroup.bind's rule: the same row chunks
            nt = 1
        if X.shape[0] >= PAIRED_MIN_T and self.paired is None:
            self.paired = self._paired_matches(nt)
        self._run(X, Y, nt, bool(self.paired) and X.shape[0] >= PAIRED_MIN_T)
        return Y

    def bind(self, X: np.ndarray, Y: np.ndarray, nt: int) -> tuple | None:
        """(compiled function, arguments) computing ``self(X, nt)`` into Y for these arrays — the
        same kernel, row chunks and pairing choice as :meth:`__call__` — so a step that reuses its
        buffers calls it without the per-call checks; None where the group has no single kernel
        call (other families, int8 inputs that are not whole groups of 32). X: C-contiguous
        float32 [B, in_features]; Y: [B, out_features]."""
        g = self.group
        if not self.direct:
            return None
        if g.kernel == "q8i":
            return g.int8_group.bind(X, Y, nt) if X.shape[1] == g.int8_group.gpr * Q8I_GROUP else None
        if nt > 1 and g.work < _jit.PARALLEL_MIN_BYTES:
            nt = 1
        if X.shape[0] >= PAIRED_MIN_T and self.paired is None:
            self.paired = self._paired_matches(nt)
        paired = bool(self.paired) and X.shape[0] >= PAIRED_MIN_T
        if nt > 1:
            return rows_group_batch, (*g.row_args, X, Y, g.slot_offsets, g.row_index, nt, g.act, g.width, paired)
        return rows_group_batch_serial, (*g.row_args, X, Y, g.slot_offsets, g.row_index, g.act, g.width, paired)

    def _run(self, X: np.ndarray, Y: np.ndarray, nt: int, paired: bool) -> None:
        g = self.group
        if nt > 1:
            rows_group_batch(*g.row_args, X, Y, g.slot_offsets, g.row_index, nt, g.act, g.width, paired)
        else:
            rows_group_batch_serial(*g.row_args, X, Y, g.slot_offsets, g.row_index, g.act, g.width, paired)

    def _paired_matches(self, nt: int) -> bool:
        """Whether the paired kernel gives this group's one-token results bit for bit. Both run
        ``dot_ir``'s one summation order, so this is a guard (a CPU without FMA, a future kernel
        change), not a search: checked once, on random vectors (the order of a float sum does not
        depend on the values, so one mismatch-free product settles it); on a mismatch the plain
        kernel runs."""
        if not PAIRED:
            return False
        g = self.group
        X = np.random.default_rng(0).standard_normal((3, g.in_features)).astype(np.float32)
        fast = np.empty((3, g.out_features), np.float32)
        self._run(X, fast, nt, True)
        one = np.empty((1, g.out_features), np.float32)
        for t in range(3):
            g(X[t:t + 1], one, nt)
            if not np.array_equal(one[0], fast[t], equal_nan=True):
                log.info("batched products: the paired kernel differs from the one-token kernel for %s; "
                         "using the plain one", [o.name for o in g.ops])
                return False
        return True


__all__ = ["BatchGroup", "rows_group_batch"]
