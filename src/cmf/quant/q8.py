"""8-bit dtypes: ``q8_row`` (one f16 scale per row) and ``q8_2f`` (row scale x column field).

Layouts (spec §3.2): q8_row ``[i8 out·in][f16 out]``; q8_2f ``[i8 out·in][f16 out][f16 in]``.
Encoders follow REFERENCE_NOTES §1.8: f32 arithmetic, scales through ``f16_scale``, division
(not a reciprocal) before round-half-to-even.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..format.constants import Dtype
from . import _fast, _outputs
from .base import Buffer, Codec, as_bytes_array, as_f32, check_shape, f16_at, require_2d, row_block, row_chunks
from .float import F16_TINY, f16_round, f16_scale, f32_to_f16_bits

_COL_BLOCK = 256  # rows per partial sum of the q8_2f column field (reference: thread-count independent)


class Q8RowCodec(Codec):
    """``q8_row``: ``w = q[o,i]·scale[o]``, ``scale = f16_scale(absmax(row)/127)``."""

    id = Dtype.Q8_ROW

    def encode(self, array: np.ndarray) -> bytes:
        w = as_f32(array)
        out, cols = require_2d(self.id, w.shape)
        q = np.empty((out, cols), dtype=np.int8)
        scales = np.empty(out, dtype=np.float32)
        for sl in row_chunks(out, cols):
            blk = w[sl]
            absmax = np.abs(blk).max(axis=1) if cols else np.zeros(blk.shape[0], np.float32)
            s = f16_scale(absmax / np.float32(127))
            scales[sl] = s
            q[sl] = np.clip(np.rint(blk / s[:, None]), -128, 127).astype(np.int8)
        return q.tobytes() + f32_to_f16_bits(scales).astype("<u2").tobytes()

    def _parts(self, buf: Buffer, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        shape = check_shape(shape)
        out, cols = require_2d(self.id, shape)
        data = as_bytes_array(buf)
        self.validate(data, shape)
        q = data[:out * cols].view(np.int8).reshape(out, cols)
        return q, f16_at(data, out * cols, out)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        q, s = self._parts(buf, shape)
        out = _outputs.empty(q.shape, np.float32)
        _fast.q8_decode(q, s, np.empty(0, np.float32), out)
        return out

    def decode_rows(self, buf, shape, rows):
        q, s = self._parts(buf, shape)
        _, _, rows = row_block(check_shape(shape), rows)
        return q[rows].astype(np.float32) * s[rows, None]


def column_field(w: np.ndarray) -> np.ndarray:
    """q8_2f column field: RMS over rows in f64 (fixed 256-row partial sums), f16-rounded, floored."""
    out, cols = w.shape
    acc = np.zeros(cols, dtype=np.float64)
    for start in range(0, out, _COL_BLOCK):
        blk = w[start:start + _COL_BLOCK].astype(np.float64)
        acc += np.einsum("ij,ij->j", blk, blk)
    rms = np.maximum(np.sqrt(acc / max(out, 1)), 1e-12).astype(np.float32)
    return np.maximum(f16_round(rms), F16_TINY)


class Q82fCodec(Codec):
    """``q8_2f`` (two fields): ``w = q[o,i]·scale[o]·col[i]``, q in [-127, 127]."""

    id = Dtype.Q8_2F

    def encode(self, array: np.ndarray) -> bytes:
        w = as_f32(array)
        out, cols = require_2d(self.id, w.shape)
        col = column_field(w)
        q = np.empty((out, cols), dtype=np.int8)
        scales = np.empty(out, dtype=np.float32)
        for sl in row_chunks(out, cols):
            u = w[sl] / col[None, :]
            absmax = np.abs(u).max(axis=1) if cols else np.zeros(u.shape[0], np.float32)
            s = f16_scale(np.maximum(absmax, np.float32(1e-12)) / np.float32(127))
            scales[sl] = s
            q[sl] = np.clip(np.rint(u / s[:, None]), -127, 127).astype(np.int8)
        return (q.tobytes() + f32_to_f16_bits(scales).astype("<u2").tobytes()
                + f32_to_f16_bits(col).astype("<u2").tobytes())

    def _parts(self, buf: Buffer, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = check_shape(shape)
        out, cols = require_2d(self.id, shape)
        data = as_bytes_array(buf)
        self.validate(data, shape)
        q = data[:out * cols].view(np.int8).reshape(out, cols)
        return q, f16_at(data, out * cols, out), f16_at(data, out * cols + 2 * out, cols)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        q, s, col = self._parts(buf, shape)
        out = _outputs.empty(q.shape, np.float32)
        _fast.q8_decode(q, s, col, out)  # (q·s)·col, the reference's evaluation order
        return out

    def decode_rows(self, buf, shape, rows):
        q, s, col = self._parts(buf, shape)
        _, _, rows = row_block(check_shape(shape), rows)
        res = q[rows].astype(np.float32)
        res *= s[rows, None]  # (q·s)·col, the reference's evaluation order
        res *= col[None, :]
        return res
