"""``cmf quant-report SOURCE``: what each quantization would cost and lose on a model's matrices.

SOURCE is a .cmf file (its matrices decoded to f32 are the reference) or a Hugging Face
checkpoint folder (safetensors read through :class:`cmf.convert.source.Checkpoint`: f16 and
bf16 widened to f32, bf16 as ``bits << 16``). The matrices are those a conversion would
quantize: 2-D, at least 32 elements, not one the policy keeps f16 (routers, shared-expert gates,
``g_proj``, conv1d, GDN a/b). For every dtype asked for, each matrix is encoded and decoded
once, and the report gives, over all of them:

- bits per weight = payload bytes × 8 / elements;
- relative RMS error = sqrt(Σ(decoded − source)² / Σ source²);
- for q4tp, the RMS perturbation of requantizing the q4t-decoded matrix to q4tp, relative to
  the q4t values (what ``cmf requant --quant q4tp`` does to a q4t file; FORMATS.md quotes 1.14%).

A matrix a dtype cannot hold (input width not a multiple of 32, q1t wider than 65536) is
counted as q8_2f, the converter's fallback, and reported under ``fallbacks``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import fmt_count, print_json, sanitize, table

NAME = "quant-report"
SUMMARY = "bits per weight and error of each quantization on a model's matrices (.cmf or HF folder)"
DEFAULT_QUANTS = ("q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "vbit_ro")


def _matrices(source: Path, include: Sequence[str]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, f32 matrix) for every matrix a conversion would quantize."""
    from ..convert.policy import FORCE_F16

    def wanted(name: str, shape: tuple[int, ...]) -> bool:
        n = int(np.prod(shape)) if shape else 1
        if len(shape) != 2 or n < 32 or FORCE_F16.search(name) or name.endswith(".tid2eid"):
            return False
        return not include or any(fnmatch.fnmatchcase(name, g) for g in include)

    if source.is_dir():
        from ..convert.source import FLOAT_DTYPES, Checkpoint

        with Checkpoint(source) as ck:
            for name in ck:
                t = ck.tensors[name]
                if t.dtype in FLOAT_DTYPES and wanted(name, t.shape):
                    yield name, ck.read(name)
        return
    from .. import quant
    from ..format.constants import RESERVED_DTYPES
    from ..format.reader import open as cmf_open

    with cmf_open(source) as f:
        for t in f.tensors():
            if t.dtype not in RESERVED_DTYPES and wanted(t.name, tuple(t.shape)):
                yield t.name, np.ascontiguousarray(quant.decode(t.numpy(), t.dtype, t.shape), dtype=np.float32)


def _fits(dtype, shape: tuple[int, int]) -> bool:  # noqa: ANN001 - a Dtype
    from ..format.dtypes import shape_error

    return shape_error(dtype, shape) is None


class _Acc:
    def __init__(self) -> None:
        self.bytes = 0
        self.elements = 0
        self.err2 = 0.0
        self.ref2 = 0.0
        self.fallbacks = 0
        self.seconds = 0.0
        self.pert2 = 0.0
        self.pref2 = 0.0

    @staticmethod
    def sq(a: np.ndarray) -> float:
        a = a.astype(np.float64, copy=False).ravel()
        return float(a @ a)


