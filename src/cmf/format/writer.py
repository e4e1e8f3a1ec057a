"""CmfWriter: the streaming, deterministic, atomic writer (REFERENCE_NOTES §1.1, §1.4).

Payloads go to a spool file in the target folder as they are added, so RAM stays bounded by one
tensor. ``finish()`` lays the file out exactly: envelope at 0, header JSON at 128, directory right
after it, data at the next multiple of 4096 (tensors 64-aligned, payloads ≥ 16 KiB on 4096 unless
``packed``),
then masks, vocab and sparse index back to back. The file is written under a temporary name in the
same folder, fsynced and renamed into place: a failure never leaves a partial file under the
target name and never touches an existing file there. The output gets the mode a plain ``open``
would give it (an existing target's mode is kept; see ``atomic``).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .constants import (
    DATA_ALIGN,
    ENVELOPE_SIZE,
    MAX_NDIM,
    QUANT_2F_DTYPES,
    Dtype,
    Feature,
    DTYPE_BY_LABEL,
)
from .. import hooks
from .atomic import apply_output_mode, check_writable, io_error
from .directory import encode_directory
from .dtypes import validate_payload
from .envelope import Envelope, Section
from .errors import BoundsError, CmfError, ParseError, UnsupportedDtype, WriterError
from .hash64 import hash64, hash64_hex
from .header import parse_header, serialize_header
from .masks import MaskSet, encode_masks
from .parts import shard_name
from .sparse_index import build_sparse_index
from .spool import Entry, Spool, align_up, copy_range, fsync_dir, tensor_alignment, write_file_atomic, write_temp

__all__ = ["CmfError", "CmfWriter", "Entry", "Payload", "align_up", "apply_output_mode", "as_dtype", "build_head",
           "check_entry", "copy_range", "feature_bits", "finalize_header", "fsync_dir", "payload_view",
           "tensor_alignment", "write_file", "write_file_atomic", "write_temp"]

log = logging.getLogger(__name__)

Payload = bytes | bytearray | memoryview | np.ndarray


# The converter's --quant spellings (FORMATS.md) accepted next to the spec labels.
DTYPE_ALIASES = {"q8": Dtype.Q8_ROW, "q4": Dtype.Q4_BLOCK, "q4t": Dtype.Q4_TILED, "q1p": Dtype.Q1}


def as_dtype(dtype: Dtype | int | str) -> Dtype:
    """Accept a Dtype, its id, its label ("q4tp") or a converter alias ("q8", "q4t", "q1p")."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        d = DTYPE_BY_LABEL.get(key, DTYPE_ALIASES.get(key))
        if d is None:
            raise WriterError(f"unknown dtype {dtype!r}")
        return d
    try:
        return Dtype(int(dtype))
    except ValueError:
        raise WriterError(f"unknown dtype id {dtype!r}") from None


