"""The codec protocol, the dtype registry and the small array helpers every codec shares.

A codec turns an f32 array into a dtype's payload bytes and back. Size and bounds rules live
once, in ``cmf.format.dtypes``; codecs delegate ``expected_nbytes`` and ``validate`` to it, so
the reader's open-time checks and the decoders can never disagree about a layout.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from ..format import dtypes as _dtypes
from ..format.constants import DTYPE_BY_LABEL, MAX_NDIM, Dtype
from ..format.errors import BoundsError, UnknownDtype, UnsupportedDtype

Buffer = Any  # bytes, bytearray, memoryview, mmap slice or a uint8 numpy array

# Names accepted besides the spec labels: the converter's --quant spellings (FORMATS.md).
ALIASES = {"q8": Dtype.Q8_ROW, "q4": Dtype.Q4_BLOCK, "q4t": Dtype.Q4_TILED, "q1p": Dtype.Q1}

# Encoders work on row chunks of about this many elements so temporaries stay bounded even for
# embedding-sized matrices (a few f32 temporaries of this size, ~16 MB each).
CHUNK_ELEMS = 1 << 22

_REGISTRY: dict[int, "Codec"] = {}


def resolve_dtype(dtype: Dtype | int | str) -> Dtype:
    """Turn a label (``"q4tp"``, ``"q8_row"``, aliases ``q8``/``q4``/``q4t``/``q1p``) or an id into a Dtype."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in DTYPE_BY_LABEL:
            return DTYPE_BY_LABEL[key]
        if key in ALIASES:
            return ALIASES[key]
        raise UnknownDtype(f"unknown dtype name {dtype!r}")
    try:
        return Dtype(int(dtype))
    except (ValueError, TypeError):
        raise UnknownDtype(f"unknown dtype id {dtype!r}", dtype_id=dtype if isinstance(dtype, int) else None) from None


def get_codec(dtype: Dtype | int | str) -> "Codec":
    """The registered codec for a dtype label or id."""
    d = resolve_dtype(dtype)
    try:
        return _REGISTRY[int(d)]
    except KeyError:  # pragma: no cover - every Dtype member is registered
        raise UnsupportedDtype(f"no codec for dtype {d.label}") from None


def registered() -> dict[Dtype, "Codec"]:
    """All registered codecs by dtype."""
    return {Dtype(k): v for k, v in sorted(_REGISTRY.items())}


