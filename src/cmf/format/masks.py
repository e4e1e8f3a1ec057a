"""The masks section (spec §5; REFERENCE_NOTES §1.9): per-task bitfields over shared weights.

Section: ``[u32 n_masks][u32 meta_len][meta JSON][blobs, each 8-aligned from the section start]``.
A blob is LSB-first bitfields, bit set = active: FFN rows ``ceil(intermediate_size/8)`` bytes × R,
head rows ``ceil(num_attention_heads/8)`` × num_layers, layer gates ``ceil(num_layers/8)``, then,
only when the meta says ``has_expert_fields``, expert rows ``ceil(moe.num_experts/8)`` × num_layers.
R = num_layers (legacy) or num_layers·num_loops, pass-major (LOOP_MASKS, one row per visit).

Decoded masks always carry one FFN row per visit: a legacy mask on a looped model is replicated
to every pass, as the reference does, because the runtime indexes FFN masks by visit.

Decoding validates everything before it touches numpy, and keeps no view into ``buf``: a view
held by a traceback frame would stop the reader from closing its mmap.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .constants import MASK_PRIORITIES
from .errors import ParseError, WriterError
from .header import Arch, Header, as_arch, parse_json

__all__ = ["MaskSet", "TaskMask", "decode_masks", "encode_masks", "mask_layout"]

log = logging.getLogger(__name__)

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
# Keys the codec owns; any other key of a mask's meta is carried in TaskMask.extra.
_META_KEYS = ("task_id", "name", "description", "sparsity", "quality", "parent", "priority",
              "has_hot_pack", "has_expert_fields", "blob_off", "blob_len")
_REQUIRED = ("task_id", "name", "sparsity", "priority", "blob_off", "blob_len")
# Replicating a legacy mask to every pass multiplies its FFN rows by num_loops, a header value the
# section size does not bound; real looped models use 2-4 passes.
_MAX_REPLICATED_LOOPS = 256


@dataclass(eq=False)
class TaskMask:
    """One task mask. Arrays are bool; ``ffn`` has one row per visit, the rest one per layer.

    ``experts`` is None when the mask does not restrict MoE routing; an all-False expert row
    means "unrestricted" on encode (written all-ones), matching the reference writer.
    ``sparsity=None`` and ``priority=None`` are filled in by :func:`encode_masks`.
    """

    task_id: int
    name: str
    ffn: np.ndarray
    heads: np.ndarray
    gates: np.ndarray
    experts: np.ndarray | None = None
    sparsity: float | None = None
    description: str | None = None
    quality: dict[str, Any] | None = None
    parent: str | None = None
    priority: str | None = None
    has_hot_pack: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TaskMask):
            return NotImplemented
        scalars = ("task_id", "name", "sparsity", "description", "quality", "parent", "priority",
                   "has_hot_pack", "extra")
        if any(getattr(self, k) != getattr(other, k) for k in scalars):
            return False
        if (self.experts is None) != (other.experts is None):
            return False
        pairs = [(self.ffn, other.ffn), (self.heads, other.heads), (self.gates, other.gates)]
        if self.experts is not None:
            pairs.append((self.experts, other.experts))  # type: ignore[arg-type]
        return all(np.array_equal(a, b) for a, b in pairs)

    __hash__ = None  # type: ignore[assignment]  # mutable arrays

    def layer_alive(self, layer: int) -> bool:
        """Whether the layer gate is set (an absent gate reads as alive)."""
        return bool(self.gates[layer]) if 0 <= layer < len(self.gates) else True


@dataclass
class MaskSet:
    """The masks catalog: ``default_task`` and masks in file order."""

    default_task: str | None = None
    masks: list[TaskMask] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown top-level meta keys

    def get(self, name: str) -> TaskMask | None:
        """The first mask called ``name``, or None."""
        return next((m for m in self.masks if m.name == name), None)

    def names(self) -> list[str]:
        """Task names in file order."""
        return [m.name for m in self.masks]

    def __len__(self) -> int:
        return len(self.masks)

    def __iter__(self) -> Iterator[TaskMask]:
        return iter(self.masks)


@dataclass(frozen=True)
class _Layout:
    layers: int
    loops: int
    ffn: int  # bits per FFN row
    heads: int
    experts: int
    ffn_b: int  # bytes per row
    head_b: int
    gate_b: int
    expert_b: int

    def blob_len(self, ffn_rows: int, with_experts: bool) -> int:
        n = ffn_rows * self.ffn_b + self.layers * self.head_b + self.gate_b
        return n + (self.layers * self.expert_b if with_experts else 0)


def mask_layout(arch: Arch | Header | Mapping[str, Any]) -> dict[str, int]:
    """Bytes per row of each bitfield and the blob sizes for ``arch`` (for tools and tests)."""
    lay = _layout(as_arch(arch))
    return {"ffn_bytes": lay.ffn_b, "head_bytes": lay.head_b, "gates_bytes": lay.gate_b,
            "expert_bytes": lay.expert_b, "legacy": lay.blob_len(lay.layers, False),
            "per_visit": lay.blob_len(lay.layers * lay.loops, False),
            "experts_area": lay.layers * lay.expert_b}


def _layout(a: Arch) -> _Layout:
    e = a.num_experts
    return _Layout(layers=a.num_layers, loops=max(1, a.num_loops), ffn=a.intermediate_size,
                   heads=a.num_attention_heads, experts=e, ffn_b=-(-a.intermediate_size // 8),
                   head_b=-(-a.num_attention_heads // 8), gate_b=-(-a.num_layers // 8),
                   expert_b=-(-e // 8))


# ----------------------------------------------------------------------------- decode


def _is_uint(v: Any, limit: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_quality(q: Any, where: str) -> None:
    if q is None:
        return
    if not isinstance(q, dict):
        raise ParseError(f"{where}: quality must be an object or null")
    # The reference parser requires metric and value; the optional keys are typed too.
    if not isinstance(q.get("metric"), str):
        raise ParseError(f"{where}: quality.metric must be a string")
    if not _is_num(q.get("value")):
        raise ParseError(f"{where}: quality.value must be a number")
    for key, ok in (("baseline_dense", _is_num), ("n_samples", lambda v: _is_uint(v, _U32_MAX)),
                    ("dataset_sha256", lambda v: isinstance(v, str))):
        if q.get(key) is not None and not ok(q[key]):
            raise ParseError(f"{where}: quality.{key} has the wrong type")


def _check_entry(i: int, m: Any) -> str:
    """Validate one meta entry's keys and types; returns a label for messages."""
    if not isinstance(m, dict):
        raise ParseError(f"masks meta: masks[{i}] must be an object")
    for key in _REQUIRED:
        if key not in m:
            raise ParseError(f"masks meta: masks[{i}] is missing required key '{key}'")
    if not isinstance(m["name"], str):
        raise ParseError(f"masks meta: masks[{i}].name must be a string")
    where = f"masks meta: mask '{m['name']}'"
    if not _is_uint(m["task_id"], _U32_MAX):
        raise ParseError(f"{where}: task_id must be a u32")
    if not _is_num(m["sparsity"]):
        raise ParseError(f"{where}: sparsity must be a number")
    if not isinstance(m["priority"], str) or m["priority"] not in MASK_PRIORITIES:
        raise ParseError(f"{where}: priority {m['priority']!r} is not one of "
                         f"{', '.join(MASK_PRIORITIES)}")
    for key in ("blob_off", "blob_len"):
        if not _is_uint(m[key], _U64_MAX):
            raise ParseError(f"{where}: {key} must be a u64")
    for key in ("description", "parent"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ParseError(f"{where}: {key} must be a string or null")
    for key in ("has_hot_pack", "has_expert_fields"):
        if key in m and not isinstance(m[key], bool):
            raise ParseError(f"{where}: {key} must be a boolean")
    _check_quality(m.get("quality"), where)
    return where


def _plan(buf: Any, lay: _Layout, loop_masks: bool) -> tuple[dict[str, Any], list[tuple[dict, int, bool]]]:
    """Validate the whole section; returns the meta and per mask (entry, stored ffn rows, experts)."""
    n = memoryview(buf).nbytes
    if n < 8:
        raise ParseError(f"masks section: {n} bytes, shorter than its 8-byte prefix")
    n_masks, meta_len = struct.unpack_from("<II", buf, 0)
    if meta_len > n - 8:
        raise ParseError(f"masks section: meta_len {meta_len} runs past the section ({n} bytes)")
    # A bytes copy: a memoryview slice passed down would pin the caller's mmap from a traceback.
    meta = parse_json(bytes(memoryview(buf)[8:8 + meta_len]), "masks meta")
    if not isinstance(meta, dict):
        raise ParseError("masks meta: JSON must be an object")
    if not isinstance(meta.get("default_task"), str):
        raise ParseError("masks meta: default_task must be a string")
    entries = meta.get("masks")
    if not isinstance(entries, list):
        raise ParseError("masks meta: 'masks' must be an array")
    if len(entries) != n_masks:
        raise ParseError(f"masks section: n_masks {n_masks} but the meta lists {len(entries)}")

    plan = []
    spans = []
    blobs_start = 8 + meta_len
    for i, m in enumerate(entries):
        where = _check_entry(i, m)
        has_exp = m.get("has_expert_fields", False)
        if has_exp and lay.expert_b == 0:
            raise ParseError(f"{where}: has_expert_fields on an arch without a MoE block")
        visit_rows = lay.layers * lay.loops
        legacy, per_visit = lay.blob_len(lay.layers, has_exp), lay.blob_len(visit_rows, has_exp)
        blob_len, blob_off = m["blob_len"], m["blob_off"]
        if blob_len == legacy:
            rows = lay.layers
        elif blob_len == per_visit:
            rows = visit_rows
        else:
            raise ParseError(f"{where}: blob_len {blob_len} matches no layout for this arch "
                             f"(legacy {legacy}, per-visit {per_visit}"
                             f"{', with expert fields' if has_exp else ''})")
        if rows != lay.layers and not loop_masks:
            raise ParseError(f"{where}: per-visit mask rows (num_loops={lay.loops}) but the file "
                             "does not set the LOOP_MASKS feature bit")
        if rows == lay.layers and lay.loops > _MAX_REPLICATED_LOOPS:
            raise ParseError(f"{where}: legacy mask on num_loops={lay.loops} "
                             f"(> {_MAX_REPLICATED_LOOPS}) would replicate without bound")
        if blob_off < blobs_start or blob_off + blob_len > n:
            raise ParseError(f"{where}: blob [{blob_off}, {blob_off + blob_len}) lies outside "
                             f"the blob area [{blobs_start}, {n})")
        spans.append((blob_off, blob_off + blob_len, where))
        plan.append((m, rows, has_exp))
    # Overlapping blobs never come from a writer, and would let a small section decode into an
    # unbounded number of masks.
    spans.sort()
    for (_, end, _), (start, _, where) in zip(spans, spans[1:]):
        if start < end:
            raise ParseError(f"{where}: blob overlaps the previous mask's blob")
    return meta, plan


def _bits(buf: Any, off: int, rows: int, row_bytes: int, nbits: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=off)
    bits = np.unpackbits(raw.reshape(rows, row_bytes), axis=1, bitorder="little")
    return np.ascontiguousarray(bits[:, :nbits]).view(bool)


def decode_masks(buf: bytes | bytearray | memoryview, arch: Arch | Header | Mapping[str, Any],
                 *, loop_masks: bool) -> MaskSet:
    """Decode a masks section. ``loop_masks`` is the file's LOOP_MASKS feature bit.

    Raises :class:`ParseError` for every malformed section; per-visit rows on a looped arch are
    refused unless ``loop_masks`` is set (that bit is what declares them).
    """
    lay = _layout(as_arch(arch))
    meta, plan = _plan(buf, lay, loop_masks)
    masks = []
    for m, rows, has_exp in plan:
        off = m["blob_off"]
        ffn = _bits(buf, off, rows, lay.ffn_b, lay.ffn)
        if rows != lay.layers * lay.loops:
            ffn = np.tile(ffn, (lay.loops, 1))  # pass-major: visit v uses physical row v % L
        off += rows * lay.ffn_b
        heads = _bits(buf, off, lay.layers, lay.head_b, lay.heads)
        off += lay.layers * lay.head_b
        gates = _bits(buf, off, 1, lay.gate_b, lay.layers)[0]
        off += lay.gate_b
        experts = _bits(buf, off, lay.layers, lay.expert_b, lay.experts) if has_exp else None
        masks.append(TaskMask(
            task_id=m["task_id"], name=m["name"], ffn=ffn, heads=heads, gates=gates,
            experts=experts, sparsity=float(m["sparsity"]), description=m.get("description"),
            quality=m.get("quality"), parent=m.get("parent"), priority=m["priority"],
            has_hot_pack=m.get("has_hot_pack", False),
            extra={k: v for k, v in m.items() if k not in _META_KEYS}))
    extra = {k: v for k, v in meta.items() if k not in ("default_task", "masks")}
    return MaskSet(default_task=meta["default_task"], masks=masks, extra=extra)


# ----------------------------------------------------------------------------- encode


def _bool_array(a: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.shape != shape:
        raise WriterError(f"{what}: shape {arr.shape}, expected {shape}")
    return arr.astype(bool, copy=False)


def _pack(bits: np.ndarray) -> bytes:
    # packbits pads each row's tail with zero bits: the spec's "tail bits MUST be zero".
    return np.packbits(bits, axis=-1, bitorder="little").tobytes()


def _encode_blob(m: TaskMask, lay: _Layout) -> tuple[bytes, bool]:
    where = f"mask '{m.name}'"
    visits = lay.layers * lay.loops
    ffn = np.asarray(m.ffn)
    rows = ffn.shape[0] if ffn.ndim == 2 else -1
    if rows not in (lay.layers, visits):
        raise WriterError(f"{where}: ffn has shape {ffn.shape}, expected ({visits}, {lay.ffn})"
                          + (f" or ({lay.layers}, {lay.ffn})" if visits != lay.layers else ""))
    ffn = _bool_array(ffn, (rows, lay.ffn), f"{where}: ffn")
    if rows != visits:
        ffn = np.tile(ffn, (lay.loops, 1))  # the reference writer always emits per-visit rows
    heads = _bool_array(m.heads, (lay.layers, lay.heads), f"{where}: heads")
    gates = _bool_array(m.gates, (lay.layers,), f"{where}: gates")
    parts = [_pack(ffn), _pack(heads), _pack(gates)]
    has_exp = m.experts is not None and bool(np.any(m.experts))
    if m.experts is not None and lay.experts == 0:
        raise WriterError(f"{where}: expert rows given but the arch has no MoE block")
    if has_exp:
        experts = _bool_array(m.experts, (lay.layers, lay.experts), f"{where}: experts").copy()
        experts[~experts.any(axis=1)] = True  # an empty row means "unrestricted": all routable
        parts.append(_pack(experts))
    return b"".join(parts), has_exp


def _meta_entry(m: TaskMask, has_exp: bool, off: int, length: int) -> dict[str, Any]:
    sparsity = m.sparsity
    if sparsity is None:
        ffn = np.asarray(m.ffn, dtype=bool)
        sparsity = 1.0 - float(ffn.mean()) if ffn.size else 0.0
    # Python-writer convention (notes §1.9): Fallback for task 0, Normal otherwise.
    priority = m.priority or ("Fallback" if m.task_id == 0 else "Normal")
    e: dict[str, Any] = {"task_id": int(m.task_id), "name": m.name, "description": m.description,
                         "sparsity": float(sparsity), "quality": m.quality, "parent": m.parent,
                         "priority": priority, "has_hot_pack": m.has_hot_pack}
    if has_exp:
        e["has_expert_fields"] = True
    e["blob_off"] = off
    e["blob_len"] = length
    e.update((k, v) for k, v in m.extra.items() if k not in _META_KEYS)
    return e


def _check_encodable(m: TaskMask) -> None:
    where = f"mask '{m.name}'"
    if not isinstance(m.name, str):
        raise WriterError(f"mask name must be a string, got {type(m.name).__name__}")
    if not isinstance(m.task_id, (int, np.integer)) or not 0 <= int(m.task_id) <= _U32_MAX:
        raise WriterError(f"{where}: task_id must be a u32")
    if m.priority is not None and m.priority not in MASK_PRIORITIES:
        raise WriterError(f"{where}: priority {m.priority!r} is not one of {MASK_PRIORITIES}")
    if m.quality is not None and (not isinstance(m.quality, dict) or "metric" not in m.quality):
        # null means "not measured"; a quality without a metric is a declaration, not a measure.
        raise WriterError(f"{where}: quality needs a 'metric' (use None for unmeasured)")


def _dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        raise WriterError(f"masks meta cannot be serialized: {e}") from None


def encode_masks(maskset: MaskSet, arch: Arch | Header | Mapping[str, Any]) -> bytes:
    """Encode a masks section (deterministic; per-visit rows on looped archs, tail bits zero).

    Raises :class:`WriterError` for masks that do not fit ``arch`` or cannot be serialized.
    """
    lay = _layout(as_arch(arch))
    blobs = []
    for m in maskset.masks:
        _check_encodable(m)
        blobs.append(_encode_blob(m, lay))
    if len(blobs) > _U32_MAX:
        raise WriterError("too many masks for a u32 count")
    default = maskset.default_task
    if default is None:
        default = maskset.masks[0].name if maskset.masks else "general"

    def meta_bytes(blobs_start: int) -> bytes:
        entries, off = [], blobs_start
        for m, (blob, has_exp) in zip(maskset.masks, blobs):
            off = -(-off // 8) * 8
            entries.append(_meta_entry(m, has_exp, off, len(blob)))
            off += len(blob)
        meta = {"default_task": default, "masks": entries}
        meta.update((k, v) for k, v in maskset.extra.items() if k not in meta)
        return _dumps(meta)

    # Blob offsets live inside the meta, so its length depends on itself: iterate to the fixed
    # point. Lengths only grow with the offset, so this converges in a few steps.
    meta_len, meta = 0, b""
    for _ in range(64):
        meta = meta_bytes(8 + meta_len)
        if len(meta) == meta_len:
            break
        meta_len = len(meta)
    else:  # pragma: no cover - monotone growth makes this unreachable
        raise WriterError("masks meta length did not stabilize")
    if meta_len > _U32_MAX:
        raise WriterError("masks meta exceeds a u32 length")

    out = bytearray(struct.pack("<II", len(blobs), meta_len))
    out += meta
    for blob, _ in blobs:
        out += bytes(-len(out) % 8)
        out += blob
    log.debug("encoded %d masks: meta %d bytes, section %d bytes", len(blobs), meta_len, len(out))
    return bytes(out)
