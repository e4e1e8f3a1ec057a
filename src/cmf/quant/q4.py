"""4-bit group dtypes: ``q4_block`` (nibbles, then scales) and ``q4_tiled`` (18-byte tiles).

Both hold the same values: groups of 32 over the flattened tensor, one f16 scale per group;
byte k of a group holds element 2k in the low nibble and 2k+1 in the high nibble;
``w = (q - 8)·s``. The reference encoder takes ``s = f16_scale(absmax/7)``,
``q = clamp(round(w/s), -8, 7) + 8``; the default ``mse`` encoder (``cmf.quant.mse``) picks a
signed scale per group that minimises the group's weighted squared error.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..format.constants import GROUP, Dtype
from ..format.dtypes import numel
from . import _fast, _outputs, mse
from .base import (Buffer, Codec, as_bytes_array, as_f32, check_shape, expand_ranges, f16_at, require_2d,
                   row_block)
from .float import f16_scale, f32_to_f16_bits

# byte -> (low nibble - 8, high nibble - 8): one gather decodes two weights.
NIBBLE_LUT = np.stack([(np.arange(256) & 15) - 8, (np.arange(256) >> 4) - 8], axis=1).astype(np.float32)
_GROUP_CHUNK = 1 << 17  # groups per encode step (4M weights)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(..., 32) codes in 0..15 -> (..., 16) bytes, element 2k low, 2k+1 high."""
    q = q.astype(np.uint8)
    return q[..., 0::2] | (q[..., 1::2] << np.uint8(4))


def quantize_groups(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(G, 32) f32 -> (scales f32 (G,), packed nibbles (G, 16))."""
    absmax = np.abs(g).max(axis=1)
    s = f16_scale(absmax / np.float32(7))
    q = np.clip(np.rint(g / s[:, None]), -8, 7) + 8
    return s, pack_nibbles(q)


def decode_nibbles(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(G, 16) nibble bytes and (G,) scales -> (G, 32) f32."""
    vals = NIBBLE_LUT[packed].reshape(packed.shape[0], GROUP)
    vals *= scales[:, None]
    return vals


def _grouped(w: np.ndarray) -> np.ndarray:
    """Flatten and zero-pad to whole groups: (G, 32)."""
    flat = w.reshape(-1)
    groups = -(-flat.size // GROUP)
    if flat.size != groups * GROUP:
        flat = np.concatenate([flat, np.zeros(groups * GROUP - flat.size, np.float32)])
    return flat.reshape(groups, GROUP)


def _encode_planes(w: np.ndarray, encoder: str | None,
                   importance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    cols = int(w.shape[-1]) if w.ndim else 1
    enc, imp = mse.options(encoder, importance, cols)
    g = _grouped(w)
    scales = np.empty(g.shape[0], np.float32)
    packed = np.empty((g.shape[0], 16), np.uint8)
    wt = mse.group_weights(imp, cols) if cols else np.ones((1, GROUP), np.float32)
    for start in range(0, g.shape[0], _GROUP_CHUNK):
        sl = slice(start, start + _GROUP_CHUNK)
        if enc == "reference":
            scales[sl], packed[sl] = quantize_groups(g[sl])
        else:
            scales[sl], q = mse.q4_groups(g[sl], wt, start)
            packed[sl] = pack_nibbles(q)
    return scales, packed


def _gather_rows(shape: tuple[int, ...], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Element -> (group, position) for the requested rows of a flattened group layout."""
    _, rowlen, _ = row_block(shape, rows)
    _, elem = expand_ranges(rows * rowlen, np.full(rows.size, rowlen, np.int64))
    return elem // GROUP, elem % GROUP, rowlen


class Q4BlockCodec(Codec):
    """``q4_block``: ``[16 B nibbles × G][f16 scale × G]``, G = ceil(n/32), any rank."""

    id = Dtype.Q4_BLOCK

    def encode(self, array: np.ndarray, encoder: str | None = None, importance: np.ndarray | None = None) -> bytes:
        """``encoder``: ``"mse"`` (default) or ``"reference"``; ``importance``: per input feature."""
        w = as_f32(array)
        scales, packed = _encode_planes(w, encoder, importance)
        return packed.tobytes() + f32_to_f16_bits(scales).astype("<u2").tobytes()

    def _parts(self, buf: Buffer, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        data = as_bytes_array(buf)
        self.validate(data, shape)
        groups = -(-numel(shape) // GROUP)
        return data[:16 * groups].reshape(groups, 16), f16_at(data, 16 * groups, groups)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        shape = check_shape(shape)
        packed, scales = self._parts(buf, shape)
        out = _outputs.empty((packed.shape[0], GROUP), np.float32)
        _fast.q4_groups_decode(packed, scales, out)
        return out.reshape(-1)[:numel(shape)].reshape(shape)

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        packed, scales = self._parts(buf, shape)
        _, _, rows = row_block(shape, rows)
        return _decode_elements(packed, scales, shape, rows)


def _decode_elements(packed: np.ndarray, scales: np.ndarray, shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
    """Rows of a flattened-group layout, element by element (groups may straddle rows)."""
    grp, pos, _ = _gather_rows(shape, rows)
    byte = packed[grp, pos >> 1]
    nib = np.where(pos & 1, byte >> 4, byte & 15).astype(np.float32) - 8
    return (nib * scales[grp]).reshape((rows.size,) + tuple(shape[1:]))


_TILE = np.dtype([("scale", "<f2"), ("q", "u1", (16,))])


class Q4TiledCodec(Codec):
    """``q4_tiled``: per 32-group ``[f16 scale][16 B nibbles]``; 2-D, ``in % 32 == 0``."""

    id = Dtype.Q4_TILED

    def encode(self, array: np.ndarray, encoder: str | None = None, importance: np.ndarray | None = None) -> bytes:
        """``encoder``: ``"mse"`` (default) or ``"reference"``; ``importance``: per input feature."""
        w = as_f32(array)
        require_2d(self.id, w.shape)
        scales, packed = _encode_planes(w, encoder, importance)
        tiles = np.empty(scales.shape[0], dtype=_TILE)
        tiles["scale"] = f32_to_f16_bits(scales).view(np.float16)
        tiles["q"] = packed
        return tiles.tobytes()

    def _tiles(self, buf: Buffer, shape: tuple[int, ...]) -> np.ndarray:
        require_2d(self.id, shape)
        data = as_bytes_array(buf)
        self.validate(data, shape)
        return data.view(_TILE)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        shape = check_shape(shape)
        data = self._tiles(buf, shape).view(np.uint8).reshape(-1, 18)
        out = _outputs.empty((data.shape[0], GROUP), np.float32)
        _fast.q4_tiles_decode(data, _fast.F16_TABLE, out)
        return out.reshape(shape)

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        tiles = self._tiles(buf, shape)
        rows_n, cols = shape
        _, _, rows = row_block(shape, rows)
        gpr = cols // GROUP
        t = tiles.reshape(rows_n, gpr)[rows].reshape(-1)
        return decode_nibbles(t["q"], t["scale"].astype(np.float32)).reshape(rows.size, cols)
