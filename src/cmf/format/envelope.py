"""The fixed 128-byte envelope at offset 0 (spec §1, REFERENCE_NOTES §1.1)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

from .constants import (
    DATA_ALIGN,
    ENVELOPE_SIZE,
    MAGIC,
    SECTION_NAMES,
    SUPPORTED_FEATURES,
    VERSION,
    Feature,
)
from .errors import BoundsError, InvalidMagic, UnsupportedFeature, UnsupportedVersion

_STRUCT = struct.Struct("<4sIII12QQQ")
assert _STRUCT.size == ENVELOPE_SIZE


@dataclass(frozen=True)
class Section:
    """One (offset, length) pair of the envelope; length 0 means absent."""

    off: int
    len: int

    @property
    def end(self) -> int:
        return self.off + self.len

    @property
    def present(self) -> bool:
        return self.len > 0


@dataclass(frozen=True)
class Envelope:
    """Decoded envelope fields. ``sections`` maps header/dir/data/masks/vocab/index to a Section."""

    features: int
    sections: dict[str, Section] = field(default_factory=dict)
    header_hash: int = 0
    dir_hash: int = 0
    version: int = VERSION
    flags: int = 0

    def section(self, name: str) -> Section:
        return self.sections.get(name, Section(0, 0))

    def pack(self) -> bytes:
        """Serialize to exactly 128 bytes."""
        pairs = []
        for name in SECTION_NAMES:
            s = self.section(name)
            pairs += [s.off, s.len]
        return _STRUCT.pack(MAGIC, self.version, self.flags, self.features, *pairs,
                            self.header_hash, self.dir_hash)

    def with_(self, **changes) -> "Envelope":
        return replace(self, **changes)


def unpack_envelope(buf: bytes | memoryview, file_size: int, path: str = "") -> Envelope:
    """Decode and validate the envelope against the file size, in the order of REFERENCE_NOTES §1.1.

    Raises BoundsError, InvalidMagic, UnsupportedVersion or UnsupportedFeature.
    """
    where = f"{path}: " if path else ""
    if file_size < ENVELOPE_SIZE or len(buf) < ENVELOPE_SIZE:
        raise BoundsError(f"{where}file is {file_size} bytes, shorter than the 128-byte envelope")
    magic, version, flags, features, *rest = _STRUCT.unpack(bytes(buf[:ENVELOPE_SIZE]))
    if magic != MAGIC:
        raise InvalidMagic(f"{where}bad magic {magic!r} at offset 0 (expected {MAGIC!r}): not a CMF file")
    if version != VERSION:
        raise UnsupportedVersion(f"{where}envelope version {version} at offset 0x04 is not supported "
                                 f"(only CMF v{VERSION})", version)
    unknown = features & ~int(SUPPORTED_FEATURES)
    if unknown:
        names = []
        for bit in range(32):
            if unknown >> bit & 1:
                try:
                    names.append(f"{bit} ({Feature(1 << bit).name})")
                except ValueError:
                    names.append(f"{bit} (unknown)")
        raise UnsupportedFeature(f"{where}required_features 0x{features:08x} has unsupported bit(s) "
                                 f"{', '.join(names)}", unknown)
    sections = {}
    for i, name in enumerate(SECTION_NAMES):
        sections[name] = Section(rest[2 * i], rest[2 * i + 1])
    header_hash, dir_hash = rest[12], rest[13]
    for name in ("header", "dir"):
        if sections[name].len == 0:
            raise BoundsError(f"{where}{name} section is required but has length 0")
    for i, name in enumerate(SECTION_NAMES):
        s = sections[name]
        if s.len == 0:
            continue
        # Offsets and lengths are u64: their sum can exceed any real file but never wraps in Python,
        # so compare against the file size directly (this also covers the u64 overflow case).
        if s.off + s.len >= 1 << 64:
            raise BoundsError(f"{where}{name} section offset {s.off} + length {s.len} overflows u64 "
                              f"(envelope 0x{0x10 + 16 * i:02x})")
        if s.end > file_size:
            raise BoundsError(f"{where}{name} section [{s.off}, {s.end}) extends past the end of the "
                              f"file ({file_size} bytes; envelope 0x{0x10 + 16 * i:02x})")
    data = sections["data"]
    if data.len and data.off % DATA_ALIGN:
        raise BoundsError(f"{where}data_off {data.off} is not a multiple of {DATA_ALIGN}")
    return Envelope(features=features, sections=sections, header_hash=header_hash, dir_hash=dir_hash,
                    version=version, flags=flags)
