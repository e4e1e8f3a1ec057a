"""``cmf moe-mask``: an expert-field task mask from route statistics (spec §5, §11.1).

Per MoE layer, the smallest top expert set reaching ``--cover`` of the recorded routing mass
(the selection of ``moe-defrag`` and ``CMF_MOE_MASK``) becomes that layer's expert row; FFN,
head and gate rows stay all-on. ``run --task NAME`` then restricts routing to the kept experts,
the router renormalizing over them — the runtime-switchable twin of ``moe-defrag``: one file
with the full expert set serves several specialists.

With ``--heldout`` the mask's quality is measured like ``mask create`` does; without, it is
null ("unmeasured"). Statistics come from ``--stats`` (``cmf route-stats``) or, when absent,
from the file's ``provenance.moe_defrag.routing_counts``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import numpy as np

from ..format.errors import CmfError
from ..format.masks import TaskMask
from . import fmt_ranges, print_json, sanitize

log = logging.getLogger(__name__)

NAME = "moe-mask"
SUMMARY = "write an expert-field task mask keeping, per MoE layer, the experts that cover the routing mass"

DEFAULT_COVER = 0.95


def cover_sets(model, stats: dict[int, np.ndarray], cover: float) -> dict[int, np.ndarray]:
    """Per MoE layer of ``model`` with statistics: bool [experts] of the cover set (spec §11.1)."""
    from ..runtime.ops.moe import cover_mask

    if not 0.0 < cover <= 1.0:
        raise CmfError(f"--cover {cover} is not in (0, 1]")
    moe = set(model.moe_layers)
    out = {}
    for i, counts in sorted(stats.items()):
        if i not in moe:
            log.warning("route statistics name layer %d, which is not an MoE layer of this model; ignored", i)
            continue
        n = model._blocks[i].ffn.m.n_experts
        if counts.size != n:
            raise CmfError(f"route statistics: layer {i} has {counts.size} counts, the model {n} experts")
        out[i] = cover_mask(counts, cover)
    if not out:
        raise CmfError("the route statistics cover no MoE layer of this model")
    return out


def expert_mask(model, name: str, keep: dict[int, np.ndarray], description: str | None = None) -> TaskMask:
    """A TaskMask whose expert rows are ``keep`` (other layers unrestricted), everything else on."""
    from ._maskio import mask_sparsity

    a = model.arch
    L = a.num_layers
    experts = np.zeros((L, a.num_experts), bool)  # an empty row means "unrestricted"
    for i, k in keep.items():
        experts[i, :k.size] = k
    m = TaskMask(task_id=0, name=name, ffn=np.ones((L, a.intermediate_size), bool),
                 heads=np.ones((L, a.num_attention_heads), bool), gates=np.ones(L, bool), experts=experts,
                 description=description)
    m.sparsity = mask_sparsity(model, m)
    return m


def moe_mask(model_path: str | os.PathLike, name: str, *, stats: str | os.PathLike | dict | None = None,
             cover: float = DEFAULT_COVER, heldout: str | os.PathLike | None = None, window: int = 512,
             chunks: int | None = None, out: str | os.PathLike | None = None, in_place: bool = False,
             replace: bool = False, description: str | None = None) -> dict[str, Any]:
    """Build, optionally measure, and write the expert mask; returns a report."""
    from ..runtime.model import load
    from ._maskio import measure_quality, read_stats, with_mask, write_masks

    if in_place == (out is not None):
        raise CmfError("give exactly one of an output path (-o) and --in-place")
    model = load(model_path)
    try:
        if not model.moe_layers:
            raise CmfError(f"{model_path}: the model has no MoE layers")
        counts = read_stats(stats, model.file.header.to_dict().get("provenance"))
        keep = cover_sets(model, counts, cover)
        mask = expert_mask(model, name, keep, description or f"cmf moe-mask: cover {cover:g}")
        measure_quality(model, mask, heldout, window, chunks)
        masks = with_mask(model.file.masks, mask, replace=replace)
    finally:
        model.close()
    dst = write_masks(model_path, masks, out, in_place=in_place)
    kept = {str(i): int(k.sum()) for i, k in keep.items()}
    return {"output": str(dst), "name": name, "task_id": mask.task_id, "cover": cover, "kept_per_layer": kept,
            "experts_per_layer": {str(i): int(k.size) for i, k in keep.items()}, "sparsity": mask.sparsity,
            "quality": mask.quality}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf moe-mask``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("model", metavar="MODEL", help="a .cmf file with MoE layers")
    p.add_argument("--name", required=True, help="task name of the new mask")
    p.add_argument("--stats", default=None, metavar="STATS.json",
                   help="route statistics {layer: [count per expert]} (default: provenance.moe_defrag.routing_counts)")
    p.add_argument("--cover", type=float, default=DEFAULT_COVER, help="routing mass to keep per layer (0.95)")
    p.add_argument("--heldout", metavar="TEXT", default=None, help="held-out text: measure the quality contract")
    p.add_argument("--window", type=int, default=512, help="held-out window in tokens (512)")
    p.add_argument("--chunks", type=int, default=None, help="held-out: score at most this many windows")
    p.add_argument("--description", default=None)
    p.add_argument("--replace", action="store_true", help="replace a mask of the same name")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("-o", "--output", default=None, help="write a new file with the mask added")
    dst.add_argument("--in-place", action="store_true", help="add the mask to MODEL by append-only growth")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf moe-mask``."""
    rep = moe_mask(args.model, args.name, stats=args.stats, cover=args.cover, heldout=args.heldout,
                   window=args.window, chunks=args.chunks, out=args.output, in_place=args.in_place,
                   replace=args.replace, description=args.description)
    if args.json:
        print_json(rep)
        return 0
    q = rep["quality"]
    quality = "unmeasured" if q is None else f"heldout_ppl_ratio={q['value']:.4f}"
    layers = ", ".join(f"{k}:{v}/{rep['experts_per_layer'][k]}" for k, v in rep["kept_per_layer"].items())
    restricted = [int(k) for k, v in rep["kept_per_layer"].items() if v < rep["experts_per_layer"][k]]
    print(sanitize(f"mask {rep['name']!r} (task {rep['task_id']}) -> {rep['output']}: cover {rep['cover']:g}, "
                   f"experts kept {layers}; restricted layers {fmt_ranges(restricted) or 'none'}; "
                   f"sparsity {rep['sparsity']:.3f}, quality {quality}"))
    return 0
