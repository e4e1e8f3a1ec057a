"""``cmf moe-defrag``: drop the experts a task does not route to (spec §11.1).

Per MoE layer, keep the smallest top expert set reaching ``--cover`` of the recorded routing mass
(``--stats`` from ``cmf route-stats``, or the file's ``provenance.moe_defrag.routing_counts``),
then write a new file in which:

- kept experts are renumbered ``0 … k−1`` in their original relative order, and each layer's
  bank is laid out role-contiguously (all gate_proj, then all up_proj, then all down_proj);
- expert payloads are copied verbatim from the source mmap (byte-identical, hash re-checked);
- the router's rows and ``mlp.expert_bias`` are gathered in the same order (float routers only:
  a row gather is then exact);
- ``arch.moe.num_experts`` stays nominal, ``top_k`` clamps per layer at run time;
- ``provenance.moe_defrag`` records the cover, the kept original indices per layer and the
  routing counts in the new numbering (so the output can be cut again at a tighter cover);
- task masks carry over with their expert rows remapped; their quality contracts were measured
  on the full expert set, so they become null (unmeasured).

Routing over the kept set equals the runtime restriction (``CMF_MOE_MASK`` with the same cover,
or a ``moe-mask`` task) when ``norm_topk_prob`` is true. When it is false the expert weights are
the raw softmax probabilities: the runtime restriction keeps them normalised over ALL experts,
the defragged router over the kept ones, so the two differ (REFERENCE_NOTES §3; tested).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..format.constants import Dtype
from ..format.errors import CmfError, HashMismatch, WriterError
from . import print_json, sanitize

log = logging.getLogger(__name__)

NAME = "moe-defrag"
SUMMARY = "drop the experts outside the routing cover per MoE layer into a smaller standalone file"

DEFAULT_COVER = 0.95
_ROLE_ORDER = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
_SKILL = re.compile(r"^(skill\.[^.]+\.)?(.*)$")


def _rows(t, rows: np.ndarray) -> bytes:
    """Rows of a float matrix or vector's payload (an exact byte gather)."""
    size = {Dtype.F32: 4, Dtype.F16: 2, Dtype.BF16: 2}.get(t.dtype)
    if size is None:
        raise CmfError(f"{t.name}: router/bias dtype {t.dtype.label} cannot be gathered exactly "
                       f"(moe-defrag needs f32, f16 or bf16 routers, as the reference does)")
    per = size * (int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1)
    u8 = t.numpy().reshape(t.shape[0], per)
    return np.ascontiguousarray(u8[rows]).tobytes()


class _Layer:
    """What moe-defrag changes in one MoE layer: names and the kept experts."""

    def __init__(self, index: int, plan, keep: np.ndarray, counts: np.ndarray) -> None:
        first = plan.experts[0][0]
        self.index = index
        self.prefix = first[:first.index(".experts.") + len(".experts.")]  # model.layers.i.mlp.experts.
        self.router, self.bias = plan.router, plan.expert_bias
        self.kept = np.flatnonzero(keep).astype(np.int64)
        self.new_of = {int(e): j for j, e in enumerate(self.kept)}
        self.counts = counts

    def expert_of(self, name: str) -> tuple[int, str] | None:
        """(original expert index, rest of the name) for an expert tensor of this layer."""
        if not name.startswith(self.prefix):
            return None
        e, _, rest = name[len(self.prefix):].partition(".")
        return (int(e), rest) if e.isdigit() else None


def _layers(f, stats: dict[int, np.ndarray], cover: float) -> list[_Layer]:
    from ..runtime.ops.moe import cover_mask
    from ..runtime.plan import MoePlan, build_plan

    if not 0.0 < cover <= 1.0:
        raise CmfError(f"--cover {cover} is not in (0, 1]")
    plan = build_plan(f.arch, lambda n: f.tensor(n).shape if n in f else None)
    out = []
    for lp in plan.layers:
        if not isinstance(lp.ffn, MoePlan):
            continue
        counts = stats.get(lp.index)
        if counts is None:
            log.warning("layer %d: no route statistics; every expert is kept", lp.index)
            counts = np.ones(lp.ffn.n_experts)
        if counts.size != lp.ffn.n_experts:
            raise CmfError(f"route statistics: layer {lp.index} has {counts.size} counts, the file "
                           f"{lp.ffn.n_experts} experts")
        out.append(_Layer(lp.index, lp.ffn, cover_mask(counts, cover), counts))
    if not out:
        raise CmfError(f"{f.path}: the model has no MoE layers")
    for name in f.keys():
        if name.endswith(".tid2eid"):
            raise CmfError(f"{name}: token->expert tables cannot be renumbered by moe-defrag")
    return out


def _remap_masks(f, layers: list[_Layer]):
    """The file's masks with expert rows gathered to the kept experts and quality reset."""
    if f.masks is None:
        return None
    by_index = {lay.index: lay for lay in layers}
    out = []
    for m in f.masks:
        if m.experts is not None:
            ex = np.zeros_like(m.experts)
            for i in range(ex.shape[0]):
                lay = by_index.get(i)
                row = m.experts[i]
                if lay is None:
                    ex[i] = row
                    continue
                new = row[lay.kept]
                if row.any() and not new.any():
                    log.warning("mask %r: layer %d keeps none of its experts after defrag; the row now "
                                "reads as unrestricted", m.name, i)
                ex[i, :new.size] = new
            m.experts = ex
        if m.quality is not None:
            log.info("mask %r: quality contract measured on the full expert set; now unmeasured", m.name)
            m.quality = None
        out.append(m)
    return type(f.masks)(default_task=f.masks.default_task, masks=out, extra=dict(f.masks.extra))


