"""The sparse index section (spec §7; REFERENCE_NOTES §1.10). Deprecation-pending: read for old
files, written only for compatibility (nothing executes from it).

``[u32 n_entries][u32 reserved = 0]`` then per entry ``[u32 task_id][u32 layer][u32 n_groups]
[u32 n_heads][u16 × n_groups][u8 × n_heads]`` zero-padded to a multiple of 4 (section-relative).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .constants import GROUP
from .errors import ParseError, WriterError
from .header import Arch, Header, as_arch
from .masks import MaskSet

__all__ = ["SparseIndexEntry", "build_sparse_index", "decode_sparse_index", "encode_sparse_index",
           "index_entries"]

_ENTRY_HEAD = 16


@dataclass(eq=False)
class SparseIndexEntry:
    """Active FFN quant groups (32 neurons each) and heads of one (task, layer) pair."""

    task_id: int
    layer: int
    groups: np.ndarray  # uint16, sorted
    heads: np.ndarray  # uint8, sorted

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparseIndexEntry):
            return NotImplemented
        return (self.task_id, self.layer) == (other.task_id, other.layer) and \
            np.array_equal(self.groups, other.groups) and np.array_equal(self.heads, other.heads)

    __hash__ = None  # type: ignore[assignment]


def decode_sparse_index(buf: bytes | bytearray | memoryview) -> list[SparseIndexEntry]:
    """Decode a sparse index section; any truncation or inconsistency raises :class:`ParseError`."""
    n = memoryview(buf).nbytes
    if n < 8:
        raise ParseError(f"sparse index: {n} bytes, shorter than its 8-byte prefix")
    count, reserved = struct.unpack_from("<II", buf, 0)
    if reserved != 0:
        raise ParseError(f"sparse index: reserved field is {reserved}, must be 0")
    # Every entry takes at least 16 bytes: refuse an impossible count before looping on it.
    if count > (n - 8) // _ENTRY_HEAD:
        raise ParseError(f"sparse index: {count} entries cannot fit in {n} bytes")
    # Validate every entry first, then build arrays: no numpy view of `buf` exists while an error
    # can still be raised (a traceback would otherwise pin the caller's mmap).
    spans = []
    pos = 8
    for i in range(count):
        if pos + _ENTRY_HEAD > n:
            raise ParseError(f"sparse index: entry {i} header at offset {pos} is truncated")
        task_id, layer, n_groups, n_heads = struct.unpack_from("<4I", buf, pos)
        body = pos + _ENTRY_HEAD
        end = body + 2 * n_groups + n_heads
        padded = end + (-end % 4)
        if padded > n:
            raise ParseError(f"sparse index: entry {i} (task {task_id}, layer {layer}) with "
                             f"{n_groups} groups and {n_heads} heads runs past the section "
                             f"({padded} > {n})")
        spans.append((task_id, layer, body, n_groups, n_heads))
        pos = padded
    out = []
    for task_id, layer, body, n_groups, n_heads in spans:
        groups = np.frombuffer(buf, dtype="<u2", count=n_groups, offset=body).astype(np.uint16)
        heads = np.frombuffer(buf, dtype=np.uint8, count=n_heads,
                              offset=body + 2 * n_groups).copy()
        out.append(SparseIndexEntry(task_id, layer, groups, heads))
    return out


def encode_sparse_index(entries: list[SparseIndexEntry]) -> bytes:
    """Serialize entries in the given order, each padded to 4 bytes."""
    out = bytearray(struct.pack("<II", len(entries), 0))
    for e in entries:
        groups = np.asarray(e.groups)
        heads = np.asarray(e.heads)
        if groups.size and (groups.min() < 0 or groups.max() > 0xFFFF):
            raise WriterError(f"sparse index: group index out of u16 range (task {e.task_id})")
        if heads.size and (heads.min() < 0 or heads.max() > 0xFF):
            raise WriterError(f"sparse index: head index out of u8 range (task {e.task_id})")
        if not (0 <= e.task_id <= 0xFFFFFFFF and 0 <= e.layer <= 0xFFFFFFFF):
            raise WriterError(f"sparse index: task {e.task_id} / layer {e.layer} exceed u32")
        out += struct.pack("<4I", e.task_id, e.layer, groups.size, heads.size)
        out += groups.astype("<u2").tobytes()
        out += heads.astype(np.uint8).tobytes()
        out += bytes(-len(out) % 4)
    return bytes(out)


def index_entries(maskset: MaskSet, arch: Arch | Header | Mapping[str, Any]) -> list[SparseIndexEntry]:
    """Entries derived from masks: one per alive layer of each mask, from its first-pass rows."""
    a = as_arch(arch)
    n_layers, n_heads, inter = a.num_layers, a.num_attention_heads, a.intermediate_size
    n_groups = -(-inter // GROUP)
    if n_groups > 0x10000 or n_heads > 0x100:
        # The reference silently wraps these into u16/u8; a wrong index is worse than none.
        raise WriterError(f"sparse index: {n_groups} FFN groups or {n_heads} heads exceed u16/u8")
    out = []
    for m in maskset.masks:
        # Group g covers bitfield bytes 4g..4g+3, i.e. neurons 32g..32g+31 (tail bits are zero).
        ffn = np.zeros((n_layers, n_groups * GROUP), dtype=bool)
        ffn[:, :inter] = np.asarray(m.ffn, dtype=bool)[:n_layers]
        active = ffn.reshape(n_layers, n_groups, GROUP).any(axis=2)
        heads = np.asarray(m.heads, dtype=bool)
        for layer in range(n_layers):
            if not m.layer_alive(layer):
                continue
            out.append(SparseIndexEntry(
                int(m.task_id), layer, np.flatnonzero(active[layer]).astype(np.uint16),
                np.flatnonzero(heads[layer]).astype(np.uint8)))
    return out


def build_sparse_index(maskset: MaskSet, arch: Arch | Header | Mapping[str, Any]) -> bytes:
    """The sparse index section bytes for ``maskset`` (what the reference writer emits)."""
    return encode_sparse_index(index_entries(maskset, arch))