class Codec:
    """One dtype's payload layout: size rules, validation, encoder and decoders.

    Subclasses set ``id`` and are registered automatically. ``decode`` returns float32 with
    the tensor's shape (for f32 it may be a read-only view of the buffer); ``decode_rows``
    decodes only the given indices of the first axis.
    """

    id: ClassVar[Dtype]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "id" in cls.__dict__:
            _REGISTRY[int(cls.id)] = cls()

    @property
    def name(self) -> str:
        """The dtype's label, e.g. ``q4tp``."""
        return self.id.label

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({int(self.id)})>"

    def expected_nbytes(self, shape: Sequence[int]) -> int | None:
        """Exact payload size for ``shape``, or None for variable-length dtypes."""
        return _dtypes.expected_nbytes(self.id, check_shape(shape))

    def validate(self, buf: Buffer, shape: Sequence[int], name: str = "?") -> None:
        """Raise BoundsError unless ``buf`` is a well-formed payload for ``shape``."""
        _dtypes.validate_payload(self.id, check_shape(shape), buf, name)

    def encode(self, array: np.ndarray, **options: Any) -> bytes:
        """Quantize an f32 array into this dtype's payload bytes."""
        raise NotImplementedError

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        """Decode a whole payload to float32 of ``shape``."""
        raise NotImplementedError

    def decode_rows(self, buf: Buffer, shape: Sequence[int], rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Decode only ``rows`` (indices of the first axis); shape ``(len(rows),) + shape[1:]``."""
        nrows, _, rows = row_block(check_shape(shape), rows)
        return self.decode(buf, shape).reshape(nrows, -1)[rows].reshape((len(rows),) + tuple(shape[1:]))


class ReservedCodec(Codec):
    """Reserved ids 5/6/7: a file may hold them, nothing may decode or write them."""

    def expected_nbytes(self, shape: Sequence[int]) -> int | None:
        return None

    def validate(self, buf: Buffer, shape: Sequence[int], name: str = "?") -> None:
        return None

    def _refuse(self) -> UnsupportedDtype:
        return UnsupportedDtype(f"dtype {self.name} (id {int(self.id)}) is reserved in CMF v2 and cannot be decoded or encoded")

    def encode(self, array: np.ndarray, **options: Any) -> bytes:
        raise self._refuse()

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        raise self._refuse()

    def decode_rows(self, buf: Buffer, shape: Sequence[int], rows: Sequence[int] | np.ndarray) -> np.ndarray:
        raise self._refuse()


class Mix84Codec(ReservedCodec):
    id = Dtype.MIX8_4


class U8Codec(ReservedCodec):
    id = Dtype.U8


class Q4ColCodec(ReservedCodec):
    id = Dtype.Q4_COL


# ---------------------------------------------------------------------------------------------
# helpers


def as_bytes_array(buf: Buffer) -> np.ndarray:
    """A flat uint8 view of ``buf`` (no copy for bytes, memoryview, mmap or contiguous arrays)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a tensor shape (≤ 6 non-negative dims) and return it as a tuple of ints."""
    try:
        out = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise BoundsError(f"shape {shape!r} is not a sequence of integers") from None
    if len(out) > MAX_NDIM or any(d < 0 for d in out):
        raise BoundsError(f"shape {list(out)} must have at most {MAX_NDIM} non-negative dims")
    return out


def require_2d(dtype: Dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a shape the dtype accepts; BoundsError naming the rule otherwise."""
    problem = _dtypes.shape_error(dtype, shape)
    if problem:
        raise BoundsError(problem)
    if len(shape) != 2:
        raise BoundsError(f"{dtype.label} needs a 2-D shape, got {list(shape)}")
    return int(shape[0]), int(shape[1])


def row_block(shape: tuple[int, ...], rows: Sequence[int] | np.ndarray) -> tuple[int, int, np.ndarray]:
    """(number of rows, elements per row, validated int64 row indices) for ``decode_rows``."""
    if not shape:
        raise BoundsError("decode_rows needs a tensor with at least one dimension")
    nrows = int(shape[0])
    rowlen = _dtypes.numel(shape[1:])
    idx = np.asarray(rows)
    if idx.dtype == bool or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise BoundsError("rows must be integer indices")
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= nrows):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise BoundsError(f"row index {bad} is outside 0..{nrows - 1}")
    return nrows, rowlen, idx


def as_f32(array: Any, *, finite: bool = True) -> np.ndarray:
    """The encoder input as a C-contiguous float32 array; quantizers refuse NaN and infinities."""
    a = np.ascontiguousarray(array, dtype=np.float32)
    if finite and a.size and not np.isfinite(a).all():
        raise ValueError("cannot quantize an array that contains NaN or infinity")
    return a


def row_chunks(nrows: int, rowlen: int, budget: int = CHUNK_ELEMS) -> Iterator[slice]:
    """Slices of whole rows with about ``budget`` elements each (at least one row)."""
    step = max(1, budget // max(rowlen, 1))
    for start in range(0, nrows, step):
        yield slice(start, min(nrows, start + step))


def seq_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Sum along ``axis`` strictly left to right in the array's dtype.

    The reference encoders accumulate f32 sums sequentially; numpy's pairwise ``sum`` can
    differ in the last bit, which would change a stored scale. ``cumsum`` is sequential.
    """
    x = np.moveaxis(x, axis, -1)
    if x.shape[-1] == 0:
        return np.zeros(x.shape[:-1], dtype=x.dtype)
    return np.cumsum(x, axis=-1, dtype=x.dtype)[..., -1]


def round_half_away(x: float) -> int:
    """Rust's ``f32::round`` (ties away from zero) for a non-negative value."""
    x = float(x)
    r = np.floor(x)
    return int(r + 1 if x - r >= 0.5 else r)


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten ranges ``[starts[i], starts[i]+counts[i])``: returns (owner i, position) per item."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    owner = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    pos = np.asarray(starts, dtype=np.int64)[owner] + (np.arange(total, dtype=np.int64) - first[owner])
    return owner, pos


def f16_at(data: np.ndarray, start: int, count: int) -> np.ndarray:
    """``count`` little-endian f16 values at byte ``start`` of ``data``, as float32."""
    return data[start:start + 2 * count].view("<f2").astype(np.float32)
