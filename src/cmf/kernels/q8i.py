"""q8 with int8 activations: integer products over 32-row blocks (opt-in, ``--int8-act``).

The exact q8 kernels (:mod:`.rows`) convert each int8 weight to float32 and multiply-add it with
float32 activations: at a decode batch of 16 sequences they are bound by float multiply-adds
(SmolLM2-135M q8, 2 cores: 37 of the 45 ms of a batched step). With activations quantized per
group of 32 (d = max|x|/127, q = rint(x/d): ``xprep.quantize_x``'s rule, as llama.cpp quantizes
activations for its Q8_0 products), each group's sum is an exact integer dot product — four
byte products per 32-bit lane and instruction with VNNI — and one float multiply-add per group
(:mod:`.q8i_ir`).

The weights are repacked once, at first use, into :mod:`.q8i_ir`'s block layout (as large as the
payload, in huge pages; the mapped rows are then no longer read by products). Every product of the
op — one token, a decode batch, a block of prefill tokens, row-restricted products — runs the same
per-(row, vector) arithmetic, so a sequence's logits do not depend on the rest of its batch.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import _jit
from ._jit import PARALLEL, SERIAL, SERIAL_ORDERED, huge_zeros
from ._jit import chunk as _chunk
from .q8i_ir import (GROUP_BYTES, MAX_VECS, ROWS, VECS_PER_PASS, q8i_block1, q8i_block2, q8i_block3, q8i_block4, q8i_rows,
                     quantize_rows)
from .vmath import gated_rows

GROUP = 32
# Every product prefetches the next block into L2 while reading a block (``pf`` below), one
# vector included, as the 4-bit tile loop does (``q4.PREFETCH_AHEAD``): one vector measured faster
# with them on every target, from L3 and from DRAM (docs/PERFORMANCE.md, "q8 with int8
# activations", which keeps an older measurement that went the other way).


@numba.njit(**SERIAL)
def _pack_blocks(q, packed, b0, b1):  # pragma: no cover - compiled
    """Blocks [b0, b1) of ``q`` [rows, cols] int8 into ``packed`` [nblk, gpr, 8, 32, 4] as q XOR 0x80
    (rows past the end stay 0, columns past the end 0x80: weight 0)."""
    rows, cols = q.shape
    gpr = packed.shape[1]
    for blk in range(b0, b1):
        for i in range(ROWS):
            r = blk * ROWS + i
            if r >= rows:
                break
            for g in range(gpr):
                for w in range(8):
                    for k in range(4):
                        c = g * GROUP + 4 * w + k
                        packed[blk, g, w, i, k] = (np.uint8(q[r, c]) ^ np.uint8(0x80)) if c < cols else np.uint8(0x80)


@numba.njit(**PARALLEL)
def pack_par(q, packed, nt):  # pragma: no cover - compiled
    """:func:`_pack_blocks` over every block, one chunk per thread."""
    n = packed.shape[0]
    for j in prange(nt):
        b0, b1 = _chunk(n, nt, j, 1)
        _pack_blocks(q, packed, b0, b1)


def pack(q: np.ndarray, nt: int) -> np.ndarray:
    """The block layout of a q8 matrix ``q`` [rows, cols] (flat uint8, huge pages)."""
    rows, cols = q.shape
    nblk, gpr = -(-rows // ROWS), -(-cols // GROUP)
    packed = huge_zeros((nblk, gpr, 8, ROWS, 4), np.uint8)
    if packed.size:
        pack_par(q, packed, max(1, nt))
    return packed.reshape(-1)


@numba.njit(**SERIAL)
def quantize(X, xq, d, xc):  # pragma: no cover - compiled
    """Every row of X [T, 32·gpr] float32 → int8 activations ``xq``, scales d and corrections
    xc = 128·Σ q per group of 32 (:func:`~.q8i_ir.quantize_rows`: d = max|x|/127 as
    ``xprep.group_scale`` computes it, q = rint(x·(1/d)) ties to even; a group holding inf or NaN
    gets d = NaN)."""
    quantize_rows(X, 0, X.shape[0], xq, d, xc)


@numba.njit(**SERIAL_ORDERED)
def block_rows(planes, s, xv, xc, d, Y, b0, b1, acc):  # pragma: no cover - compiled
    """Y[t, r] = s[r]·Σ_g d[t, g]·I_g(r, t) for the rows of blocks [b0, b1) (those below
    Y.shape[1]) and every t; up to four vectors per pass over a block. Whole blocks run in one
    compiled loop (:data:`~.q8i_ir.q8i_rows`) when Y's rows are contiguous; a partial last block
    (or a strided Y) block by block through ``acc`` (128 floats)."""
    n = Y.shape[1]
    T, gpr = d.shape
    whole = max(b0, min(b1, n // ROWS)) if Y.strides[1] == 4 else b0  # blocks with all 32 rows: one compiled loop
    if whole > b0:
        pf = gpr * GROUP_BYTES
        q8i_rows(planes, b0, whole, xv.reshape(-1), gpr * 8, xc.reshape(-1), d.reshape(-1), gpr, T, s, Y, pf)
    for blk in range(whole, b1):
        r0 = blk * ROWS
        m = min(ROWS, n - r0)
        if m == ROWS:
            _one_block(planes, s[r0:r0 + ROWS], xv, xc, d, Y[:, r0:r0 + ROWS], blk, acc)
        else:  # the last, partial block: through a 32-column buffer
            sb = np.zeros(ROWS, np.float32)
            sb[:m] = s[r0:r0 + m]
            buf = np.empty((Y.shape[0], ROWS), np.float32)
            # (a column slice, 'A' like Y's slices: a 'C' buffer would compile _one_block again)
            _one_block(planes, sb, xv, xc, d, buf[:, 0:ROWS], blk, acc)
            Y[:, r0:r0 + m] = buf[:, :m]


@numba.njit(**SERIAL_ORDERED)
def listed_blocks(planes, s, X, xq, xv, xc, d, blocks, Y):  # pragma: no cover - compiled
    """Y[:, 32i : 32i + 32] = the rows of block blocks[i] (a row-restricted product reads only
    the blocks holding its rows; rows past the matrix come out as garbage the caller drops)."""
    quantize(X, xq, d, xc)
    acc = np.empty(MAX_VECS * ROWS, np.float32)
    sp = np.zeros(blocks.shape[0] * ROWS, np.float32)
    for i in range(blocks.shape[0]):
        r0 = blocks[i] * ROWS
        m = min(ROWS, s.shape[0] - r0)
        sp[i * ROWS:i * ROWS + m] = s[r0:r0 + m]
    for i in range(blocks.shape[0]):
        _one_block(planes, sp[i * ROWS:(i + 1) * ROWS], xv, xc, d, Y[:, i * ROWS:(i + 1) * ROWS], blocks[i], acc)


@numba.njit(**SERIAL_ORDERED)
def _one_block(planes, s, xv, xc, d, Y, blk, acc):  # pragma: no cover - compiled
    """Block ``blk`` times every vector into Y[:, 0:32] (s: the block's 32 row scales)."""
    T, gpr = d.shape
    vstride = gpr * 8
    dflat = d.reshape(-1)
    cflat = xc.reshape(-1)
    xflat = xv.reshape(-1)
    base = blk * gpr * GROUP_BYTES
    t = 0
    while t < T:
        nv = min(VECS_PER_PASS, T - t)
        pf = gpr * GROUP_BYTES if t == 0 else 0  # the next block, on its first read
        if nv == 4:
            q8i_block4(planes, base, xflat, t * vstride, vstride, cflat, dflat, t * gpr, gpr, acc, pf)
        elif nv == 3:
            q8i_block3(planes, base, xflat, t * vstride, vstride, cflat, dflat, t * gpr, gpr, acc, pf)
        elif nv == 2:
            q8i_block2(planes, base, xflat, t * vstride, vstride, cflat, dflat, t * gpr, gpr, acc, pf)
        else:
            q8i_block1(planes, base, xflat, t * vstride, vstride, cflat, dflat, t * gpr, gpr, acc, pf)
        for v in range(nv):
            for i in range(ROWS):
                Y[t + v, i] = acc[ROWS * v + i] * s[i]
        t += nv


@numba.njit(**SERIAL_ORDERED)
def _group_chunk(planes, ss, xv, xc, d, Y, offs, sizes, nt, j, act, width):  # pragma: no cover - compiled
    acc = np.empty(MAX_VECS * ROWS, np.float32)
    for m in range(len(planes)):
        if sizes[m] == 0:
            continue
        nblk = (sizes[m] + ROWS - 1) // ROWS
        b0, b1 = _chunk(nblk, nt, j, 1)
        block_rows(planes[m], ss[m], xv, xc, d, Y[:, offs[m]:offs[m] + sizes[m]], b0, b1, acc)
    if act >= 0:
        nblk = (width + ROWS - 1) // ROWS
        b0, b1 = _chunk(nblk, nt, j, 1)
        gated_rows(Y, width, act, b0 * ROWS, min(width, b1 * ROWS))


@numba.njit(**PARALLEL)
def group_par(planes, ss, X, xq, xv, xc, d, Y, offs, sizes, nt, act, width):  # pragma: no cover - compiled
    """Every matrix m of the group times every row of X into Y[:, offs[m]:offs[m] + sizes[m]]
    (and the gated activation of the first ``width`` columns when ``act`` ≥ 0), one chunk of
    blocks per thread; X quantized once into xq (xv: the same bytes as int32 words) / xc / d,
    the vectors split across the threads (a 16 × 1536 block took 12 µs on one)."""
    for t in prange(X.shape[0]):
        quantize_rows(X, t, t + 1, xq, d, xc)
    for j in prange(nt):
        _group_chunk(planes, ss, xv, xc, d, Y, offs, sizes, nt, np.int64(j), act, width)


@numba.njit(**SERIAL_ORDERED)
def group_serial(planes, ss, X, xq, xv, xc, d, Y, offs, sizes, act, width):  # pragma: no cover - compiled
    """:func:`group_par` on the calling thread."""
    quantize(X, xq, d, xc)
    _group_chunk(planes, ss, xv, xc, d, Y, offs, sizes, np.int64(1), np.int64(0), act, width)


SLOTS = 3  # matrices per group call (padded: one compiled specialization, as gemv.GROUP_SLOTS)
NO_ACT = -1


class Int8Group:
    """Products of q8 matrices sharing one input with int8 activations: ``Y = X @ [W_0; W_1; …].T``
    (or, with ``act``, the gated activation ``act(W_0·x)·(W_1·x)`` in the first half). ``mats``:
    (packed blocks, f32 row scales, rows) per matrix, at most :data:`SLOTS`."""

    def __init__(self, mats: list, in_features: int, act: int = NO_ACT, width: int = 0) -> None:
        if not 0 < len(mats) <= SLOTS:
            raise ValueError(f"an int8 q8 group takes 1..{SLOTS} matrices, got {len(mats)}")
        self.in_features = in_features
        self.gpr = -(-in_features // GROUP)
        pad = SLOTS - len(mats)
        self.planes = tuple(m[0] for m in mats) + (mats[0][0][:0],) * pad
        self.ss = tuple(m[1] for m in mats) + (mats[0][1][:0],) * pad
        sizes = [int(m[2]) for m in mats]
        self.sizes = np.array(sizes + [0] * pad, np.int64)
        self.offs = np.array(list(np.cumsum([0] + sizes[:-1])) + [0] * pad, np.int64)
        self.out_features = int(sum(sizes))
        self.act, self.width = act, width
        self.work = sum(m[0].nbytes for m in mats)

    def bind(self, X: np.ndarray, Y: np.ndarray, nt: int, bufs: tuple | None = None) -> tuple:
        """(compiled function, arguments) computing :meth:`run` on these arrays; X must hold
        whole groups (``in_features`` a multiple of 32, C-contiguous). ``bufs``: the int8
        activation buffers of :func:`buffers` to reuse (a token step binds once)."""
        xq, xc, d = bufs if bufs is not None else buffers(X.shape[0], self.gpr)
        args = (self.planes, self.ss, X, xq, xq.view(np.int32), xc, d, Y, self.offs, self.sizes)
        if nt > 1 and self.work >= _jit.PARALLEL_MIN_BYTES:  # read per call, as MatvecGroup.bind does
            return group_par, (*args, nt, self.act, self.width)
        return group_serial, (*args, self.act, self.width)

    def run(self, X: np.ndarray, Y: np.ndarray, nt: int) -> np.ndarray:
        """X [T, in] float32 → Y [T, out_features] (a caller's array). Returns Y."""
        X = whole_groups(X, self.gpr)
        fn, args = self.bind(X, Y, nt)
        fn(*args)
        return Y


def buffers(T: int, gpr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int8 activations [T, 32·gpr], corrections [T, gpr] int32, scales [T, gpr] float32)."""
    return np.empty((T, gpr * GROUP), np.int8), np.empty((T, gpr), np.int32), np.empty((T, gpr), np.float32)


def whole_groups(X: np.ndarray, gpr: int) -> np.ndarray:
    """X as C-contiguous float32 [T, 32·gpr] (zeros past the last feature: the quantizer reads
    whole groups)."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.shape[1] != gpr * GROUP:
        Xp = np.zeros((X.shape[0], gpr * GROUP), np.float32)
        Xp[:, :X.shape[1]] = X
        X = Xp
    return X


__all__ = ["Int8Group", "buffers", "whole_groups", "block_rows", "group_par", "group_serial", "listed_blocks", "pack", "quantize"]
