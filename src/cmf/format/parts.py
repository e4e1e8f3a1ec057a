"""The files of a CMF set, one at a time: mapping a file, parsing and validating its envelope,
header and directory (every record's bounds, alignment, shape and payload length; REFERENCE_NOTES
§1.1), the section hashes ``verify()`` checks, and finding a shard set's siblings.
:mod:`.reader` builds a :class:`~cmf.format.reader.CmfFile` on these parts."""

from __future__ import annotations

import builtins
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .constants import GROUP, LARGE_TENSOR_ALIGN, TENSOR_ALIGN, VARIABLE_DTYPES, Dtype
from .directory import decode_directory
from .dtypes import validate_payload
from .envelope import Envelope, unpack_envelope
from .errors import BoundsError, FileNotFound, IoError, MissingShard, ParseError, ShardError
from .hash64 import hash64
from .header import Header, parse_header

log = logging.getLogger(__name__)

SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.cmf$")
_ = LARGE_TENSOR_ALIGN  # alignment of large tensors is a writer convention, not a reader check

# Dtypes that exist only for 2-D matrices, and those that also need columns % 32 == 0.
_NEEDS_2D = np.zeros(256, dtype=bool)
_NEEDS_2D[[Dtype.Q8_ROW, Dtype.Q8_2F, Dtype.VBIT, Dtype.VBIT_RO, Dtype.Q4_TILED, Dtype.Q1, Dtype.Q1S,
           Dtype.Q1T, Dtype.Q4TP, Dtype.Q2TP]] = True
_NEEDS_GROUP = _NEEDS_2D.copy()
_NEEDS_GROUP[[Dtype.Q8_ROW, Dtype.Q8_2F]] = False


def shard_name(stem: str, no: int, count: int) -> str:
    """File name of shard ``no`` of ``count``: ``{stem}-{no:05}-of-{count:05}.cmf``."""
    return f"{stem}-{no:05d}-of-{count:05d}.cmf"


@dataclass
class Part:
    """One physical file of a (possibly sharded) set."""

    path: Path
    size: int
    mm: mmap.mmap | None
    u8: np.ndarray
    envelope: Envelope
    header: Header
    header_bytes: bytes
    records: np.ndarray
    names: list[str]


def map_file(path: Path) -> tuple[mmap.mmap | None, np.ndarray, int]:
    try:
        with builtins.open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return None, np.zeros(0, dtype=np.uint8), 0
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise FileNotFound(f"{path}: no such file") from None
    except IsADirectoryError:
        raise IoError(f"{path}: is a directory, not a CMF file") from None
    except OSError as exc:
        raise IoError(f"{path}: {exc.strerror or exc}") from None
    try:
        mm.madvise(mmap.MADV_RANDOM)  # tensors are read where needed, not sequentially
    except (AttributeError, OSError):  # pragma: no cover - platform without madvise
        pass
    return mm, np.frombuffer(mm, dtype=np.uint8), size


def _check_tensors(rec: np.ndarray, names: list[str], data_len: int, u8: np.ndarray, data_off: int,
                   where: str) -> None:
    """Vectorized bounds, alignment, shape and payload-length checks of every record."""
    if rec.size == 0:
        return
    off = rec["off"]
    nbytes = rec["nbytes"]

    def fail(mask: np.ndarray, msg: Callable[[int], str]) -> None:
        bad = np.flatnonzero(mask)
        if bad.size:
            raise BoundsError(where + msg(int(bad[0])))

    fail(off % TENSOR_ALIGN != 0,
         lambda i: f"tensor {names[i]!r}: offset {int(off[i])} is not {TENSOR_ALIGN}-byte aligned")
    dl = np.uint64(data_len)
    too_big = (nbytes > dl) | (off > dl - np.minimum(nbytes, dl))
    fail(too_big, lambda i: f"tensor {names[i]!r}: [{int(off[i])}, +{int(nbytes[i])}) runs past the data "
                            f"section ({data_len} bytes)")
    ndim = rec["ndim"].astype(np.int64)
    dims = rec["shape"].astype(np.int64)
    used = np.arange(6)[None, :] < ndim[:, None]
    dims = np.where(used, dims, 1)
    approx = np.prod(dims.astype(np.float64), axis=1)
    # 2**56 elements (72 PB of q1) is beyond any real file and keeps every size formula below in int64.
    fail(approx >= 2.0 ** 56, lambda i: f"tensor {names[i]!r}: shape {dims[i, :ndim[i]].tolist()} overflows")
    n = np.prod(dims, axis=1)
    dt = rec["dtype"].astype(np.int64)
    two_d = ndim == 2
    rows = np.where(two_d, dims[:, 0], 1)
    cols = np.where(two_d, dims[:, 1], 1)
    fail(_NEEDS_2D[dt] & ~two_d,
         lambda i: f"tensor {names[i]!r}: {Dtype(int(dt[i])).label} needs a 2-D shape, got "
                   f"{dims[i, :ndim[i]].tolist()}")
    fail(_NEEDS_GROUP[dt] & (cols % GROUP != 0),
         lambda i: f"tensor {names[i]!r}: {Dtype(int(dt[i])).label} needs columns % 32 == 0, got {int(cols[i])}")
    groups = (n + GROUP - 1) // GROUP
    gpr = cols // GROUP
    codes = (5 * gpr + 7) // 8
    expected = np.full(rec.size, -1, dtype=np.int64)
    table = {
        Dtype.F32: 4 * n, Dtype.F16: 2 * n, Dtype.BF16: 2 * n,
        Dtype.Q8_ROW: n + 2 * rows, Dtype.Q8_2F: n + 2 * rows + 2 * cols,
        Dtype.Q4_BLOCK: 18 * groups, Dtype.Q4_TILED: 18 * groups, Dtype.Q1: 6 * groups,
        Dtype.Q4TP: rows * gpr * 16 + 4 * rows + rows * codes,
        Dtype.Q2TP: rows * gpr * 8 + 4 * rows + rows * codes,
    }
    for d, values in table.items():
        sel = dt == d
        expected[sel] = values[sel]
    nb = nbytes.astype(np.int64)
    fail((expected >= 0) & (expected != nb),
         lambda i: f"tensor {names[i]!r}: {Dtype(int(dt[i])).label} {dims[i, :ndim[i]].tolist()} needs "
                   f"{int(expected[i])} bytes, the directory says {int(nb[i])}")
    for i in np.flatnonzero(np.isin(dt, [int(d) for d in VARIABLE_DTYPES])).tolist():
        start = data_off + int(off[i])
        shape = tuple(int(x) for x in dims[i, :ndim[i]])
        try:
            validate_payload(Dtype(int(dt[i])), shape, u8[start:start + int(nb[i])], names[i])
        except BoundsError as exc:
            raise BoundsError(where + str(exc)) from None


