"""``cmf mask create``: a task mask from calibration text, with a measured quality contract.

1. Calibrate: run the model (unmasked) teacher-forced over the calibration text in windows with
   a fresh cache each, and record per dense-FFN layer the activation mass of every neuron,
   Σ_tokens |act(gate·x)·(up·x)| (the input of ``down_proj``); with ``--heads`` the output norm
   of every attention head, Σ_tokens ‖head output‖ (the input of ``o_proj``); per MoE layer the
   expert selection counts.
2. Select: keep the top ``--keep`` fraction of neurons. ``--per-layer`` keeps exactly that
   fraction in every layer; by default one budget spans the model and neurons compete on their
   mass relative to their layer's mean (layers that concentrate their mass give up more), with
   at least one neuron per layer. Heads: the top ``--head-keep`` (default ``--keep``) of each
   layer, at least one. MoE layers keep the top fraction of their experts by selections, written
   as expert rows (spec §5): routing renormalizes over the kept set.
3. Measure (``--heldout``): held-out perplexity with the mask over perplexity without it, by the
   ``cmf ppl`` protocol, written as the mask's ``quality`` (spec §5.1). Without ``--heldout`` the
   quality is null ("unmeasured"): a quality is never declared, only measured.
4. Write: ``--in-place`` (append-only growth, spec §9) or ``-o OUT`` (a rewrite).

Sparsity is the fraction of FFN neurons inactive: dense neurons plus the neurons of dropped
experts, over all of them.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.errors import CmfError
from ..format.masks import TaskMask
from . import fmt_ranges, print_json, sanitize
from ._maskio import mask_sparsity

log = logging.getLogger(__name__)

NAME = "mask"
SUMMARY = "create a task mask from calibration text, with its held-out quality measured (mask create)"


# ----------------------------------------------------------------------------- calibration


class _Probe:
    """A LinearOp wrapper that adds up per-column |input| (or per-head input norms) as it runs."""

    def __init__(self, op, heads: int = 0) -> None:
        self.op, self.heads = op, heads
        self.out_features, self.in_features = op.out_features, op.in_features
        self.mass = np.zeros(heads or op.in_features, np.float64)

    def _record(self, x: np.ndarray) -> None:
        x2 = np.asarray(x, dtype=np.float32).reshape(-1, self.in_features)
        if self.heads:
            self.mass += np.linalg.norm(x2.reshape(x2.shape[0], self.heads, -1), axis=-1).sum(axis=0)
        else:
            self.mass += np.abs(x2).sum(axis=0, dtype=np.float64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self._record(x)
        return self.op(x)

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        self._record(x)
        return self.op.rows(rows, x)

    def dense(self) -> np.ndarray:
        return self.op.dense()


@dataclass
class Scores:
    """Calibration scores per layer index: neuron mass, head norms, expert selections."""

    ffn: dict[int, np.ndarray] = field(default_factory=dict)
    heads: dict[int, np.ndarray] = field(default_factory=dict)
    experts: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: int = 0


def calibrate(model, ids: list[int], window: int = 512, heads: bool = False) -> Scores:
    """Run ``model`` unmasked over ``ids`` (windows of ``window`` tokens, fresh cache each) and
    return the activation statistics of :class:`Scores`."""
    from ..runtime.blocks import Attention, DenseFfn, LatentAttention

    if not ids:
        raise CmfError("the calibration text encodes to no tokens")
    window = max(1, min(int(window), model.ctx_size))
    model.use_mask(None)
    probes: dict[int, tuple[Any, str, _Probe]] = {}
    attn: dict[int, tuple[Any, _Probe]] = {}
    for i, b in enumerate(model._blocks):
        if isinstance(b.ffn, DenseFfn):
            probes[i] = (b.ffn, "down", _Probe(b.ffn.down))
            b.ffn.down = probes[i][2]
        if heads and isinstance(b.mixer, (Attention, LatentAttention)):
            attn[i] = (b.mixer, _Probe(b.mixer.o, heads=b.mixer.a.heads))
            b.mixer.o = attn[i][1]
    moe = bool(model.moe_layers)
    if moe:
        model.reset_route_stats()
        model.collect_route_stats(True)
    try:
        for s in range(0, len(ids), window):
            model.prefill(ids[s:s + window], model.new_cache())
        out = Scores(tokens=len(ids))
        out.ffn = {i: p.mass for i, (_, _, p) in probes.items()}
        out.heads = {i: p.mass for i, (_, p) in attn.items()}
        if moe:
            out.experts = {int(k): np.asarray(v, np.float64) for k, v in model.route_stats().items()}
        return out
    finally:
        for ffn, _, p in probes.values():
            ffn.down = p.op
        for mixer, p in attn.values():
            mixer.o = p.op
        if moe:
            model.collect_route_stats(False)


# ----------------------------------------------------------------------------- selection


def _top(scores: np.ndarray, n: int) -> np.ndarray:
    """bool mask of the ``n`` largest scores (ties: the lower index)."""
    keep = np.zeros(scores.size, bool)
    keep[np.argsort(-scores, kind="stable")[:max(1, min(n, scores.size))]] = True
    return keep


def select_neurons(scores: dict[int, np.ndarray], keep: float, per_layer: bool) -> dict[int, np.ndarray]:
    """Live neurons per layer: the top ``keep`` fraction per layer, or of one model-wide budget
    ranked by mass relative to the layer mean (at least one neuron per layer)."""
    if per_layer:
        return {i: _top(s, int(round(keep * s.size))) for i, s in scores.items()}
    if not scores:
        return {}
    layers = sorted(scores)
    rel = [scores[i] / (scores[i].mean() if scores[i].mean() > 0 else 1.0) for i in layers]
    pooled = np.concatenate(rel)
    live = _top(pooled, int(round(keep * pooled.size)))
    out, start = {}, 0
    for i, r in zip(layers, rel):
        k = live[start:start + r.size].copy()
        if not k.any():
            k[int(np.argmax(r))] = True
        out[i] = k
        start += r.size
    return out


def build_mask(model, scores: Scores, name: str, keep: float, *, per_layer: bool = False,
               heads: bool = False, head_keep: float | None = None,
               description: str | None = None) -> TaskMask:
    """The TaskMask that keeps the top fraction (see the module docstring). ``quality`` is None."""
    if not 0.0 < keep <= 1.0:
        raise CmfError(f"--keep {keep} is not in (0, 1]")
    hk = keep if head_keep is None else float(head_keep)
    if not 0.0 < hk <= 1.0:
        raise CmfError(f"--head-keep {hk} is not in (0, 1]")
    a = model.arch
    L, inter, nh = a.num_layers, a.intermediate_size, a.num_attention_heads
    ffn = np.ones((L, inter), bool)
    for i, live in select_neurons(scores.ffn, keep, per_layer).items():
        if live.size > inter:
            raise CmfError(f"layer {i}: {live.size} FFN neurons but the header's intermediate_size is {inter}")
        ffn[i, :] = False  # neurons past this layer's width do not exist
        ffn[i, :live.size] = live
    head_rows = np.ones((L, nh), bool)
    if heads:
        for i, norms in scores.heads.items():
            if norms.size <= nh:
                head_rows[i, :] = False
                head_rows[i, :norms.size] = _top(norms, int(round(hk * norms.size)))
    experts = None
    if scores.experts and keep < 1.0:
        experts = np.zeros((L, a.num_experts), bool)  # an empty row is "unrestricted"
        for i, counts in scores.experts.items():
            kept = _top(counts, int(round(keep * counts.size)))
            experts[i, :counts.size] = kept
    if description is None:
        description = (f"cmf mask create: keep {keep:g} ({'per layer' if per_layer else 'model-wide'})"
                       + (f", heads {hk:g}" if heads else "") + f", {scores.tokens} calibration tokens")
    mask = TaskMask(task_id=0, name=name, ffn=ffn, heads=head_rows, gates=np.ones(L, bool), experts=experts,
                    description=description, quality=None)
    mask.sparsity = mask_sparsity(model, mask)
    return mask


# ----------------------------------------------------------------------------- the verb


def create_mask(model_path: str | os.PathLike, name: str, calib: str | os.PathLike, *, keep: float,
                heldout: str | os.PathLike | None = None, per_layer: bool = False, heads: bool = False,
                head_keep: float | None = None, window: int = 512, max_tokens: int | None = None,
                chunks: int | None = None, out: str | os.PathLike | None = None, in_place: bool = False,
                replace: bool = False, description: str | None = None) -> dict[str, Any]:
    """Calibrate, select, measure and write one task mask; returns a report (see module docstring)."""
    from ..runtime.model import load
    from ._maskio import measure_quality, read_text, with_mask, write_masks
    from .masks import _layers_touched
    from .perplexity import encode_text

    if not name or not isinstance(name, str):
        raise CmfError("a mask needs a --name")
    if in_place == (out is not None):
        raise CmfError("give exactly one of an output path (-o) and --in-place")
    from ..format.atomic import check_writable

    if in_place or Path(out).parent.is_dir():  # type: ignore[arg-type] - a missing folder: the writer's error
        check_writable(model_path if in_place else out, in_place=in_place)  # before the calibration
    calib_text, _ = read_text(calib)
    model = load(model_path)
    try:
        ids = encode_text(model.tokenizer, calib_text)
        if max_tokens is not None:
            ids = ids[:max(0, int(max_tokens))]
        scores = calibrate(model, ids, window, heads)
        mask = build_mask(model, scores, name, keep, per_layer=per_layer, heads=heads, head_keep=head_keep,
                          description=description)
        measure_quality(model, mask, heldout, window, chunks)
        masks = with_mask(model.file.masks, mask, replace=replace)
        n_layers = model.arch.num_layers
    finally:
        model.close()
    dst = write_masks(model_path, masks, out, in_place=in_place)
    touched = _layers_touched(mask, n_layers)
    return {"output": str(dst), "name": name, "task_id": mask.task_id, "sparsity": mask.sparsity,
            "keep": keep, "per_layer": per_layer, "heads": heads, "calibration_tokens": scores.tokens,
            "quality": mask.quality, "layers": touched["layers"], "default_task": masks.default_task}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf mask create``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    sub = p.add_subparsers(dest="mask_command", metavar="SUBCOMMAND", required=True)
    c = sub.add_parser("create", help="calibrate, select the top neurons, measure held-out quality, write",
                       description=__doc__.split("\n\n")[0])
    c.add_argument("model", metavar="MODEL", help="a .cmf file")
    c.add_argument("--name", required=True, help="task name of the new mask")
    c.add_argument("--calib", required=True, metavar="TEXT", help="calibration text file (UTF-8)")
    c.add_argument("--heldout", metavar="TEXT", default=None,
                   help="held-out text file: its perplexity ratio becomes the mask's quality (else unmeasured)")
    c.add_argument("--keep", type=float, required=True, metavar="FRACTION", help="fraction of FFN neurons kept")
    c.add_argument("--per-layer", action="store_true", help="keep exactly FRACTION in every layer "
                   "(default: one model-wide budget, neurons ranked by mass relative to their layer)")
    c.add_argument("--heads", action="store_true", help="also mask attention heads by output norm")
    c.add_argument("--head-keep", type=float, default=None, metavar="FRACTION",
                   help="fraction of heads kept per layer with --heads (default: --keep)")
    c.add_argument("--window", type=int, default=512, help="tokens per window, calibration and held-out (512)")
    c.add_argument("--max-tokens", type=int, default=None, help="calibrate on at most this many tokens")
    c.add_argument("--chunks", type=int, default=None, help="held-out: score at most this many windows")
    c.add_argument("--description", default=None, help="the mask's description")
    c.add_argument("--replace", action="store_true", help="replace a mask of the same name")
    dst = c.add_mutually_exclusive_group(required=True)
    dst.add_argument("-o", "--output", default=None, help="write a new file with the mask added")
    dst.add_argument("--in-place", action="store_true", help="add the mask to MODEL by append-only growth")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf mask create``."""
    from ._runtime_args import announce_compiles

    announce_compiles()
    rep = create_mask(args.model, args.name, args.calib, keep=args.keep, heldout=args.heldout,
                      per_layer=args.per_layer, heads=args.heads, head_keep=args.head_keep, window=args.window,
                      max_tokens=args.max_tokens, chunks=args.chunks, out=args.output, in_place=args.in_place,
                      replace=args.replace, description=args.description)
    if args.json:
        print_json(rep)
        return 0
    q = rep["quality"]
    quality = "unmeasured" if q is None else (
        f"heldout_ppl_ratio={q['value']:.4f} (ppl {q['value'] * q['baseline_dense']:.4f} vs "
        f"{q['baseline_dense']:.4f} unmasked, {q['n_samples']} tokens)")
    print(sanitize(f"mask {rep['name']!r} (task {rep['task_id']}) -> {rep['output']}: sparsity "
                   f"{rep['sparsity']:.3f}, quality {quality}, layers {fmt_ranges(rep['layers'])}"))
    if rep["default_task"] != rep["name"]:
        sys.stdout.write(sanitize(f"default task: {rep['default_task']} (select this one with --task "
                                  f"{rep['name']})") + "\n")
    return 0
