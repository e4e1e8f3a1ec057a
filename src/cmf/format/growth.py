"""Append-only growth (spec §9 "claim 11") and compaction.

``append()`` adds tensors at the file tail, re-emits the header and directory (and any changed
masks/vocab) at the tail, and rewrites the 128-byte envelope in place as the LAST step. Bytes and
offsets of everything written before never change, so a crash at any point before the envelope
write leaves the old file, and after it the new one.

Durability model: the envelope is one 128-byte ``pwrite`` inside the first disk sector, preceded
and followed by fsync. Sector writes are atomic on real storage; should a torn envelope ever
occur, the header/directory hashes in the envelope make ``verify()`` report it (tested).

Unchanged masks/vocab/index sections are not copied: the new envelope points at the old bytes,
which never change. ``compact()`` is a plain rewrite that drops every dead byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .constants import ENVELOPE_SIZE
from .directory import encode_directory
from .envelope import Envelope, Section
from .atomic import io_error
from .errors import CmfError, HashMismatch, ShardError, WriterError
from .hash64 import hash64, hash64_hex
from .header import parse_header, serialize_header
from .masks import MaskSet, encode_masks
from .writer import CmfWriter, Entry, Payload, align_up, as_dtype, check_entry, feature_bits, payload_view
from .writer import tensor_alignment

TensorSpec = tuple[str, Any, Iterable[int], Payload]


class FileOps:
    """The write primitives append() uses; tests substitute one that 'crashes' mid-way."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        mv = memoryview(data)
        while len(mv):
            n = os.pwrite(self.fd, mv, offset)
            mv, offset = mv[n:], offset + n

    def fsync(self) -> None:
        os.fsync(self.fd)