def payload_view(payload: Payload) -> memoryview:
    """A flat byte view of a payload (numpy arrays must be C-contiguous)."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload)
        return memoryview(payload.reshape(-1).view(np.uint8))
    mv = memoryview(payload)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def check_entry(name: str, dtype: Dtype, shape: tuple[int, ...], view: memoryview) -> None:
    """Validate a tensor before it is written: name, shape, dtype and payload layout."""
    if not isinstance(name, str) or not name:
        raise WriterError(f"tensor name must be a non-empty string, got {name!r}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise WriterError(f"tensor name {name!r} is not encodable as UTF-8") from None
    if len(encoded) > 0xFFFF:
        raise WriterError(f"tensor name of {len(encoded)} bytes is longer than 65535")
    if len(shape) > MAX_NDIM:
        raise WriterError(f"tensor {name!r}: {len(shape)} dimensions, at most {MAX_NDIM}")
    if any((not isinstance(d, (int, np.integer))) or d < 0 or d >= 1 << 32 for d in shape):
        raise WriterError(f"tensor {name!r}: shape {list(shape)} has a dimension outside u32")
    try:
        validate_payload(dtype, shape, view, name)
    except BoundsError as exc:
        raise WriterError(str(exc)) from None


def feature_bits(dtypes: Iterable[int], has_masks: bool, header: Mapping[str, Any]) -> int:
    """Feature bits exactly as REFERENCE_NOTES §1.1 says writers set them."""
    bits = Feature.TENSOR_DIR
    arch = header.get("arch") or {}
    if has_masks:
        bits |= Feature.BINARY_MASKS
        if int(arch.get("num_loops", 1) or 1) > 1:
            bits |= Feature.LOOP_MASKS
    if any(int(d) in QUANT_2F_DTYPES for d in dtypes):
        bits |= Feature.QUANT_2F
    if any(isinstance(s, dict) and s.get("base_dir_hash") for s in header.get("skills") or ()):
        bits |= Feature.SKILL_FILE
    return int(bits)


def finalize_header(header: Mapping[str, Any], sections: Mapping[str, bytes]) -> dict[str, Any]:
    """Copy of ``header`` with ``section_hashes`` set for exactly the sections written."""
    out = dict(header)
    hashes = {k: hash64_hex(sections[k]) for k in ("masks", "vocab", "index") if sections.get(k)}
    if hashes:
        out["section_hashes"] = hashes
    else:
        out.pop("section_hashes", None)
    return out


def build_head(header: Mapping[str, Any], entries: list[Entry], data_len: int,
               sections: Mapping[str, bytes], min_data_off: int = 0) -> tuple[bytes, int, dict[str, Any]]:
    """Envelope + header + directory bytes for a fresh file, and the data offset.

    Returns (head, data_off, final_header). Masks/vocab/index follow the data back to back.
    """
    final = finalize_header(header, sections)
    header_bytes = serialize_header(final)
    try:
        parsed = parse_header(header_bytes)
    except ParseError as exc:
        raise WriterError(f"header is not a valid CMF header: {exc}") from None
    directory = encode_directory([e.name for e in entries], [int(e.dtype) for e in entries],
                                 [e.shape for e in entries], [e.off for e in entries],
                                 [e.nbytes for e in entries], [e.hash for e in entries])
    header_off = ENVELOPE_SIZE
    dir_off = header_off + len(header_bytes)
    data_off = max(align_up(dir_off + len(directory), DATA_ALIGN), min_data_off)
    secs = {"header": Section(header_off, len(header_bytes)), "dir": Section(dir_off, len(directory)),
            "data": Section(data_off, data_len)}
    cursor = data_off + data_len
    for name in ("masks", "vocab", "index"):
        blob = sections.get(name) or b""
        secs[name] = Section(cursor, len(blob)) if blob else Section(0, 0)
        cursor += len(blob)
    env = Envelope(features=feature_bits((e.dtype for e in entries), bool(sections.get("masks")), final),
                   sections=secs, header_hash=hash64(header_bytes), dir_hash=hash64(directory))
    del parsed
    return env.pack() + header_bytes + directory, data_off, final


class CmfWriter:
    """Streaming writer. ``add()`` tensors, optionally set masks/vocab, then ``finish()``.

    States: open → finished | aborted; calls out of order raise WriterError. As a context manager
    it finishes on success and aborts (removing every temporary file) on an exception.

    ``max_shard_bytes`` splits tensors greedily in the order added (a new shard starts when the
    next payload would push a non-empty shard past the limit); shard 1 alone carries masks, vocab,
    sparse index, ``tokenizer_config`` and ``skills``.

    ``packed``: every payload on the spec's 64 bytes (§4), none on a page — for files written to a
    size budget, where the pages' padding is bytes the weights could have had.
    """

    def __init__(self, path: str | os.PathLike, header: Mapping[str, Any], *,
                 max_shard_bytes: int | None = None, sparse_index: bool = False,
                 expected_names: Iterable[str] | None = None, packed: bool = False) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise WriterError(f"{self.path.parent}: output folder does not exist")
        check_writable(self.path)  # a read-only folder fails here, before any tensor is encoded
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise WriterError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.header: dict[str, Any] = copy.deepcopy(dict(header))
        self.max_shard_bytes = max_shard_bytes
        self.packed = packed  # every payload on the spec's 64 bytes, none on a page (spool.tensor_alignment)
        self.sparse_index = sparse_index
        self._names: set[str] = set()
        self._spools: list[Spool] = []
        self._masks: MaskSet | bytes | None = None
        self._index_raw: bytes | None = None
        self._vocab: bytes | None = None
        self._state = "open"
        self.outputs: list[Path] = []
        # Direct mode: with the tensor names known up front, the directory size is known, so the
        # data can be written at its final offset and never copied (the reference stream writer
        # reserves a head gap the same way). Without the hint the layout is the compact one.
        self._reserve = 0
        if expected_names is not None and max_shard_bytes is None:
            names = list(expected_names)
            probe = finalize_header(self.header, {"masks": b"x", "vocab": b"x", "index": b"x"})
            dir_len = 16 + 56 * len(names) + sum(len(n.encode("utf-8")) for n in names)
            self._reserve = align_up(ENVELOPE_SIZE + len(serialize_header(probe)) + 1024 + dir_len, DATA_ALIGN)

    # -- input -----------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._state != "open":
            raise WriterError(f"writer for {self.path} is {self._state}; no more calls accepted")

    def add(self, name: str, dtype: Dtype | int | str, shape: Iterable[int], payload: Payload, *,
            hash: int | None = None) -> Entry:
        """Append one encoded tensor. ``hash`` (if given) must equal hash64(payload)."""
        self._require_open()
        dt = as_dtype(dtype)
        shape_t = tuple(int(d) for d in shape)
        view = payload_view(payload)
        check_entry(name, dt, shape_t, view)
        if name in self._names:
            raise WriterError(f"duplicate tensor name {name!r}")
        h = hash64(view)
        if hash is not None and hash != h:
            raise WriterError(f"tensor {name!r}: given hash {hash:016x} != hash64 of the payload {h:016x}")
        try:
            spool = self._spool_for(len(view))
            self._names.add(name)
            return spool.add(name, dt, shape_t, view, h)
        except OSError as exc:
            if isinstance(exc, CmfError):
                raise
            self.abort()  # the temp files go now: a full disk gets its space back at once
            raise io_error(exc, f"{self.path}: {{reason}} while writing tensor {name!r}; the target is "
                                f"unchanged and no temporary file is left") from None

    def add_array(self, name: str, array: np.ndarray, dtype: Dtype | int | str = "f32", **options: Any) -> Entry:
        """Encode a float array as ``dtype`` (any codec of ``cmf.quant``) and add it."""
        self._require_open()
        dt = as_dtype(dtype)
        arr = np.asarray(array)
        if dt == Dtype.F32:
            payload: Payload = np.ascontiguousarray(arr, dtype="<f4")
        else:
            codec = hooks.codec()  # cmf.quant, wired by the package root (the codecs sit above us)
            if codec is None:
                raise UnsupportedDtype(f"tensor {name!r}: no encoder for {dt.label}")
            # pass the alias itself so e.g. "q1p" keeps its error-diffusion option
            payload = codec.encode(arr, dtype if isinstance(dtype, str) else dt, **options)
        return self.add(name, dt, arr.shape, payload)

    def _new_spool(self, base: int = 0) -> Spool:
        """A spool beside the target, laid out as this writer places payloads."""
        return Spool(self.path.parent, self.path.name, base, self.packed)

    def _spool_for(self, nbytes: int) -> Spool:
        if not self._spools:
            self._spools.append(self._new_spool(self._reserve))
        cur = self._spools[-1]
        if (self.max_shard_bytes is not None and cur.entries
                and align_up(cur.size, tensor_alignment(nbytes, self.packed)) + nbytes > self.max_shard_bytes):
            cur = self._new_spool()
            self._spools.append(cur)
        return cur

    def set_masks(self, masks: MaskSet | bytes | None, sparse_index: bytes | None = None) -> None:
        """Masks to write: a MaskSet (encoded at finish) or raw section bytes (copied verbatim)."""
        self._require_open()
        self._masks = masks
        self._index_raw = sparse_index

    def set_vocab(self, tokenizer_json: bytes | str | None) -> None:
        """The HF tokenizer.json bytes for the vocab section (spec §6)."""
        self._require_open()
        self._vocab = tokenizer_json.encode("utf-8") if isinstance(tokenizer_json, str) else tokenizer_json

    def update_header(self, **changes: Any) -> None:
        """Set top-level header keys (None deletes a key)."""
        self._require_open()
        for k, v in changes.items():
            if v is None:
                self.header.pop(k, None)
            else:
                self.header[k] = v

    @property
    def entries(self) -> list[Entry]:
        return [e for s in self._spools for e in s.entries]

    # -- output ----------------------------------------------------------------------------------
    def _sections(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        masks = self._masks
        if masks is not None:
            if isinstance(masks, (bytes, bytearray, memoryview)):
                out["masks"] = bytes(masks)
                if self._index_raw:
                    out["index"] = bytes(self._index_raw)
            else:
                try:
                    arch = parse_header(serialize_header(self.header)).arch
                except ParseError as exc:
                    raise WriterError(f"header is not a valid CMF header: {exc}") from None
                out["masks"] = encode_masks(masks, arch)
                if self.sparse_index:
                    out["index"] = build_sparse_index(masks, arch)
        if self._vocab:
            out["vocab"] = bytes(self._vocab)
        return out

    def finish(self) -> list[Path]:
        """Lay out and atomically write the file(s); returns the paths written."""
        self._require_open()
        try:
            spools = self._spools or [self._new_spool(self._reserve)]
            self._spools = spools
            sections = self._sections()
            count = len(spools)
            if count == 1:
                sp = spools[0]
                tail = [sections[k] for k in ("masks", "vocab", "index") if sections.get(k)]
                head, data_off, _ = build_head(self.header, sp.entries, sp.size, sections, sp.base)
                if sp.base and data_off == sp.base:
                    self._finish_in_place(sp, head, tail)
                else:
                    if sp.base:
                        log.info("%s: header outgrew the reserved head; copying the data once", self.path)
                        head, data_off, _ = build_head(self.header, sp.entries, sp.size, sections)
                    write_file_atomic(self.path, head, data_off, sp, tail)
                self.outputs = [self.path]
            else:
                self.outputs = self._finish_sharded(spools, sections)
        except OSError as exc:
            self.abort()
            if isinstance(exc, CmfError):
                raise
            raise io_error(exc, f"{self.path}: {{reason}} while writing the file; the target is unchanged "
                                f"and no temporary file is left") from None
        except BaseException:
            self.abort()
            raise
        for s in self._spools:
            s.discard()
        self._state = "finished"
        return self.outputs

    def _finish_in_place(self, sp: Spool, head: bytes, tail: list[bytes]) -> None:
        """Direct mode: the data already sits at data_off in the temp file; add head and tail, rename."""
        os.pwrite(sp.fd, head, 0)  # the gap up to data_off is a hole: it reads as zeros
        end = sp.base + sp.size
        for blob in tail:
            mv = memoryview(blob)
            while len(mv):
                n = os.pwrite(sp.fd, mv, end)
                mv, end = mv[n:], end + n
        apply_output_mode(sp.fd, self.path)  # the spool came from mkstemp (0600)
        os.fsync(sp.fd)
        os.close(sp.fd)
        sp.fd = -1
        os.replace(sp.path, self.path)
        fsync_dir(self.path.parent)

    def _finish_sharded(self, spools: list[Spool], sections: dict[str, bytes]) -> list[Path]:

        stem = self.path.name[:-4] if self.path.name.endswith(".cmf") else self.path.name
        count = len(spools)
        targets = [self.path.with_name(shard_name(stem, no, count)) for no in range(1, count + 1)]
        # Every shard is written and synced under a temp name before any is renamed: a disk that
        # fills (or an EIO) on shard k must not leave new shards 1..k-1 beside the old set's others,
        # a set that opens but mixes two models. The cost: the whole new set exists beside the old
        # one until the renames (renames need no data blocks, so they do not hit ENOSPC).
        temps: list[Path] = []
        try:
            for no, (spool, target) in enumerate(zip(spools, targets), start=1):
                header = dict(self.header)
                header["shard"] = {"no": no, "count": count}
                secs = sections if no == 1 else {}
                if no > 1:
                    header["tokenizer_config"] = None
                    header.pop("skills", None)
                head, data_off, _ = build_head(header, spool.entries, spool.size, secs)
                tail = [secs[k] for k in ("masks", "vocab", "index") if secs.get(k)]
                temps.append(write_temp(target, head, data_off, spool, tail))
                spool.discard()  # its bytes are in the temp shard now: give the space back early
        except BaseException:
            for t in temps:
                t.unlink(missing_ok=True)
            raise
        for i, (tmp, target) in enumerate(zip(temps, targets)):
            try:
                os.replace(tmp, target)
            except BaseException:
                for t in temps[i:]:
                    t.unlink(missing_ok=True)
                raise
        fsync_dir(self.path.parent)
        return targets

    def abort(self) -> None:
        """Discard everything written so far (temp files only; targets are never touched)."""
        for s in self._spools:
            s.discard()
        self._spools = []
        if self._state == "open":
            self._state = "aborted"

    def __enter__(self) -> "CmfWriter":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.finish()

    def __del__(self) -> None:  # never leave spool files behind
        try:
            if self._state == "open":
                self.abort()
        except Exception:  # pragma: no cover
            pass


def write_file(path: str | os.PathLike, header: Mapping[str, Any],
               tensors: Iterable[tuple[str, Dtype | int | str, Iterable[int], Payload]], *,
               masks: MaskSet | bytes | None = None, vocab: bytes | None = None,
               max_shard_bytes: int | None = None, sparse_index: bool = False) -> list[Path]:
    """One-call writer: ``tensors`` yields (name, dtype, shape, payload)."""
    with CmfWriter(path, header, max_shard_bytes=max_shard_bytes, sparse_index=sparse_index) as w:
        for name, dtype, shape, payload in tensors:
            w.add(name, dtype, shape, payload)
        if masks is not None:
            w.set_masks(masks)
        if vocab is not None:
            w.set_vocab(vocab)
    return w.outputs

