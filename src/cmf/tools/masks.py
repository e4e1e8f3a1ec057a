"""``cmf masks``: the task-mask catalog (spec §5, REFERENCE_NOTES §1.9).

Per task: name, whether it is the default, sparsity, quality (value and metric, or "unmeasured"
when the file records none), and the layers it touches: layers whose gate is off, or whose FFN,
head or expert bitfield is not all-on. FFN rows are per visit on looped models; a visit's layer
is ``visit % num_layers`` (pass-major).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from . import fmt_ranges, print_json, sanitize, table

NAME = "masks"
SUMMARY = "list the task masks: sparsity, quality, layers touched"


def _layers_touched(m: Any, num_layers: int) -> dict[str, list[int]]:
    """Layer indices restricted by each bitfield of a TaskMask (all-on rows touch nothing)."""
    def partial_rows(a: np.ndarray | None) -> np.ndarray:
        if a is None or a.size == 0 or a.ndim != 2:
            return np.zeros(num_layers, bool)
        off = ~a.all(axis=1)
        out = np.zeros(num_layers, bool)
        np.logical_or.at(out, np.arange(off.size) % num_layers, off)  # visits fold onto layers
        return out

    gates = np.asarray(m.gates, bool)
    gate_off = np.zeros(num_layers, bool)
    gate_off[:min(gates.size, num_layers)] = ~gates[:num_layers]
    ffn, heads, experts = partial_rows(m.ffn), partial_rows(m.heads), partial_rows(m.experts)
    touched = gate_off | ffn | heads | experts
    return {name: np.flatnonzero(v).tolist() for name, v in
            (("layers", touched), ("gated_off", gate_off), ("ffn", ffn), ("heads", heads), ("experts", experts))}


def list_masks(model: str | os.PathLike | CmfFile) -> dict[str, Any]:
    """The mask catalog of a model as JSON-ready data: ``{"default_task", "masks": [...]}``."""
    if not isinstance(model, CmfFile):
        with cmf_open(model) as f:
            return list_masks(f)
    ms = model.masks
    if ms is None:
        return {"default_task": None, "masks": []}
    n_layers = model.header.arch.num_layers
    rows = []
    for m in ms:
        q = m.quality
        rows.append({
            "task_id": m.task_id, "name": m.name, "default": m.name == ms.default_task,
            "sparsity": m.sparsity, "priority": m.priority, "parent": m.parent,
            "description": m.description,
            "quality": "unmeasured" if q is None else q.get("value"),
            "quality_metric": None if q is None else q.get("metric"),
            "has_expert_fields": m.experts is not None, "has_hot_pack": m.has_hot_pack,
            **_layers_touched(m, n_layers),
        })
    return {"default_task": ms.default_task, "num_layers": n_layers, "masks": rows}


def render(d: dict[str, Any]) -> str:
    """Text table of :func:`list_masks`' data (``*`` marks the default task)."""
    if not d["masks"]:
        return "no masks"
    rows = []
    for m in d["masks"]:
        q = m["quality"]
        if q == "unmeasured":
            quality = q
        elif isinstance(q, (int, float)):
            quality = f"{m['quality_metric']}={q:g}"
        else:
            quality = f"{m['quality_metric']}={q}"
        touched = fmt_ranges(m["layers"])
        if m["gated_off"]:
            touched += f" (off: {fmt_ranges(m['gated_off'])})"
        rows.append([m["task_id"], m["name"], "*" if m["default"] else "",
                     "-" if m["sparsity"] is None else f"{m['sparsity']:.3f}", quality, touched])
    out = table(rows, ["id", "task", "default", "sparsity", "quality", "layers touched"], right=(0, 3))
    return out + f"\n{len(d['masks'])} masks over {d['num_layers']} layers; default: {sanitize(d['default_task'])}"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf masks``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("model", metavar="MODEL", help="a .cmf file (any shard of a set)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf masks``."""
    d = list_masks(args.model)
    if args.json:
        print_json(d)
    else:
        print(render(d))
    return 0
