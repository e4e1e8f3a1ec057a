"""``cmf compact IN -o OUT``: rewrite a model tightly (REFERENCE_NOTES §1.12).

Dead bytes left by append-only growth disappear and a shard set becomes one file; tensors are
copied byte for byte (hashes unchanged) by :func:`cmf.format.growth.compact`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..format.errors import WriterError
from ..format.growth import compact
from ..format.reader import open as cmf_open
from . import fmt_bytes, print_json, sanitize

NAME = "compact"
SUMMARY = "rewrite a model tightly (drops dead bytes, joins shards)"


def compact_model(src: str | os.PathLike, dst: str | os.PathLike) -> dict[str, Any]:
    """Compact ``src`` (a file or any shard of a set) into ``dst``; returns sizes before and after.

    Refuses to write over any file of the input (the output is written to a temporary file and
    renamed, but the input must stay intact until the copy is complete and checked).
    """
    with cmf_open(src) as f:
        inputs = list(f.paths)
        before = f.size
    dst = Path(dst)
    if dst.exists() and any(dst.resolve() == p.resolve() for p in inputs):
        raise WriterError(f"{dst}: the output would overwrite the input; choose another path")
    out = compact(src, dst)
    after = out.stat().st_size
    return {"input": [str(p) for p in inputs], "output": str(out), "before": before, "after": after,
            "saved": before - after}


def render(d: dict[str, Any]) -> str:
    """One line: input size, output size and the bytes saved."""
    pct = 100.0 * d["saved"] / d["before"] if d["before"] else 0.0
    src = sanitize(d["input"][0]) + (f" (+{len(d['input']) - 1} shards)" if len(d["input"]) > 1 else "")
    return (f"{src}: {fmt_bytes(d['before'])} -> {sanitize(d['output'])}: {fmt_bytes(d['after'])} "
            f"(saved {fmt_bytes(d['saved'])}, {pct:.1f}%)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf compact``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("model", metavar="IN", help="a .cmf file (any shard of a set)")
    p.add_argument("-o", "--output", metavar="OUT", required=True, help="the compacted file to write")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf compact``."""
    d = compact_model(args.model, args.output)
    if args.json:
        print_json(d)
    else:
        print(render(d))
    return 0