def quant_report(source: str | Path, quants: Sequence[str] = DEFAULT_QUANTS, *, include: Sequence[str] = (),
                 progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Encode every matrix of ``source`` as each of ``quants``; return bits per weight and errors."""
    from .. import quant
    from ..format.constants import RESERVED_DTYPES, Dtype
    from ..format.errors import UnsupportedDtype

    source = Path(source)
    dtypes = [quant.resolve_dtype(q) for q in quants]
    reserved = [d.label for d in dtypes if d in RESERVED_DTYPES]
    if reserved:
        raise UnsupportedDtype(f"reserved dtype(s) {', '.join(reserved)} cannot be encoded")
    accs = {d: _Acc() for d in dtypes}
    count = 0
    total = 0
    for name, w in _matrices(source, include):
        count += 1
        total += w.size
        ref2 = _Acc.sq(w)
        q4t = None
        for d in dtypes:
            acc = accs[d]
            use = d if _fits(d, w.shape) else Dtype.Q8_2F
            acc.fallbacks += use != d
            t0 = time.perf_counter()
            data = quant.encode(w, use)
            acc.seconds += time.perf_counter() - t0
            got = quant.decode(data, use, w.shape)
            acc.bytes += len(data)
            acc.elements += w.size
            acc.err2 += _Acc.sq(got - w)
            acc.ref2 += ref2
            if d == Dtype.Q4TP and use == d:
                if q4t is None:
                    q4t = quant.decode(quant.encode(w, Dtype.Q4_TILED), Dtype.Q4_TILED, w.shape)
                moved = quant.decode(quant.encode(q4t, Dtype.Q4TP), Dtype.Q4TP, w.shape)
                acc.pert2 += _Acc.sq(moved - q4t)
                acc.pref2 += _Acc.sq(q4t)
        if progress is not None:
            progress(1)
    rows = []
    for d, acc in accs.items():
        row: dict[str, Any] = {
            "dtype": d.label,
            "bits_per_weight": acc.bytes * 8 / acc.elements if acc.elements else None,
            "rel_rms": float(np.sqrt(acc.err2 / acc.ref2)) if acc.ref2 > 0 else None,
            "bytes": acc.bytes, "fallbacks": acc.fallbacks,
            "encode_mweights_per_s": acc.elements / acc.seconds / 1e6 if acc.seconds > 0 else None,
        }
        if d == Dtype.Q4TP:
            row["q4t_perturbation"] = float(np.sqrt(acc.pert2 / acc.pref2)) if acc.pref2 > 0 else None
        rows.append(row)
    return {"source": str(source), "kind": "hf" if source.is_dir() else "cmf", "matrices": count,
            "elements": total, "dtypes": rows}


def render(d: dict[str, Any]) -> str:
    """The per-dtype table and a line on the q4tp requant perturbation."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.2f}%"

    rows = [[r["dtype"], "-" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.3f}",
             pct(r["rel_rms"]), r["fallbacks"] or ""] for r in d["dtypes"]]
    lines = [f"{sanitize(d['source'])}: {d['matrices']} matrices, {fmt_count(d['elements'])} weights",
             table(rows, ["dtype", "bits/weight", "rel RMS error", "q8_2f fallbacks"], right=(1, 2, 3))]
    for r in d["dtypes"]:
        if r.get("q4t_perturbation") is not None:
            lines.append(f"q4tp: requantizing the q4t values moves them by {pct(r['q4t_perturbation'])} RMS")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf quant-report``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("source", metavar="SOURCE", help="a .cmf file or a Hugging Face checkpoint folder")
    p.add_argument("--quant", metavar="LIST", default=",".join(DEFAULT_QUANTS),
                   help=f"comma-separated dtypes (default {','.join(DEFAULT_QUANTS)})")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only matrices whose name matches (repeatable)")
    p.add_argument("--eval", metavar="TEXT",
                   help="also write each dtype as a file (the converter's policy) and print its perplexity on TEXT "
                        "(SOURCE must be a .cmf)")
    p.add_argument("--calib", metavar="TEXT", help="with --eval: each dtype also calibrated on TEXT (docs/QUANT.md)")
    p.add_argument("--calib-tokens", type=int, default=None, metavar="N", help="calibration tokens (default 16384)")
    p.add_argument("--chunks", type=int, default=8, metavar="N", help="with --eval: windows of 512 scored (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf quant-report``."""
    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    if not quants:
        sys.stderr.write("cmf: error: --quant needs at least one dtype (see 'cmf quant-report --help')\n")
        return 2
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit=" matrices", desc="quant-report", file=sys.stderr, leave=False)
    if args.calib is not None and args.eval is None:
        sys.stderr.write("cmf: error: --calib needs --eval TEXT (see 'cmf quant-report --help')\n")
        return 2
    try:
        d = quant_report(args.source, quants, include=args.include, progress=bar.update if bar is not None else None)
        if args.eval is not None:
            from ._quant_eval import eval_report

            d["eval"] = eval_report(args.source, quants, args.eval, calib_text=args.calib,
                                    calib_tokens=args.calib_tokens, chunks=args.chunks)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(d)
    else:
        print(render(d))
        if "eval" in d:
            from ._quant_eval import render_eval

            print("\n".join(render_eval(d["eval"])))
    return 0
