"""``cmf defrag``: bake one task's FFN mask into the weights (spec §11).

For every dense FFN layer whose mask row drops neurons, the live neurons are gathered — rows of
``gate_proj``/``up_proj``, columns of ``down_proj``, one keep-set for all three — and the smaller
matrices are written in the source dtype: dequantize, gather, requantize (quant scales are per
group or row, so this is never a byte truncation). A ``down_proj`` whose new width is not a
multiple of 32 in a dtype that needs whole groups falls back to ``q8_2f``. Everything else is
copied byte for byte; skill replacements of the same FFN matrices get the same keep-set.

The output is an ordinary dense model with per-layer FFN widths (the directory is the shape
authority; ``arch.intermediate_size`` becomes the nominal per-layer maximum), no masks section,
and ``provenance.defrag``. At f32 its logits equal the masked model's; with a quantized source
the only difference is the requantization of the smaller matrices.

Only FFN neurons can be baked: a mask that also turns heads, layer gates or experts off is
refused (head pruning is out of scope in §11; experts are ``moe-defrag``'s job).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..format.constants import Dtype
from ..format.errors import CmfError, HashMismatch, WriterError
from . import print_json, sanitize

log = logging.getLogger(__name__)

NAME = "defrag"
SUMMARY = "bake one task mask's FFN neurons into a smaller standalone file (masked-out neurons removed)"

_EXACT = {Dtype.F32, Dtype.F16, Dtype.BF16, Dtype.Q8_ROW, Dtype.Q8_2F}  # no column constraint
_FALLBACK = Dtype.Q8_2F


def target_dtype(dtype: Dtype, cols: int) -> Dtype:
    """The dtype of a shrunk matrix: its own, or q8_2f when ``cols`` is not whole 32-groups."""
    if dtype in _EXACT or cols % 32 == 0:
        return dtype
    return _FALLBACK


def _options(t) -> dict[str, Any]:
    """Encoder options that keep a vbit matrix at its stored mean bit width."""
    if t.dtype in (Dtype.VBIT, Dtype.VBIT_RO):
        bits = t.numpy()[:t.shape[0]].astype(np.float64)
        return {"mean_bits": float(min(8.0, max(3.0, bits.mean())))}
    return {}


def _encode(w: np.ndarray, dtype: Dtype, opts: dict[str, Any]) -> bytes:
    from .. import quant

    if dtype == Dtype.F32:
        return np.ascontiguousarray(w, dtype="<f4").tobytes()
    return quant.encode(w, dtype, **opts)


def _keep_sets(f, mask, where: str) -> dict[str, tuple[int, np.ndarray]]:
    """{FFN tensor name: (axis, live neuron indices)} for every dense layer the mask shrinks."""
    from ..runtime.plan import FfnPlan, build_plan

    loops = max(1, f.arch.num_loops)
    L = f.arch.num_layers
    if not mask.gates.all():
        raise CmfError(f"{where}: layers {np.flatnonzero(~mask.gates).tolist()} are gated off; defrag "
                       "bakes FFN neurons only (the layer gate has no physical form)")
    if not mask.heads.all():
        raise CmfError(f"{where}: the mask turns attention heads off; head pruning is out of scope for "
                       "defrag (spec §11) — run the mask at run time instead")
    if mask.experts is not None and not all(r.all() or not r.any() for r in mask.experts):
        raise CmfError(f"{where}: the mask restricts experts; bake that with 'cmf moe-defrag'")
    if loops > 1 and any(not np.array_equal(mask.ffn[v], mask.ffn[v % L]) for v in range(L, L * loops)):
        raise CmfError(f"{where}: per-visit FFN rows differ between passes; one set of weights cannot bake them")
    plan = build_plan(f.arch, lambda n: f.tensor(n).shape if n in f else None)
    out: dict[str, tuple[int, np.ndarray]] = {}
    for lp in plan.layers:
        if not isinstance(lp.ffn, FfnPlan):
            continue
        width = lp.ffn.width
        row = np.asarray(mask.ffn[lp.index][:width], bool)
        if row.size < width:
            row = np.concatenate([row, np.ones(width - row.size, bool)])
        if row.all():
            continue
        live = np.flatnonzero(row).astype(np.int64)
        for name, axis in ((lp.ffn.gate, 0), (lp.ffn.up, 0), (lp.ffn.down, 1)):
            out[name] = (axis, live)
    return out


def _shrink(t, axis: int, live: np.ndarray) -> tuple[Dtype, tuple[int, int], bytes]:
    """The live neurons of one FFN matrix, requantized (see the module docstring)."""
    from .. import quant

    view = t.numpy()
    rows, cols = t.shape
    if live.size == 0:
        # A layer with no live neuron adds exactly zero: keep neuron 0 and zero its down column.
        keep = np.zeros(1, np.int64)
    else:
        keep = live
    if axis == 0:
        w = quant.decode_rows(view, t.dtype, t.shape, keep)
    else:
        w = np.ascontiguousarray(quant.decode(view, t.dtype, t.shape)[:, keep])
        if live.size == 0:
            w[:] = 0
    dtype = target_dtype(t.dtype, w.shape[1])
    if dtype != t.dtype:
        log.info("%s: %d columns are not whole 32-groups; written as %s", t.name, w.shape[1], dtype.label)
    return dtype, w.shape, _encode(w, dtype, _options(t) if dtype == t.dtype else {})


def defrag(src: str | os.PathLike, dst: str | os.PathLike, *, task: str) -> dict[str, Any]:
    """Write ``dst``: ``src`` with task ``task``'s FFN mask baked in (see the module docstring)."""
    from ..format.hash64 import hash64
    from ..format.reader import open as cmf_open
    from ..format.writer import CmfWriter

    src, dst = Path(src), Path(dst)
    with cmf_open(src) as f:
        if dst.exists() and any(dst.resolve() == p.resolve() for p in f.paths):
            raise WriterError(f"{dst}: the output would overwrite the input")
        if f.masks is None or f.masks.get(task) is None:
            known = ", ".join(f.masks.names()) if f.masks is not None else "none"
            raise CmfError(f"{src}: no task mask {task!r} (tasks: {known or 'none'})")
        mask = f.masks.get(task)
        keep = _keep_sets(f, mask, f"{src}: task {task!r}")
        header = f.header.to_dict()
        header.pop("shard", None)
        arch = dict(header["arch"])
        pre = int(arch["intermediate_size"])
        # Per dense layer: (width before, kept) — from the gate matrices' keep-sets.
        from ..runtime.plan import FfnPlan, build_plan

        plan = build_plan(f.arch, lambda n: f.tensor(n).shape if n in f else None)
        kept, widths = [], []
        for lp in plan.layers:
            if isinstance(lp.ffn, FfnPlan):
                widths.append(lp.ffn.width)
                kept.append(int(keep[lp.ffn.gate][1].size) if lp.ffn.gate in keep else lp.ffn.width)
        post_max = max(max(kept), 1) if kept else pre
        arch["intermediate_size"] = post_max
        header["arch"] = arch
        prov = dict(header.get("provenance") or {})
        prov["defrag"] = {"source_task": task, "source": src.name, "pre_intermediate": pre,
                          "post_intermediate_max": post_max, "kept_per_layer": kept,
                          "pruned_ratio": 1.0 - sum(kept) / sum(widths) if widths else 0.0}
        header["provenance"] = prov
        names = f.keys()
        before = after = 0
        with CmfWriter(dst, header, expected_names=names) as w:
            for t in f.tensors():
                view = t.numpy()
                if hash64(view) != t.hash:
                    raise HashMismatch(f"{src}: tensor {t.name!r} does not match its stored hash")
                base = t.name.split(".", 2)[2] if t.name.startswith("skill.") else t.name
                before += t.nbytes
                if base in keep:
                    axis, live = keep[base]
                    dtype, shape, payload = _shrink(t, axis, live)
                    w.add(t.name, dtype, shape, payload)
                    after += len(payload)
                else:
                    w.add(t.name, t.dtype, t.shape, view, hash=t.hash)
                    after += t.nbytes
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
            # No masks section: the baked mask is the identity now, and other tasks' rows would
            # index neurons that no longer exist (spec §11).
    if f.masks is not None and len(f.masks) > 1:
        log.info("%d other task masks were dropped: a defragged file bakes exactly one task", len(f.masks) - 1)
    return {"input": str(src), "output": str(dst), "task": task, **prov["defrag"],
            "tensor_bytes_before": before, "tensor_bytes_after": after}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf defrag``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Live neurons are gathered "
                              "(gate/up rows, down columns) and requantized at the smaller shape.")
    p.add_argument("model", metavar="MODEL", help="a .cmf file with task masks (any shard of a set)")
    p.add_argument("--task", required=True, help="the task mask to bake")
    p.add_argument("-o", "--output", required=True, help="the defragged file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf defrag``."""
    from . import fmt_bytes

    rep = defrag(args.model, args.output, task=args.task)
    if args.json:
        print_json(rep)
        return 0
    print(sanitize(f"{rep['output']}: task {rep['task']!r} baked; FFN {rep['pre_intermediate']} -> per layer "
                   f"{rep['kept_per_layer']} (pruned {100 * rep['pruned_ratio']:.1f}%); tensors "
                   f"{fmt_bytes(rep['tensor_bytes_before'])} -> {fmt_bytes(rep['tensor_bytes_after'])}"))
    return 0
