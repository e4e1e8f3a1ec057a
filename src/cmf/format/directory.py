"""The binary tensor directory (spec §3, REFERENCE_NOTES §1.3).

``[u64 count][u64 pool_off][count × 56-byte records][UTF-8 name pool]``. Records are decoded with a
numpy structured dtype in one call; all numeric checks are vectorized.
"""

from __future__ import annotations

import numpy as np

from .constants import DIR_PREFIX, DIR_RECORD_SIZE, MAX_DTYPE, MAX_NDIM, MAX_TENSORS
from .errors import ParseError, UnknownDtype

RECORD_DTYPE = np.dtype(
    {
        "names": ["name_off", "name_len", "dtype", "ndim", "shape", "off", "nbytes", "hash"],
        "formats": ["<u4", "<u2", "u1", "u1", ("<u4", (6,)), "<u8", "<u8", "<u8"],
        "offsets": [0, 4, 6, 7, 8, 32, 40, 48],
        "itemsize": DIR_RECORD_SIZE,
    }
)


def decode_directory(buf: bytes | memoryview, where: str = "") -> tuple[np.ndarray, list[str]]:
    """Decode a directory section into (records, names), raising ParseError / UnknownDtype.

    ``records`` is a structured array of RECORD_DTYPE (a copy, independent of ``buf``); names are
    decoded once. Bounds of tensor payloads are checked by the reader, which knows data_len.
    """
    dir_len = len(buf)
    if dir_len < DIR_PREFIX:
        raise ParseError(f"{where}directory is {dir_len} bytes, shorter than its 16-byte prefix")
    count, pool_off = np.frombuffer(buf, dtype="<u8", count=2).tolist()
    if count > MAX_TENSORS or count * DIR_RECORD_SIZE > dir_len:
        raise ParseError(f"{where}directory count {count} needs {count * DIR_RECORD_SIZE} bytes of records "
                         f"but the directory is {dir_len} bytes")
    records_end = DIR_PREFIX + count * DIR_RECORD_SIZE
    if records_end > dir_len:
        raise ParseError(f"{where}directory records end at {records_end}, past the directory ({dir_len} B)")
    if pool_off > dir_len or pool_off < records_end:
        raise ParseError(f"{where}directory pool_off {pool_off} is outside [{records_end}, {dir_len}]")
    rec = np.frombuffer(buf, dtype=RECORD_DTYPE, count=count, offset=DIR_PREFIX).copy()
    if count == 0:
        return rec, []
    bad = np.flatnonzero(rec["ndim"] > MAX_NDIM)
    if bad.size:
        i = int(bad[0])
        raise ParseError(f"{where}directory record {i}: ndim {int(rec['ndim'][i])} > {MAX_NDIM}")
    pool_len = dir_len - pool_off
    name_end = rec["name_off"].astype(np.int64) + rec["name_len"].astype(np.int64)
    bad = np.flatnonzero(name_end > pool_len)
    if bad.size:
        i = int(bad[0])
        raise ParseError(f"{where}directory record {i}: name [{int(rec['name_off'][i])}, {int(name_end[i])}) "
                         f"is outside the {pool_len}-byte name pool")
    pool = bytes(buf[pool_off:dir_len])
    starts = rec["name_off"].tolist()
    ends = name_end.tolist()
    names: list[str] = []
    append = names.append
    for i, (a, b) in enumerate(zip(starts, ends)):
        try:
            append(pool[a:b].decode("utf-8"))
        except UnicodeDecodeError:
            raise ParseError(f"{where}directory record {i}: tensor name {pool[a:b][:64]!r} is not UTF-8") from None
    bad = np.flatnonzero(rec["dtype"] > MAX_DTYPE)
    if bad.size:
        i = int(bad[0])
        d = int(rec["dtype"][i])
        raise UnknownDtype(f"{where}tensor {names[i]!r}: unknown dtype id {d}", d)
    return rec, names


def encode_directory(names: list[str], dtypes: list[int], shapes: list[tuple[int, ...]],
                     offsets: list[int], nbytes: list[int], hashes: list[int]) -> bytes:
    """Build directory bytes: pool_off = 16 + 56·count, names concatenated in record order."""
    count = len(names)
    rec = np.zeros(count, dtype=RECORD_DTYPE)
    encoded = [n.encode("utf-8") for n in names]
    lens = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=count)
    name_off = np.zeros(count, dtype=np.int64)
    if count:
        name_off[1:] = np.cumsum(lens)[:-1]
    rec["name_off"] = name_off
    rec["name_len"] = lens
    rec["dtype"] = dtypes
    rec["ndim"] = [len(s) for s in shapes]
    shape_arr = np.zeros((count, 6), dtype=np.uint32)
    for i, s in enumerate(shapes):
        shape_arr[i, : len(s)] = s
    rec["shape"] = shape_arr
    rec["off"] = np.asarray(offsets, dtype=np.uint64)
    rec["nbytes"] = np.asarray(nbytes, dtype=np.uint64)
    rec["hash"] = np.asarray(hashes, dtype=np.uint64)
    prefix = np.array([count, DIR_PREFIX + DIR_RECORD_SIZE * count], dtype="<u8").tobytes()
    return prefix + rec.tobytes() + b"".join(encoded)