def open_part(path: Path) -> Part:
    mm, u8, size = map_file(path)
    try:
        return _parse_part(path, mm, u8, size)
    except BaseException:
        del u8
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # pragma: no cover - a view escaped; the GC closes it
                pass
        raise


def _parse_part(path: Path, mm: mmap.mmap | None, u8: np.ndarray, size: int) -> Part:
    where = f"{path}: "
    env = unpack_envelope(u8[:128].tobytes() if size >= 128 else b"", size, str(path))
    hs = env.section("header")
    from .constants import MAX_HEADER_BYTES

    if hs.len > MAX_HEADER_BYTES:
        raise ParseError(f"{where}header JSON is {hs.len} bytes, over the {MAX_HEADER_BYTES >> 20} MiB cap")
    header_bytes = u8[hs.off:hs.end].tobytes()
    try:
        header = parse_header(header_bytes)
    except ParseError as exc:
        raise ParseError(f"{where}header: {exc}") from None
    ds = env.section("dir")
    records, names = decode_directory(u8[ds.off:ds.end].data, where)
    data = env.section("data")
    _check_tensors(records, names, data.len, u8, data.off, where)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise ParseError(f"{where}duplicate tensor name {n!r} in the directory")
            seen.add(n)
    return Part(path=path, size=size, mm=mm, u8=u8, envelope=env, header=header,
                 header_bytes=header_bytes, records=records, names=names)


def verify_sections(part: Part) -> list[str]:
    problems = []
    env = part.envelope
    tag = f"{part.path.name}: "
    for name, stored in (("header", env.header_hash), ("dir", env.dir_hash)):
        s = env.section(name)
        if stored and s.len:
            got = hash64(part.u8[s.off:s.end])
            if got != stored:
                problems.append(f"{tag}{name} hash64 {got:016x} != envelope {stored:016x}")
    for name, text in part.header.section_hashes.items():
        if name not in ("masks", "vocab", "index"):
            continue
        try:
            stored = int(str(text), 16)
            if not 0 <= stored < 1 << 64:
                raise ValueError
        except ValueError:
            problems.append(f"{tag}section_hashes.{name} is a malformed hash: {str(text)[:40]!r}")
            continue
        s = env.section(name)
        if stored and s.len:
            got = hash64(part.u8[s.off:s.end])
            if got != stored:
                problems.append(f"{tag}{name} section hash64 {got:016x} != header {stored:016x}")
    return problems


def shard_set(path: Path, first: Part) -> list[Part]:
    shard = first.header.shard
    count = shard.count
    m = SHARD_RE.match(path.name)
    if not m:
        # Not a set: `cortiq compact` of a shard set writes one file that keeps the input's shard
        # block verbatim (moedefrag.rs cmd_compact); only a shard name makes siblings to look for.
        log.info("%s: header says shard %d of %d, but the name is not '<stem>-NNNNN-of-NNNNN.cmf': "
                 "opened as a single file", path, shard.no, count)
        return [first]
    if int(m["count"]) != count or int(m["no"]) != shard.no:
        raise ShardError(f"{path}: file name says shard {int(m['no'])} of {int(m['count'])}, header says "
                         f"{shard.no} of {count}")
    siblings = {no: path.with_name(shard_name(m["stem"], no, count)) for no in range(1, count + 1)}
    missing = [no for no, p in siblings.items() if no != shard.no and not p.exists()]
    if missing:
        names = ", ".join(siblings[no].name for no in missing)
        raise MissingShard(f"{path}: shard {shard.no} of {count}: {len(missing)} sibling(s) missing ({names}); "
                           f"the set cannot run without them (`cmf verify` checks this shard alone)",
                           no=shard.no, count=count, missing=tuple(missing))
    parts: list[Part] = []
    try:
        for no, p in siblings.items():
            part = first if no == shard.no else open_part(p)
            s = part.header.shard
            if s is None or s.count != count or s.no != no:
                got = "no shard block" if s is None else f"shard {s.no} of {s.count}"
                raise ShardError(f"{p}: expected shard {no} of {count}, its header says {got}")
            parts.append(part)
    except BaseException:
        for part in parts:
            if part is not first and part.mm is not None:
                part.u8 = np.zeros(0, dtype=np.uint8)
                try:
                    part.mm.close()
                except BufferError:  # pragma: no cover
                    pass
        raise
    return parts
