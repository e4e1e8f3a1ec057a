"""Payload size rules per dtype, checked at open time (REFERENCE_NOTES §1.1, §1.7).

This module knows byte layouts only well enough to bound them: which length a fixed-size dtype
must have, and which internal lengths/offsets of a variable-length payload must hold so that no
later decode can read outside the tensor's span. Decoding itself lives in ``cmf.quant``.
"""

from __future__ import annotations

import numpy as np

from .constants import GROUP, VBIT_WIDTHS, Dtype
from .errors import BoundsError

_VALID_WIDTH = np.zeros(256, dtype=bool)
_VALID_WIDTH[list(VBIT_WIDTHS)] = True


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements (1 for a 0-d shape)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a 2-D tensor; 1-D shapes are treated as one row."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    if len(shape) == 1:
        return 1, int(shape[0])
    raise ValueError(f"shape {shape} is not 1-D or 2-D")


def _code_bytes(gpr: int) -> int:
    return (5 * gpr + 7) // 8


def requires_2d_group(dtype: Dtype) -> bool:
    """Dtypes defined only for 2-D tensors whose column count is a multiple of 32."""
    return dtype in (
        Dtype.VBIT,
        Dtype.VBIT_RO,
        Dtype.Q4_TILED,
        Dtype.Q4TP,
        Dtype.Q2TP,
        Dtype.Q1,
        Dtype.Q1S,
        Dtype.Q1T,
    )


