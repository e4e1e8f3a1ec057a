"""Row and column subsets of a stored matrix, in its own dtype: ``W[rows]`` or ``W[:, cols]``
as a new payload.

A task mask's FFN bitfield selects neurons: a neuron is a ROW of ``gate_proj``/``up_proj`` and a
COLUMN of ``down_proj``. The runtime multiplies only the live ones; to do that at full kernel
speed it gathers them once per task into a small payload of the same dtype and runs the
ordinary fused kernel on it (and the mapped pages of the full matrices can then be given back).

Rows (:func:`gather_rows`) are exact for every dtype whose rows are separate byte ranges: f32,
f16, bf16, q8_row, q8_2f (the column field is shared), q4_tiled, q4_block (whole-row groups),
q1, q4tp, q2tp (planes, ladder params and code bytes per row). vbit, vbit_ro, q1s and q1t: None.

Columns (:func:`gather_columns`):

- Element gather (exact, only live bytes are read): f32, f16, bf16, q8_row (per-row scales are
  kept), q8_2f (per-row scales and the gathered per-column field).
- Group gather (exact): q4_tiled, q4_block (whole-row groups), q1, q4tp, q2tp keep every 32-column
  group that holds a live column, with its own scale (or ladder code); a dead neuron inside a kept
  group gets a zero activation, so its weight still contributes nothing.
- Anything else (vbit, vbit_ro, q1s, q1t, q4_block with straddling groups): None — the caller
  decodes the live columns to float32 instead.

``positions`` maps the k-th live column to its column in the gathered matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..format.constants import GROUP, Dtype
from .base import Buffer, as_bytes_array, get_codec

__all__ = ["ColumnSubset", "RowSubset", "gather_columns", "gather_rows", "kept_column_fraction"]


@dataclass(frozen=True)
class ColumnSubset:
    """A gathered payload: ``dtype`` and ``shape`` of the new matrix, its bytes, and where each
    requested column landed (``positions[k]`` = column of ``cols[k]``)."""

    dtype: Dtype
    shape: tuple[int, int]
    payload: np.ndarray  # uint8
    positions: np.ndarray  # int64, one per requested column


@dataclass(frozen=True)
class RowSubset:
    """A gathered payload of whole rows: ``dtype``, ``shape`` (live rows, columns) and its bytes."""

    dtype: Dtype
    shape: tuple[int, int]
    payload: np.ndarray  # uint8


def _checked(buf: Buffer, dtype: Dtype | int, shape: tuple[int, int], idx, limit: int,
             what: str) -> tuple[Dtype, np.ndarray, np.ndarray]:
    """(dtype, payload bytes, indices as int64) after checking that the indices are sorted, unique
    and below ``limit`` and that the payload is valid for ``shape``: a crafted payload must not
    steer the slicing that follows."""
    dt = Dtype(int(dtype))
    keep = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
    if keep.size and (keep[0] < 0 or keep[-1] >= limit or np.any(np.diff(keep) <= 0)):
        raise ValueError(f"{what} must be sorted, unique and in 0..{limit - 1}")
    u8 = as_bytes_array(buf)
    get_codec(dt).validate(u8, shape)
    return dt, u8, keep


def _rows_of(a: np.ndarray, rows: int, keep: np.ndarray) -> np.ndarray:
    """Rows ``keep`` of ``a`` viewed as [rows, -1] bytes, flattened."""
    return np.ascontiguousarray(a.reshape(rows, -1)[keep]).reshape(-1)


def gather_rows(buf: Buffer, dtype: Dtype | int, shape: Sequence[int],
                rows: Sequence[int] | np.ndarray) -> RowSubset | None:
    """``W[rows]`` of a stored 2-D payload in the same dtype (only those rows' bytes are read),
    or None when rows are not separate byte ranges (see the module docstring). ``rows`` must be
    sorted, unique and in range."""
    n_rows, n = (int(d) for d in shape)
    dt, u8, keep = _checked(buf, dtype, (n_rows, n), rows, n_rows, "rows")
    new_shape = (int(keep.size), n)
    if dt in (Dtype.F32, Dtype.F16, Dtype.BF16):
        size = 4 if dt == Dtype.F32 else 2
        return RowSubset(dt, new_shape, _rows_of(u8[:n_rows * n * size], n_rows, keep))
    if dt in (Dtype.Q8_ROW, Dtype.Q8_2F):
        end = n_rows * n + 2 * n_rows
        parts = [_rows_of(u8[:n_rows * n], n_rows, keep), _rows_of(u8[n_rows * n:end], n_rows, keep)]
        if dt == Dtype.Q8_2F:
            parts.append(u8[end:end + 2 * n])
        return RowSubset(dt, new_shape, np.concatenate(parts))
    if n % GROUP:
        return None  # groups straddle rows: a row is not a byte range of its own
    gpr = n // GROUP
    if dt in (Dtype.Q4_TILED, Dtype.Q1):
        tile = 18 if dt == Dtype.Q4_TILED else 6
        return RowSubset(dt, new_shape, _rows_of(u8[:n_rows * gpr * tile], n_rows, keep))
    if dt == Dtype.Q4_BLOCK:
        a = n_rows * gpr * 16
        return RowSubset(dt, new_shape, np.concatenate([_rows_of(u8[:a], n_rows, keep),
                                                        _rows_of(u8[a:a + n_rows * gpr * 2], n_rows, keep)]))
    if dt in (Dtype.Q4TP, Dtype.Q2TP):
        planes, params, codes = get_codec(dt).split(u8, (n_rows, n))
        return RowSubset(dt, new_shape, np.concatenate([
            _rows_of(planes, n_rows, keep), _rows_of(np.ascontiguousarray(params, "<u2").view(np.uint8), n_rows, keep),
            _rows_of(codes, n_rows, keep)]))
    return None


def _elements(u8: np.ndarray, rows: int, cols: int, itemsize: int, keep: np.ndarray) -> np.ndarray:
    """The kept columns of a row-major [rows, cols] array of ``itemsize``-byte elements."""
    return np.ascontiguousarray(u8[:rows * cols * itemsize].reshape(rows, cols, itemsize)[:, keep]).reshape(-1)


def _group_ids(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept group indices, position of each column in the gathered matrix)."""
    groups = np.unique(cols // GROUP)
    slot = np.searchsorted(groups, cols // GROUP)
    return groups, slot * GROUP + cols % GROUP


def kept_column_fraction(dtype: Dtype | int, n: int, cols: np.ndarray) -> float | None:
    """The fraction of a matrix's ``n`` stored columns that :func:`gather_columns` would keep for
    the sorted ``cols`` (whole 32-groups for the group dtypes), or None when it has no gather."""
    dt = Dtype(int(dtype))
    if n == 0:
        return None
    if dt in (Dtype.F32, Dtype.F16, Dtype.BF16, Dtype.Q8_ROW, Dtype.Q8_2F):
        return len(cols) / n
    if n % GROUP or dt not in (Dtype.Q4_TILED, Dtype.Q1, Dtype.Q4_BLOCK, Dtype.Q4TP, Dtype.Q2TP):
        return None
    return np.unique(np.asarray(cols, dtype=np.int64) // GROUP).size / (n // GROUP)


def gather_columns(buf: Buffer, dtype: Dtype | int, shape: Sequence[int],
                   cols: Sequence[int] | np.ndarray) -> ColumnSubset | None:
    """``W[:, cols]`` of a stored 2-D payload in the same dtype, or None when the dtype has no
    exact gather (see the module docstring). ``cols`` must be sorted, unique and in range."""
    rows, n = (int(d) for d in shape)
    dt, u8, cols = _checked(buf, dtype, (rows, n), cols, n, "columns")
    ident = np.arange(cols.size, dtype=np.int64)
    if dt in (Dtype.F32, Dtype.F16, Dtype.BF16):
        size = 4 if dt == Dtype.F32 else 2
        return ColumnSubset(dt, (rows, cols.size), _elements(u8, rows, n, size, cols), ident)
    if dt in (Dtype.Q8_ROW, Dtype.Q8_2F):
        q = _elements(u8, rows, n, 1, cols)
        row_scales = u8[rows * n:rows * n + 2 * rows]
        parts = [q, row_scales]
        if dt == Dtype.Q8_2F:
            parts.append(_elements(u8[rows * n + 2 * rows:], 1, n, 2, cols))
        return ColumnSubset(dt, (rows, cols.size), np.concatenate(parts), ident)
    if n % GROUP:
        return None  # groups straddle rows: no per-row group structure to gather
    gpr = n // GROUP
    groups, pos = _group_ids(cols)
    new_shape = (rows, groups.size * GROUP)
    if dt in (Dtype.Q4_TILED, Dtype.Q1):
        tile = 18 if dt == Dtype.Q4_TILED else 6
        tiles = u8[:rows * gpr * tile].reshape(rows, gpr, tile)[:, groups]
        return ColumnSubset(dt, new_shape, np.ascontiguousarray(tiles).reshape(-1), pos)
    if dt == Dtype.Q4_BLOCK:
        nib = u8[:rows * gpr * 16].reshape(rows, gpr, 16)[:, groups]
        scales = u8[rows * gpr * 16:rows * gpr * 18].reshape(rows, gpr, 2)[:, groups]
        return ColumnSubset(dt, new_shape, np.concatenate([nib.reshape(-1), scales.reshape(-1)]), pos)
    if dt in (Dtype.Q4TP, Dtype.Q2TP):
        from .ladder import pack_codes, unpack_codes

        planes, params, codes = get_codec(dt).split(u8, (rows, n))
        planes = np.ascontiguousarray(planes.reshape(rows, gpr, -1)[:, groups])
        new_codes = pack_codes(unpack_codes(codes, gpr)[:, groups])
        payload = np.concatenate([planes.reshape(-1), np.asarray(params, "<u2").view(np.uint8).reshape(-1),
                                  new_codes.reshape(-1)])
        return ColumnSubset(dt, new_shape, payload, pos)
    return None