def moe_defrag(src: str | os.PathLike, dst: str | os.PathLike, *, stats: str | os.PathLike | dict | None = None,
               cover: float = DEFAULT_COVER) -> dict[str, Any]:
    """Write ``dst``: ``src`` without the experts outside ``cover`` (see the module docstring)."""
    from ..format.hash64 import hash64
    from ..format.reader import open as cmf_open
    from ..format.writer import CmfWriter
    from ._maskio import read_stats

    src, dst = Path(src), Path(dst)
    with cmf_open(src) as f:
        if dst.exists() and any(dst.resolve() == p.resolve() for p in f.paths):
            raise WriterError(f"{dst}: the output would overwrite the input")
        header = f.header.to_dict()
        counts = read_stats(stats, header.get("provenance"))
        layers = _layers(f, counts, cover)
        by_prefix = {lay.prefix: lay for lay in layers}
        routers = {lay.router: lay for lay in layers}
        biases = {lay.bias: lay for lay in layers if lay.bias}

        def expert_layer(base: str) -> tuple[_Layer, int, str] | None:
            i = base.find(".experts.")
            lay = by_prefix.get(base[:i + len(".experts.")]) if i >= 0 else None
            hit = lay.expert_of(base) if lay is not None else None
            return (lay, *hit) if hit else None

        # Output order: directory order, each layer's expert bank (per skill prefix) emitted at its
        # first tensor, role-contiguously.
        plan: list[tuple[str, Any, str]] = []  # (new name, source tensor, how: copy|rows)
        banks_done: set[tuple[str, int]] = set()
        names = f.keys()
        for name in names:
            skill, base = _SKILL.match(name).groups()
            skill = skill or ""
            hit = expert_layer(base)
            if hit is not None:
                lay, _, _ = hit
                if (skill, lay.index) in banks_done:
                    continue
                banks_done.add((skill, lay.index))
                bank = []
                for other in names:
                    s2, b2 = _SKILL.match(other).groups()
                    h2 = expert_layer(b2) if (s2 or "") == skill else None
                    if h2 is not None and h2[0] is lay and h2[1] in lay.new_of:
                        j, rest = lay.new_of[h2[1]], h2[2]
                        role = _ROLE_ORDER.get(rest.split(".")[0], 3)
                        bank.append((role, rest if role == 3 else "", j, f"{skill}{lay.prefix}{j}.{rest}", other))
                plan.extend((new, f.tensor(old), "copy") for *_, new, old in sorted(bank))
            elif base in routers or base in biases:
                plan.append((name, f.tensor(name), "rows"))
            else:
                plan.append((name, f.tensor(name), "copy"))
        gather = {**routers, **biases}  # base name -> layer whose kept rows it takes
        experts_before = sum(len(lay.counts) for lay in layers)
        experts_after = sum(lay.kept.size for lay in layers)
        prov = dict(header.get("provenance") or {})
        prov["moe_defrag"] = {
            "source": src.name, "cover": cover, "experts_before": experts_before, "experts_after": experts_after,
            "kept_per_layer": {str(lay.index): lay.kept.tolist() for lay in layers},
            "routing_counts": {str(lay.index): [float(c) if c != int(c) else int(c) for c in lay.counts[lay.kept]]
                               for lay in layers},
        }
        header["provenance"] = prov
        header.pop("shard", None)
        masks = _remap_masks(f, layers)
        bytes_before = sum(t.nbytes for t in f.tensors())
        bytes_after = 0
        with CmfWriter(dst, header, expected_names=[p[0] for p in plan]) as w:
            for new, t, how in plan:
                view = t.numpy()
                if hash64(view) != t.hash:
                    raise HashMismatch(f"{src}: tensor {t.name!r} does not match its stored hash")
                if how == "rows":
                    _, base = _SKILL.match(t.name).groups()
                    lay = gather[base]
                    payload = _rows(t, lay.kept)
                    shape = (lay.kept.size, *t.shape[1:])
                    w.add(new, t.dtype, shape, payload)
                    bytes_after += len(payload)
                else:
                    w.add(new, t.dtype, t.shape, view, hash=t.hash)
                    bytes_after += t.nbytes
            if masks is not None:
                w.set_masks(masks)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
    return {"input": str(src), "output": str(dst), "cover": cover, "experts_before": experts_before,
            "experts_after": experts_after,
            "kept_per_layer": {str(lay.index): int(lay.kept.size) for lay in layers},
            "experts_per_layer": {str(lay.index): int(len(lay.counts)) for lay in layers},
            "tensor_bytes_before": bytes_before, "tensor_bytes_after": bytes_after}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf moe-defrag``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Kept experts are renumbered in "
                              "order and copied verbatim; router rows and expert_bias are gathered to match.")
    p.add_argument("model", metavar="MODEL", help="a .cmf file with MoE layers (any shard of a set)")
    p.add_argument("--stats", default=None, metavar="STATS.json",
                   help="route statistics {layer: [count per expert]} (default: provenance.moe_defrag.routing_counts)")
    p.add_argument("--cover", type=float, default=DEFAULT_COVER, help="routing mass to keep per layer (0.95)")
    p.add_argument("-o", "--output", required=True, help="the defragged file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf moe-defrag``."""
    from . import fmt_bytes

    rep = moe_defrag(args.model, args.output, stats=args.stats, cover=args.cover)
    if args.json:
        print_json(rep)
        return 0
    layers = ", ".join(f"{k}:{v}/{rep['experts_per_layer'][k]}" for k, v in rep["kept_per_layer"].items())
    print(sanitize(f"{rep['output']}: cover {rep['cover']:g}, experts {rep['experts_after']}/{rep['experts_before']} "
                   f"kept ({layers}); tensors {fmt_bytes(rep['tensor_bytes_before'])} -> "
                   f"{fmt_bytes(rep['tensor_bytes_after'])}"))
    return 0