def shape_error(dtype: Dtype, shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` cannot be stored as ``dtype``, or None when it can."""
    if dtype in (Dtype.Q8_ROW, Dtype.Q8_2F) and len(shape) != 2:
        return f"{dtype.label} needs a 2-D shape, got {list(shape)}"
    if requires_2d_group(dtype):
        if len(shape) != 2:
            return f"{dtype.label} needs a 2-D shape, got {list(shape)}"
        if shape[1] % GROUP:
            return f"{dtype.label} needs columns % 32 == 0, got {shape[1]}"
        if dtype == Dtype.Q1T and shape[1] > 65536:
            return f"q1t needs columns <= 65536, got {shape[1]}"
    return None


def expected_nbytes(dtype: Dtype, shape: tuple[int, ...]) -> int | None:
    """Exact payload length of a fixed-size dtype, or None for variable/reserved dtypes.

    Raises BoundsError when the shape is impossible for the dtype (e.g. q8_row on 3-D).
    """
    dtype = Dtype(dtype)
    n = numel(shape)
    if dtype == Dtype.F32:
        return 4 * n
    if dtype in (Dtype.F16, Dtype.BF16):
        return 2 * n
    if dtype in (Dtype.MIX8_4, Dtype.U8, Dtype.Q4_COL) or dtype in (Dtype.VBIT, Dtype.VBIT_RO, Dtype.Q1S, Dtype.Q1T):
        return None
    problem = shape_error(dtype, shape)
    if problem:
        raise BoundsError(problem)
    groups = (n + GROUP - 1) // GROUP
    if dtype in (Dtype.Q4_BLOCK, Dtype.Q4_TILED):
        return 18 * groups
    if dtype == Dtype.Q1:
        return 6 * groups
    out, cols = int(shape[0]), int(shape[1])
    if dtype == Dtype.Q8_ROW:
        return n + 2 * out
    if dtype == Dtype.Q8_2F:
        return n + 2 * out + 2 * cols
    gpr = cols // GROUP
    if dtype == Dtype.Q4TP:
        return out * gpr * 16 + 4 * out + out * _code_bytes(gpr)
    if dtype == Dtype.Q2TP:
        return out * gpr * 8 + 4 * out + out * _code_bytes(gpr)
    raise AssertionError(f"unhandled dtype {dtype!r}")  # pragma: no cover


def vbit_layout(buf: memoryview | bytes | np.ndarray, shape: tuple[int, ...], *, row_offsets: bool,
                name: str = "?") -> tuple[np.ndarray, int, np.ndarray]:
    """Validate a vbit / vbit_ro payload and return (widths, scales_off, packed_row_starts).

    Reserved dtypes (including u8, whose size rule other tools do not enforce) return None
    from ``expected_nbytes``; scales start at ``scales_off`` (= rows).

    ``packed_row_starts`` has rows+1 entries, absolute offsets of each packed row within ``buf``.
    Raises BoundsError on any width outside {3,4,5,6,8}, a length mismatch or bad offsets.
    """
    label = "vbit_ro" if row_offsets else "vbit"
    problem = shape_error(Dtype.VBIT_RO if row_offsets else Dtype.VBIT, shape)
    if problem:
        raise BoundsError(f"tensor {name!r}: {problem}")
    rows, cols = int(shape[0]), int(shape[1])
    gpr = cols // GROUP
    data = np.frombuffer(buf, dtype=np.uint8)
    total = data.size
    head = rows + 2 * rows * gpr
    if total < head:
        raise BoundsError(f"tensor {name!r}: {label} payload of {total} B is shorter than its "
                          f"widths and scales ({head} B)")
    widths = data[:rows]
    if rows and not _VALID_WIDTH[widths].all():
        bad = int(widths[~_VALID_WIDTH[widths]][0])
        raise BoundsError(f"tensor {name!r}: {label} row width {bad} is not one of {VBIT_WIDTHS}")
    row_bytes = (widths.astype(np.int64) * cols + 7) // 8
    ends = np.cumsum(row_bytes)
    if row_offsets:
        off_start = head
        off_end = off_start + 4 * (rows + 1)
        if total < off_end:
            raise BoundsError(f"tensor {name!r}: vbit_ro payload too short for its offset table")
        offsets = data[off_start:off_end].view("<u4").astype(np.int64)
        if offsets[0] != 0:
            raise BoundsError(f"tensor {name!r}: vbit_ro offsets[0] = {int(offsets[0])}, expected 0")
        if not np.array_equal(offsets[1:], ends):
            raise BoundsError(f"tensor {name!r}: vbit_ro row offsets do not match the row widths")
        packed = off_end
    else:
        packed = head
    span = int(ends[-1]) if rows else 0
    if total != packed + span:
        raise BoundsError(f"tensor {name!r}: {label} payload is {total} B, widths imply {packed + span} B")
    starts = np.empty(rows + 1, dtype=np.int64)
    starts[0] = packed
    starts[1:] = packed + ends
    return widths, rows, starts


def q1s_overlay_count(buf: memoryview | bytes | np.ndarray, shape: tuple[int, ...], name: str = "?") -> int:
    """Validate a q1s payload's bounds and return its outlier count."""
    problem = shape_error(Dtype.Q1S, shape)
    if problem:
        raise BoundsError(f"tensor {name!r}: {problem}")
    n = numel(shape)
    base = 6 * ((n + GROUP - 1) // GROUP)
    data = np.frombuffer(buf, dtype=np.uint8)
    if data.size < base + 4:
        raise BoundsError(f"tensor {name!r}: q1s payload of {data.size} B is shorter than its base "
                          f"({base} B) and count")
    count = int(data[base:base + 4].view("<u4")[0])
    if data.size != base + 4 + 6 * count:
        raise BoundsError(f"tensor {name!r}: q1s payload is {data.size} B, its count of {count} "
                          f"outliers implies {base + 4 + 6 * count} B")
    if count:
        entries = data[base + 4:].reshape(count, 6)
        idx = entries[:, :4].copy().view("<u4").ravel()
        if int(idx.max()) >= n:
            raise BoundsError(f"tensor {name!r}: q1s outlier index {int(idx.max())} is past {n} elements")
    return count


def q1t_row_ptr(buf: memoryview | bytes | np.ndarray, shape: tuple[int, ...], name: str = "?") -> np.ndarray:
    """Validate a q1t payload's bounds and return its row_ptr array (rows+1 entries)."""
    problem = shape_error(Dtype.Q1T, shape)
    if problem:
        raise BoundsError(f"tensor {name!r}: {problem}")
    rows, cols = int(shape[0]), int(shape[1])
    base = 9 * rows * (cols // GROUP)
    data = np.frombuffer(buf, dtype=np.uint8)
    ptr_end = base + 4 * (rows + 1)
    if data.size < ptr_end:
        raise BoundsError(f"tensor {name!r}: q1t payload of {data.size} B is shorter than its base "
                          f"and row_ptr ({ptr_end} B)")
    row_ptr = data[base:ptr_end].view("<u4").astype(np.int64)
    if row_ptr[0] != 0 or (rows and np.any(np.diff(row_ptr) < 0)):
        raise BoundsError(f"tensor {name!r}: q1t row_ptr is not monotonic from 0")
    count = int(row_ptr[-1])
    if data.size != ptr_end + 4 * count:
        raise BoundsError(f"tensor {name!r}: q1t payload is {data.size} B, row_ptr implies "
                          f"{ptr_end + 4 * count} B")
    if count:
        cols_idx = data[ptr_end:].reshape(count, 4)[:, :2].copy().view("<u2").ravel()
        if int(cols_idx.max()) >= cols:
            raise BoundsError(f"tensor {name!r}: q1t outlier column {int(cols_idx.max())} is past {cols}")
    return row_ptr


def validate_payload(dtype: Dtype, shape: tuple[int, ...], buf: memoryview | bytes | np.ndarray,
                     name: str = "?") -> None:
    """Check that ``buf`` is a well-formed payload of ``dtype`` and ``shape``; raise BoundsError if not.

    Fixed-size dtypes: exact length. vbit/vbit_ro: widths, offsets and total length. q1s/q1t:
    internal counts, pointers and indices stay inside the payload and the tensor.
    Reserved dtypes are not checked (they open but never decode).
    """
    dtype = Dtype(dtype)
    nbytes = len(buf) if not isinstance(buf, np.ndarray) else buf.nbytes
    if dtype in (Dtype.VBIT, Dtype.VBIT_RO):
        vbit_layout(buf, shape, row_offsets=dtype == Dtype.VBIT_RO, name=name)
    elif dtype == Dtype.Q1S:
        q1s_overlay_count(buf, shape, name)
    elif dtype == Dtype.Q1T:
        q1t_row_ptr(buf, shape, name)
    else:
        try:
            expected = expected_nbytes(dtype, shape)
        except BoundsError as exc:
            raise BoundsError(f"tensor {name!r}: {exc}") from None
        if expected is not None and nbytes != expected:
            raise BoundsError(f"tensor {name!r}: {dtype.label} {list(shape)} needs {expected} B, "
                              f"the directory says {nbytes} B")
