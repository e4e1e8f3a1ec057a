"""CmfFile: the strict, zero-copy reader (spec §1–§10, REFERENCE_NOTES §1.1).

``open(path)`` maps the file, validates everything REFERENCE_NOTES §1.1 lists in order, and
exposes tensors as views into the mmap. Opening any shard name of a set opens the whole set.
Hashes are checked on demand by ``verify()``.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .. import hooks
from .constants import Dtype, Feature
from .envelope import Envelope
from .errors import CmfError, IoError, MissingTensor, ParseError, UnsupportedDtype
from .hash64 import hash64
from .header import Header
from .masks import MaskSet, decode_masks
from .parts import SHARD_RE, Part, open_part, shard_name, shard_set, verify_sections
from .sparse_index import decode_sparse_index

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QTensor:
    """A tensor as stored: name, dtype, shape, payload size, stored hash and a zero-copy byte view."""

    name: str
    dtype: Dtype
    shape: tuple[int, ...]
    nbytes: int
    hash: int
    offset: int  # absolute offset in its shard file
    shard: int  # 0-based index into CmfFile.paths
    _u8: np.ndarray = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def data(self) -> memoryview:
        """Zero-copy view of the payload bytes inside the mmap."""
        return self._u8[self.offset:self.offset + self.nbytes].data

    def numpy(self) -> np.ndarray:
        """Zero-copy uint8 numpy view of the payload."""
        return self._u8[self.offset:self.offset + self.nbytes]

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / max(self.numel, 1)


class CmfFile:
    """An open CMF file (or shard set). Use as a context manager; tensors are zero-copy mmap views."""

    def __init__(self, parts: list[Part]) -> None:
        self._parts = parts
        first = parts[0]
        self.path: Path = first.path
        self.header: Header = first.header
        self.envelope: Envelope = first.envelope
        self._entries: dict[str, tuple[int, int]] = {}
        for p_idx, part in enumerate(parts):
            for r_idx, name in enumerate(part.names):
                if name in self._entries:
                    raise ParseError(f"{part.path}: tensor {name!r} also appears in shard "
                                     f"{parts[self._entries[name][0]].path.name}")
                self._entries[name] = (p_idx, r_idx)
        self.closed = False
        self.masks: MaskSet | None = None
        self.sparse_index: list | None = None
        u8 = first.u8
        ms = first.envelope.section("masks")
        if ms.present:
            loop = bool(first.envelope.features & Feature.LOOP_MASKS)
            try:
                self.masks = decode_masks(u8[ms.off:ms.end].data, self.header.arch, loop_masks=loop)
            except ParseError as exc:
                raise ParseError(f"{first.path}: masks section: {exc}") from None
        xs = first.envelope.section("index")
        if xs.present:
            try:
                self.sparse_index = decode_sparse_index(u8[xs.off:xs.end].data)
            except ParseError as exc:
                raise ParseError(f"{first.path}: sparse index: {exc}") from None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the mappings. Views handed out earlier keep their mapping alive until dropped."""
        self.closed = True
        for part in self._parts:
            part.u8 = np.zeros(0, dtype=np.uint8)
            if part.mm is not None:
                try:
                    part.mm.close()
                except BufferError:
                    log.debug("%s: views still alive; mapping closes when they are dropped", part.path)
                part.mm = None

    def __enter__(self) -> "CmfFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CmfFile({str(self.path)!r}, tensors={len(self._entries)}, shards={len(self._parts)})"

    def _check_open(self) -> None:
        if self.closed:
            raise IoError(f"{self.path}: the file is closed")

    # -- directory -------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names in directory order (shard 1 first)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def tensor(self, name: str) -> QTensor:
        """The stored tensor ``name``; raises MissingTensor."""
        self._check_open()
        try:
            p_idx, r_idx = self._entries[name]
        except KeyError:
            raise MissingTensor(f"{self.path}: no tensor named {name!r}") from None
        part = self._parts[p_idx]
        r = part.records[r_idx]
        ndim = int(r["ndim"])
        return QTensor(name=name, dtype=Dtype(int(r["dtype"])), shape=tuple(int(x) for x in r["shape"][:ndim]),
                       nbytes=int(r["nbytes"]), hash=int(r["hash"]),
                       offset=part.envelope.section("data").off + int(r["off"]), shard=p_idx, _u8=part.u8)

    def tensors(self) -> Iterator[QTensor]:
        for name in self._entries:
            yield self.tensor(name)

    def raw(self, name: str) -> memoryview:
        """Zero-copy payload bytes of ``name``."""
        return self.tensor(name).data

    def array(self, name: str) -> np.ndarray:
        """Decode ``name`` to a float32 array of its shape (u8 tensors: a uint8 array of raw bytes)."""
        t = self.tensor(name)
        buf = t.numpy()
        if t.dtype == Dtype.F32:
            return buf.view("<f4").reshape(t.shape).astype(np.float32)
        if t.dtype == Dtype.F16:
            return buf.view("<f2").reshape(t.shape).astype(np.float32)
        if t.dtype == Dtype.BF16:
            return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        if t.dtype == Dtype.U8:
            return buf.copy().reshape(t.shape) if t.numel == t.nbytes else buf.copy()
        codec = hooks.codec()  # cmf.quant, wired by the package root (the codecs sit above us)
        if codec is None:
            raise UnsupportedDtype(f"tensor {name!r}: no decoder for {t.dtype.label}")
        return codec.decode(buf, t.dtype, t.shape)

    # -- metadata --------------------------------------------------------------------------------
    @property
    def paths(self) -> list[Path]:
        return [p.path for p in self._parts]

    @property
    def size(self) -> int:
        """Total bytes over all shards."""
        return sum(p.size for p in self._parts)

    @property
    def data_len(self) -> int:
        """Bytes of the data sections (payloads and their alignment padding) over all shards."""
        return sum(p.envelope.section("data").len for p in self._parts)

    @property
    def arch(self):
        return self.header.arch

    @property
    def skills(self):
        return self.header.skills

    @property
    def chat_config(self):
        return self.header.tokenizer_config

    @property
    def features(self) -> Feature:
        return Feature(self.envelope.features)

    @property
    def is_skill_file(self) -> bool:
        return bool(self.envelope.features & Feature.SKILL_FILE)

    @property
    def runnable(self) -> bool:
        """False for a standalone skill file (SKILL_FILE): a partial tensor set, not a model."""
        return not self.is_skill_file

    @property
    def tokenizer_json(self) -> bytes | None:
        """The embedded HF tokenizer.json bytes, or None."""
        self._check_open()
        vs = self.envelope.section("vocab")
        return self._parts[0].u8[vs.off:vs.end].tobytes() if vs.present else None

    def section_bytes(self, name: str, shard: int = 0) -> memoryview:
        """Raw bytes of an envelope section (header/dir/data/masks/vocab/index) of one shard."""
        self._check_open()
        part = self._parts[shard]
        s = part.envelope.section(name)
        return part.u8[s.off:s.end].data

    # -- integrity -------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Check the whole hash chain; return a list of problems (empty = clean).

        Envelope header/dir hashes (0 = absent), ``section_hashes`` for masks/vocab/index, and
        every tensor's hash64, over all shards. ``progress(n)`` is called with bytes hashed.
        """
        self._check_open()
        problems: list[str] = []
        for part in self._parts:
            problems += verify_sections(part)
        for name, (p_idx, r_idx) in self._entries.items():
            part = self._parts[p_idx]
            r = part.records[r_idx]
            start = part.envelope.section("data").off + int(r["off"])
            nb = int(r["nbytes"])
            got = hash64(part.u8[start:start + nb])
            if got != int(r["hash"]):
                problems.append(f"tensor {name!r}: hash64 {got:016x} != stored {int(r['hash']):016x}"
                                + (f" (shard {part.path.name})" if len(self._parts) > 1 else ""))
            if progress is not None:
                progress(nb)
        return problems


def open(path: str | os.PathLike, *, shards: bool = True) -> CmfFile:  # noqa: A001 - public API name
    """Open and validate a CMF file. Opening any shard opens the whole set (``shards=False``: just it).

    Raises a CmfError subclass for every malformed input.
    """
    path = Path(path)
    first = open_part(path)
    parts = [first]
    try:
        shard = first.header.shard
        if shards and shard is not None and shard.count > 1:
            parts = shard_set(path, first)
        return CmfFile(parts)
    except BaseException:
        for part in parts:
            part.u8 = np.zeros(0, dtype=np.uint8)
            if part.mm is not None:
                try:
                    part.mm.close()
                except BufferError:  # pragma: no cover
                    pass
        raise


__all__ = ["CmfFile", "QTensor", "open", "shard_name", "SHARD_RE", "CmfError"]