def append(path: str | os.PathLike, tensors: Iterable[TensorSpec] = (),
           header_changes: Mapping[str, Any] | None = None, *, masks: MaskSet | bytes | None = None,
           vocab: bytes | None = None, replace: bool = False,
           ops_factory: Callable[[int], FileOps] = FileOps) -> list[Entry]:
    """Grow ``path`` in place without moving any existing byte; returns the new directory entries.

    ``tensors`` yields (name, dtype, shape, payload). A name already present is an error unless
    ``replace`` (the new record then takes the old one's place; the old bytes become dead).
    ``header_changes`` sets top-level header keys (None deletes). ``masks``/``vocab`` replace those
    sections. The file must be a single, non-sharded CMF file.
    """
    from .reader import open as cmf_open

    path = Path(path)
    with cmf_open(path, shards=False) as f:
        if f.header.shard is not None and f.header.shard.count > 1:
            raise ShardError(f"{path}: append works on a single file, not a shard; run `cmf compact` first")
        env = f.envelope
        header: dict[str, Any] = dict(f.header.to_dict())
        entries = [
            Entry(t.name, t.dtype, t.shape, t.offset - env.section("data").off, t.nbytes, t.hash)
            for t in f.tensors()
        ]
        old_sections = {k: bytes(f.section_bytes(k)) for k in ("masks", "vocab", "index")
                        if env.section(k).present}
    data = env.section("data")
    by_name = {e.name: i for i, e in enumerate(entries)}
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise io_error(exc, f"{path}: cannot open the file for writing ({{reason}}); nothing was changed") from None
    committing = False
    old_size = os.fstat(fd).st_size
    try:
        ops = ops_factory(fd)
        tail = old_size
        new_entries: list[Entry] = []
        data_end = data.off + data.len
        for name, dtype, shape, payload in tensors:
            dt = as_dtype(dtype)
            shape_t = tuple(int(d) for d in shape)
            view = payload_view(payload)
            check_entry(name, dt, shape_t, view)
            if name in by_name and not replace:
                raise WriterError(f"{path}: tensor {name!r} already exists (use replace=True)")
            if any(e.name == name for e in new_entries):
                raise WriterError(f"duplicate tensor name {name!r}")
            rel = align_up(tail - data.off, tensor_alignment(len(view)))
            ops.pwrite(view, data.off + rel)
            tail = data.off + rel + len(view)
            data_end = max(data_end, tail)
            new_entries.append(Entry(name, dt, shape_t, rel, len(view), hash64(view)))
        for e in new_entries:
            if e.name in by_name:
                entries[by_name[e.name]] = e
            else:
                entries.append(e)
        for k, v in (header_changes or {}).items():
            if v is None:
                header.pop(k, None)
            else:
                header[k] = v
        # Sections: unchanged ones keep pointing at their old (immutable) bytes.
        new_blobs: dict[str, bytes] = {}
        if masks is not None:
            arch = parse_header(serialize_header(header)).arch
            new_blobs["masks"] = bytes(masks) if isinstance(masks, (bytes, bytearray)) else encode_masks(masks, arch)
        if vocab is not None:
            new_blobs["vocab"] = bytes(vocab)
        current = dict(old_sections)
        current.update(new_blobs)
        if "masks" in new_blobs:
            current.pop("index", None)  # the deprecated index would describe the old masks
        hashes = {k: hash64_hex(v) for k, v in current.items() if v}
        if hashes:
            header["section_hashes"] = hashes
        else:
            header.pop("section_hashes", None)
        header_bytes = serialize_header(header)
        parse_header(header_bytes)  # refuse to commit an invalid header
        directory = encode_directory([e.name for e in entries], [int(e.dtype) for e in entries],
                                     [e.shape for e in entries], [e.off for e in entries],
                                     [e.nbytes for e in entries], [e.hash for e in entries])
        secs = dict(env.sections)
        cursor = max(tail, os.fstat(fd).st_size)
        secs["header"] = Section(cursor, len(header_bytes))
        cursor += len(header_bytes)
        secs["dir"] = Section(cursor, len(directory))
        cursor += len(directory)
        blob_writes = []
        for k in ("masks", "vocab"):
            if k in new_blobs:
                secs[k] = Section(cursor, len(new_blobs[k])) if new_blobs[k] else Section(0, 0)
                blob_writes.append((new_blobs[k], cursor))
                cursor += len(new_blobs[k])
        if "masks" in new_blobs:
            secs["index"] = Section(0, 0)
        secs["data"] = Section(data.off, data_end - data.off)
        ops.pwrite(header_bytes + directory, secs["header"].off)
        for blob, off in blob_writes:
            if blob:
                ops.pwrite(blob, off)
        ops.fsync()
        has_masks = secs["masks"].present
        new_env = Envelope(features=feature_bits((e.dtype for e in entries), has_masks, header),
                           sections=secs, header_hash=hash64(header_bytes), dir_hash=hash64(directory))
        packed = new_env.pack()
        assert len(packed) == ENVELOPE_SIZE
        committing = True
        ops.pwrite(packed, 0)  # the commit point
        ops.fsync()
    except OSError as exc:
        if isinstance(exc, CmfError):
            raise
        if committing:
            # The envelope write (or the fsync after it) failed: the sector holds the old or the
            # new envelope (or, implausibly, a torn one that open() detects); the tail stays, as
            # the new envelope may point at it.
            raise io_error(exc, f"{path}: {{reason}} while committing the append (the envelope write); the "
                                f"file holds the old or the new version, `cmf verify` tells") from None
        _drop_tail(fd, old_size)
        raise io_error(exc, f"{path}: {{reason}} while appending; the file is unchanged (its envelope still "
                            f"points at the old sections; the partial tail was cut off)") from None
    except BaseException:
        if not committing:
            _drop_tail(fd, old_size)
        raise
    finally:
        os.close(fd)
    return new_entries


def _drop_tail(fd: int, size: int) -> None:
    """Cut the uncommitted tail of a failed append (best effort: it is dead bytes either way)."""
    try:
        os.ftruncate(fd, size)
    except OSError:  # pragma: no cover - an EIO device may refuse this too; the file still opens old
        pass


def compact(src: str | os.PathLike, dst: str | os.PathLike, *, verify_hashes: bool = True) -> Path:
    """Rewrite ``src`` (a file or shard set) tightly into one file ``dst``.

    Tensors are copied byte for byte in directory order with their hashes (re-checked unless
    ``verify_hashes`` is False: a corrupt source raises HashMismatch instead of being laundered).
    Header, masks, vocab and sparse index carry over; a ``shard`` block is dropped.
    """
    from .reader import open as cmf_open

    src, dst = Path(src), Path(dst)
    with cmf_open(src) as f:
        header = dict(f.header.to_dict())
        header.pop("shard", None)
        with CmfWriter(dst, header) as w:
            for t in f.tensors():
                view = t.numpy()
                if verify_hashes and hash64(view) != t.hash:
                    raise HashMismatch(f"{src}: tensor {t.name!r} does not match its stored hash; "
                                       f"refusing to compact a corrupt file")
                w.add(t.name, t.dtype, t.shape, view)
            if f.envelope.section("masks").present:
                idx = bytes(f.section_bytes("index")) if f.envelope.section("index").present else None
                w.set_masks(bytes(f.section_bytes("masks")), sparse_index=idx)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
    return dst


__all__ = ["append", "compact", "FileOps"]
