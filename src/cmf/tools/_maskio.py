"""Shared pieces of the mask-writing verbs (``mask create``, ``moe-mask``): the catalog a new
mask joins, writing it (append-only growth or a rewrite), route statistics and the held-out
quality contract (spec §5.1)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..format.errors import CmfError, WriterError
from ..format.masks import MaskSet, TaskMask

log = logging.getLogger(__name__)

DEFAULT_TASK = "general"  # REFERENCE_NOTES §3: `run --task` defaults to "general"


def with_mask(current: MaskSet | None, mask: TaskMask, *, replace: bool = False) -> MaskSet:
    """The catalog after adding ``mask`` (its task_id assigned). The default task stays "general";
    without a mask of that name the first mask (task 0, priority Fallback) is what runs by default
    (runtime/task_masks.py ``default_task``)."""
    if mask.name == "none":  # runtime/task_masks.py NO_TASK: the name that means "unmasked"
        raise CmfError("a task mask cannot be called 'none': --task none means run unmasked")
    if current is None:
        current = MaskSet(default_task=DEFAULT_TASK)
    masks = list(current.masks)
    old = next((i for i, m in enumerate(masks) if m.name == mask.name), None)
    if old is not None and not replace:
        raise CmfError(f"the file already has a task mask {mask.name!r} (use --replace)")
    if old is not None:
        mask.task_id = masks[old].task_id
        masks[old] = mask
    else:
        mask.task_id = max((m.task_id for m in masks), default=-1) + 1
        masks.append(mask)
    return MaskSet(default_task=current.default_task or DEFAULT_TASK, masks=masks, extra=dict(current.extra))


def write_masks(src: str | os.PathLike, masks: MaskSet, out: str | os.PathLike | None = None,
                *, in_place: bool = False) -> Path:
    """Write ``masks`` as the masks section of ``src``: in place by append-only growth (spec §9:
    no existing byte moves, the envelope is the commit point), or into a new file ``out`` (tensors
    copied byte for byte with their hashes re-checked, a shard set joined)."""
    from ..format.growth import append
    from ..format.hash64 import hash64
    from ..format.errors import HashMismatch
    from ..format.reader import open as cmf_open
    from ..format.writer import CmfWriter

    src = Path(src)
    if in_place == (out is not None):
        raise WriterError("give exactly one of an output path (-o) and --in-place")
    if in_place:
        append(src, masks=masks)
        return src
    out = Path(out)
    with cmf_open(src) as f:
        if out.exists() and any(out.resolve() == p.resolve() for p in f.paths):
            raise WriterError(f"{out}: the output would overwrite the input; use --in-place or another path")
        header = dict(f.header.to_dict())
        header.pop("shard", None)
        with CmfWriter(out, header, expected_names=f.keys()) as w:
            for t in f.tensors():
                view = t.numpy()
                if hash64(view) != t.hash:
                    raise HashMismatch(f"{src}: tensor {t.name!r} does not match its stored hash")
                w.add(t.name, t.dtype, t.shape, view, hash=t.hash)
            w.set_masks(masks)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
    return out


def read_stats(stats: str | os.PathLike | dict | None, provenance: dict | None = None) -> dict[int, np.ndarray]:
    """Route statistics ``{layer: [count per expert]}`` from a JSON file or dict, else from the
    file's ``provenance.moe_defrag.routing_counts`` (spec §11.1)."""
    where = "route statistics"
    if stats is None:
        data = ((provenance or {}).get("moe_defrag") or {}).get("routing_counts")
        where = "provenance.moe_defrag.routing_counts"
        if data is None:
            raise CmfError("no --stats given and the file has no provenance.moe_defrag.routing_counts "
                           "(make them with 'cmf route-stats MODEL -f TEXT -o STATS.json')")
    elif isinstance(stats, dict):
        data = stats
    else:
        where = str(stats)
        try:
            data = json.loads(Path(stats).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CmfError(f"{where}: cannot read route statistics ({exc})") from None
    if not isinstance(data, dict):
        raise CmfError(f"{where}: route statistics must be a JSON object {{layer: [count per expert]}}")
    out: dict[int, np.ndarray] = {}
    for key, counts in data.items():
        try:
            arr = np.asarray(counts, dtype=np.float64).reshape(-1)
            out[int(key)] = arr
        except (TypeError, ValueError):
            raise CmfError(f"{where}: entry {key!r} is not layer -> [count per expert]") from None
        if (arr < 0).any() or not np.isfinite(arr).all():
            raise CmfError(f"{where}: layer {key} has negative or non-finite counts")
    return out


def read_text(path: str | os.PathLike) -> tuple[str, str]:
    """(text, sha256 of the file's bytes) of a UTF-8 text file."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as exc:
        raise CmfError(f"{path}: not UTF-8 text ({exc})") from None


def measure_quality(model, mask: TaskMask, heldout: str | os.PathLike | None, window: int = 512,
                    chunks: int | None = None) -> None:
    """Set ``mask.quality`` from the held-out text file ``heldout``, or warn that the mask is
    written unmeasured (quality null) when there is none."""
    if heldout is None:
        log.warning("no --heldout text: mask %r is written with quality null (unmeasured)", mask.name)
        return
    text, sha = read_text(heldout)
    mask.quality = heldout_quality(model, mask, text, sha, window, chunks)


def heldout_quality(model, mask: TaskMask, text: str, sha256: str, window: int = 512,
                    chunks: int | None = None) -> dict[str, Any]:
    """The held-out contract of ``mask`` (spec §5.1): perplexity with the mask over perplexity
    without any mask, both by the ``cmf ppl`` protocol (same windows, same tokens), so a fresh
    ``cmf ppl --task`` reproduces the ratio. ``sha256`` identifies the held-out file."""
    from .perplexity import encode_text, perplexity

    ids = encode_text(model.tokenizer, text)
    window = min(int(window), model.ctx_size)
    previous = model.task
    try:
        model.use_mask(None)
        dense = perplexity(model, ids, window, chunks)
        model.use_mask(mask)
        masked = perplexity(model, ids, window, chunks)
    finally:
        model.select(task=previous if previous in model.tasks else "none")
    log.info("mask %r: held-out ppl %.4f vs %.4f unmasked over %d tokens", mask.name, masked["ppl"],
             dense["ppl"], dense["tokens"])
    return {"metric": "heldout_ppl_ratio", "value": masked["ppl"] / dense["ppl"],
            "baseline_dense": dense["ppl"], "n_samples": int(dense["tokens"]),
            "dataset_sha256": sha256}


def mask_sparsity(model, mask: TaskMask) -> float:
    """Fraction of the model's FFN neurons a mask leaves inactive: dense neurons by the FFN rows,
    routed experts' neurons by the expert rows (an empty row keeps all); shared experts always run.
    A layer gated off counts as wholly inactive."""
    from ..runtime.blocks import DenseFfn, MoeFfn

    total = dead = 0
    for i, b in enumerate(model._blocks):
        alive = mask.layer_alive(i)
        if isinstance(b.ffn, DenseFfn):
            width = b.ffn.width
            row = np.asarray(mask.ffn[i][:width], bool) if i < mask.ffn.shape[0] else np.ones(width, bool)
            live = int(row.sum()) + max(0, width - row.size)
            total, dead = total + width, dead + (width - live if alive else width)
        elif isinstance(b.ffn, MoeFfn):
            m = b.ffn.m
            widths = [int(model.weights.shape(e[0])[0]) for e in m.experts]
            shared = m.shared.width if m.shared is not None else 0
            row = None
            if mask.experts is not None and i < mask.experts.shape[0]:
                row = np.asarray(mask.experts[i][:len(widths)], bool)
                if not row.any():
                    row = None
            kept = sum(w for e, w in enumerate(widths) if row is None or (e < row.size and row[e]))
            total += sum(widths) + shared
            dead += (sum(widths) - kept) if alive else sum(widths) + shared
    return dead / total if total else 0.0
