"""A bounds-checked pre-scan of a GGUF header, run before the file reaches the `gguf` package.

The `gguf` package trusts the counts it reads (gguf 0.19 loops for ever on a 43-byte file that
declares an array of 2**63 elements). This scanner walks the same structure with every count and
length checked against the bytes that remain, so a crafted file is refused at once with a message
that names the field and offset.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ConvertError


class GgufError(ConvertError):
    """A GGUF file is malformed, truncated or uses something we cannot import."""


# value type id → fixed size (strings and arrays are variable)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_DEPTH = 4


@dataclass(frozen=True)
class ScannedTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order (ne0 first)
    ggml_type: int
    offset: int  # relative to the data section
    nbytes: int


@dataclass(frozen=True)
class GgufScan:
    version: int
    n_kv: int
    tensors: list[ScannedTensor]
    data_offset: int
    alignment: int


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GgufError(f"{self.path}: {what} at offset {self.pos} needs {n} bytes, "
                            f"only {len(self.buf) - self.pos} remain")

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self, what: str) -> bytes:
        (n,) = self.unpack("<Q", f"{what} length")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype in _FIXED:
            self.need(_FIXED[vtype], what)
            fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}[vtype]
            return self.unpack(fmt, what)[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise GgufError(f"{self.path}: {what}: arrays nested deeper than {_MAX_DEPTH}")
            (itype,) = self.unpack("<I", f"{what} item type")
            (count,) = self.unpack("<Q", f"{what} count")
            if itype in _FIXED:
                self.need(count * _FIXED[itype], f"{what} ({count} items)")
                self.pos += count * _FIXED[itype]
                return None
            if itype not in (_STRING, _ARRAY):
                raise GgufError(f"{self.path}: {what}: unknown array item type {itype}")
            # every string or array item takes at least 8 bytes: bound the loop before running it
            self.need(count * 8, f"{what} ({count} items)")
            for i in range(count):
                self.skip_value(itype, f"{what}[{i}]", depth + 1)
            return None
        raise GgufError(f"{self.path}: {what}: unknown value type {vtype} at offset {self.pos - 4}")


@functools.lru_cache(maxsize=None)
def dequantizable(ttype: int) -> bool:
    """Whether the installed `gguf` package can dequantize ggml type ``ttype`` (probed on one zero
    block: its table of implemented types is private and differs between versions)."""
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType(ttype)
    _, size = gguf.GGML_QUANT_SIZES[qt]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), qt)
    except NotImplementedError:
        return False
    return True


def scan(path: str | Path) -> GgufScan:
    """Validate a GGUF file's header, metadata and tensor table against its size."""
    import gguf

    path = Path(path)
    try:
        data = path.read_bytes() if path.stat().st_size < (1 << 20) else None
    except OSError as exc:
        raise GgufError(f"{path}: {exc.strerror or exc}") from None
    if data is None:  # large file: map it instead of reading it all
        import mmap

        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(mm)
    else:
        buf = memoryview(data)
    try:
        return _scan(buf, str(path), gguf)
    finally:
        buf.release()


def _scan(buf: memoryview, where: str, gguf) -> GgufScan:
    c = _Cursor(buf, where)
    magic = bytes(buf[:4])
    if len(buf) < 4 or magic != b"GGUF":
        raise GgufError(f"{where}: not a GGUF file (magic {magic!r})")
    c.pos = 4
    (version,) = c.unpack("<I", "version")
    if version not in (2, 3):
        raise GgufError(f"{where}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.unpack("<QQ", "tensor and metadata counts")
    remaining = len(buf) - c.pos
    # each metadata entry needs ≥ 8 (key len) + 4 (type) + 1 bytes, each tensor info ≥ 8 + 4 + 4 + 8
    if n_kv * 13 > remaining or n_tensors * 24 > remaining:
        raise GgufError(f"{where}: header declares {n_kv} metadata entries and {n_tensors} tensors, "
                        f"more than {remaining} remaining bytes can hold")
    alignment = 32
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        (vtype,) = c.unpack("<I", f"type of {key[:64]!r}")
        value = c.skip_value(vtype, f"metadata {key[:64].decode('utf-8', 'replace')!r}")
        if key == b"general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1) or value > 1 << 20:
                raise GgufError(f"{where}: general.alignment {value!r} is not a power of two")
            alignment = value
    tensors = []
    for i in range(n_tensors):
        raw = c.string(f"tensor {i} name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{where}: tensor {i} name is not UTF-8") from None
        (ndim,) = c.unpack("<I", f"tensor {name!r} ndim")
        if ndim == 0 or ndim > _MAX_DIMS:
            raise GgufError(f"{where}: tensor {name!r} has {ndim} dimensions (1..{_MAX_DIMS})")
        dims = c.unpack(f"<{ndim}Q", f"tensor {name!r} dims")
        ttype, off = c.unpack("<IQ", f"tensor {name!r} type/offset")
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise GgufError(f"{where}: tensor {name!r} has unknown ggml type {ttype}") from None
        if not dequantizable(ttype):  # found by fuzzing: the import failed on it with NotImplementedError
            raise GgufError(f"{where}: tensor {name!r} has ggml type {gguf.GGMLQuantizationType(ttype).name}, "
                            f"which cannot be dequantized (the gguf package implements no decoder for it)")
        n = 1
        for d in dims:
            n *= d
        if n > 1 << 56 or dims[0] % block:
            raise GgufError(f"{where}: tensor {name!r} shape {list(dims)} is invalid for type {ttype}")
        tensors.append(ScannedTensor(name, tuple(int(d) for d in dims), int(ttype), int(off),
                                     n // block * type_size))
    data_offset = -(-c.pos // alignment) * alignment
    avail = len(buf) - data_offset
    for t in tensors:
        if t.offset % alignment or t.offset + t.nbytes > avail:
            raise GgufError(f"{where}: tensor {t.name!r} data [{t.offset}, +{t.nbytes}) is misaligned or "
                            f"past the end of the file")
    return GgufScan(version=version, n_kv=n_kv, tensors=tensors, data_offset=data_offset, alignment=alignment)
