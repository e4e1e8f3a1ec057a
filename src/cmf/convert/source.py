"""A Hugging Face checkpoint as a lazy tensor source: a local folder or a hub id.

Weights are safetensors, one file or sharded with ``model.safetensors.index.json``. Every file
is opened once with ``safetensors.safe_open`` (which validates its header) for the tensor list,
dtypes and shapes; the bytes of a tensor are then read with positioned reads into a fresh
buffer. Two reasons not to take them from ``safe_open``: numpy has no bfloat16, so
``framework="np"`` cannot return bf16 tensors at all, and reading through the library's whole-file
mmap would leave every page touched resident in this process — the RSS of a conversion would
grow to the size of the checkpoint instead of staying near one tensor.

Reads can be partial (:class:`~cmf.convert.names.Cut`): one expert of a fused bank, or row
ranges of a fused projection, fetch just those bytes. f16 and bf16 are widened to f32 in
chunks (bf16: ``bits << 16``, REFERENCE_NOTES §1.6), so a tensor costs its f32 size plus a chunk.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import ConvertError
from .names import Cut

log = logging.getLogger(__name__)

# What a conversion needs from a hub repo; everything else (other weight formats, images,
# consolidated Mistral files) stays on the hub.
HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "chat_template.json", "special_tokens_map.json",
                "model*.safetensors", "*.safetensors.index.json"]
FLOAT_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8)}
_CHUNK = 1 << 24  # bytes of source data widened at a time


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    path: Path
    dtype: str  # safetensors dtype string: F32, F16, BF16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return FLOAT_DTYPES[self.dtype][1] if self.dtype in FLOAT_DTYPES else 0


def resolve(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder for ``model``: the folder itself, or a hub snapshot (downloaded if needed).

    Honours HF_HUB_OFFLINE, HF_TOKEN and HF_HOME through huggingface_hub. Raises ConvertError with
    the reason when neither works.
    """
    p = Path(os.path.expanduser(str(model)))
    if p.is_dir():
        if revision is not None:
            log.warning("--revision %s ignored for the local folder %s", revision, p)
        return p
    text = str(model)
    # A hub id is `name` or `org/name`; anything else that is not a folder is a bad local path.
    looks_local = text.startswith((".", "/", "~", "\\")) or text.count("/") > 1 or "\\" in text or p.exists()
    if looks_local or not text.strip():
        raise ConvertError(f"{text}: no such model folder" + (" (it is a file)" if p.is_file() else ""))
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a core dependency
        raise ConvertError(f"{text}: not a local folder, and huggingface_hub is not installed") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo_id=text, revision=revision, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:
        raise ConvertError(f"{text}: not a local folder and not in the Hugging Face cache"
                           + (" (HF_HUB_OFFLINE is set, so nothing is downloaded)" if offline else
                              " (the hub could not be reached)")) from None
    except HfHubHTTPError as exc:
        raise ConvertError(f"{text}: download from the Hugging Face hub failed: {exc}") from None
    except (ValueError, OSError) as exc:  # invalid repo id, disk errors
        raise ConvertError(f"{text}: cannot be fetched from the Hugging Face hub: {exc}") from None
    return Path(path)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file (already validated by safe_open) and its data start."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in a stable order."""
    for index in ("model.safetensors.index.json", *sorted(p.name for p in folder.glob("*.safetensors.index.json"))):
        ip = folder / index
        if ip.is_file():
            try:
                data = json.loads(ip.read_text(encoding="utf-8"))
                files = sorted(set(data["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConvertError(f"{ip}: not a safetensors index ({exc})") from None
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ConvertError(f"{ip}: names {len(missing)} missing file(s): {', '.join(missing[:3])}")
            return [folder / f for f in files]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        other = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(sorted(other)[:3])}: convert it to safetensors first)" if other else ""
        raise ConvertError(f"{folder}: no safetensors weights{hint}")
    return files


class Checkpoint:
    """The tensors of a checkpoint folder, read lazily."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        self.files = weight_files(folder)
        self.tensors: dict[str, SourceTensor] = {}
        for path in self.files:
            try:
                with safe_open(str(path), framework="np") as f:
                    names = list(f.keys())
                    meta = {n: (f.get_slice(n).get_dtype(), tuple(int(d) for d in f.get_slice(n).get_shape()))
                            for n in names}
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
                raise ConvertError(f"{path}: not a valid safetensors file ({exc})") from None
            header, data_start = _header(path)
            for n in names:
                if n in self.tensors:
                    raise ConvertError(f"tensor {n!r} appears in both {self.tensors[n].path.name} and {path.name}")
                begin, end = header[n]["data_offsets"]
                dtype, shape = meta[n]
                self.tensors[n] = SourceTensor(n, path, dtype, shape, data_start + int(begin), int(end) - int(begin))
        self._handles: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fh(self, path: Path) -> Any:
        with self._lock:
            fh = self._handles.get(path)
            if fh is None:
                fh = self._handles[path] = open(path, "rb", buffering=0)
            return fh

    def check_float(self, name: str) -> SourceTensor:
        """The tensor ``name``; ConvertError unless it holds floats we can widen to f32."""
        t = self.tensors[name]
        if t.dtype not in FLOAT_DTYPES:
            hint = " (FP8 checkpoints must be dequantized first)" if t.dtype.startswith("F8") else ""
            raise ConvertError(f"tensor {name!r} in {t.path.name} has dtype {t.dtype}; the converter reads "
                               f"F32, F16, BF16 and F64{hint}")
        return t

    def read(self, name: str, cut: Cut | None = None) -> np.ndarray:
        """Tensor ``name`` (or the part ``cut`` selects) as a new C-contiguous f32 array."""
        t = self.check_float(name)
        shape = t.shape
        row_bytes = t.itemsize
        for d in shape[1:]:
            row_bytes *= d
        base = t.offset
        if cut is not None and cut.index is not None:
            if not shape or not 0 <= cut.index < shape[0]:
                raise ConvertError(f"tensor {name!r}: index {cut.index} outside its first axis {shape[:1]}")
            shape = shape[1:]
            sub = row_bytes
            row_bytes = t.itemsize
            for d in shape[1:]:
                row_bytes *= d
            base += cut.index * sub
        if cut is not None and cut.rows is not None:
            ranges = [(base + a * row_bytes, (b - a) * row_bytes) for a, b in cut.rows]
            if not shape or any(not 0 <= a <= b <= shape[0] for a, b in cut.rows):
                raise ConvertError(f"tensor {name!r}: rows {cut.rows} outside shape {t.shape}")
            shape = (sum(b - a for a, b in cut.rows),) + tuple(shape[1:])
        else:
            n = t.itemsize
            for d in shape:
                n *= d
            ranges = [(base, n)]
        out = np.empty(shape, dtype=np.float32)
        flat = out.reshape(-1)
        fh = self._fh(t.path)
        at = 0
        for off, length in ranges:
            self._read_range(fh, t, off, length, flat, at)
            at += length // t.itemsize
        return out

    def _read_range(self, fh: Any, t: SourceTensor, off: int, length: int, dst: np.ndarray, at: int) -> None:
        code, size = FLOAT_DTYPES[t.dtype]
        if t.dtype == "F32":
            _pread_into(fh, memoryview(dst[at:at + length // 4]).cast("B"), off, t)
            return
        step = max(size, _CHUNK // size * size)
        done = 0
        while done < length:
            n = min(step, length - done)
            raw = bytearray(n)
            _pread_into(fh, memoryview(raw), off + done, t)
            src = np.frombuffer(raw, dtype=code)
            k = at + done // size
            if t.dtype == "BF16":
                dst[k:k + src.size] = (src.astype(np.uint32) << 16).view(np.float32)
            else:
                dst[k:k + src.size] = src.astype(np.float32)
            done += n

    def same_bytes(self, a: str, b: str) -> bool:
        """Whether two tensors hold identical dtype, shape and bytes (compared in chunks, so an
        MTP module's copy of a 2 GB embedding costs two chunk buffers, not two embeddings)."""
        ta, tb = self.tensors[a], self.tensors[b]
        if (ta.dtype, ta.shape, ta.nbytes) != (tb.dtype, tb.shape, tb.nbytes):
            return False
        fa, fb = self._fh(ta.path), self._fh(tb.path)
        for at in range(0, ta.nbytes, _CHUNK):
            n = min(_CHUNK, ta.nbytes - at)
            ba, bb = bytearray(n), bytearray(n)
            _pread_into(fa, memoryview(ba), ta.offset + at, ta)
            _pread_into(fb, memoryview(bb), tb.offset + at, tb)
            if ba != bb:
                return False
        return True


def _pread_into(fh: Any, mv: memoryview, off: int, t: SourceTensor) -> None:
    """Fill ``mv`` from byte ``off``: positioned reads, so worker threads can share a handle."""
    fd = fh.fileno()
    got = 0
    while got < len(mv):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [mv[got:]], off + got)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, len(mv) - got, off + got)
            n = len(chunk)
            mv[got:got + n] = chunk
        if not n:
            raise ConvertError(f"{t.path}: unexpected end of file reading tensor {t.name!r}")
        got += n
