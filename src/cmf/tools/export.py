"""``cmf export``: a .cmf back out to a Hugging Face folder (safetensors, config, tokenizer).

The work is :func:`cmf.convert.export`; this module parses arguments, draws the progress bar
(stderr, TTY only) and prints what was written. ``--format gguf`` is handled by the GGUF
exporter (``cmf.convert.gguf``) when it is installed in this tree.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import fmt_bytes, print_json, sanitize

NAME = "export"
SUMMARY = "write a .cmf as a Hugging Face folder (safetensors + config + tokenizer)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf export``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("model", metavar="MODEL.cmf", help="the model to export (any shard of a set)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder (created if needed)")
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"),
                   help="safetensors dtype (default: the source checkpoint's dtype if recorded, else f32)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf", help="output format (default hf)")
    p.add_argument("--gguf-type", choices=("F32", "F16", "Q8_0", "Q4_0"), default="F16",
                   help="tensor type of matrices for --format gguf (default F16); -o is then the .gguf file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf export``."""
    if args.format == "gguf":
        from ..convert.gguf_export import export_gguf

        out = export_gguf(args.model, args.output, args.gguf_type)
        data = {"file": str(out), "gguf_type": args.gguf_type, "bytes": out.stat().st_size}
        if args.json:
            print_json(data)
        else:
            print(f"{sanitize(out)}: GGUF ({args.gguf_type}), {fmt_bytes(data['bytes'])}")
        return 0
    from ..convert.export import export

    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="export", file=sys.stderr, leave=False)
    try:
        res = export(args.model, args.output, args.dtype, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    data = res.to_dict()
    if args.json:
        print_json(data)
    else:
        print(f"{sanitize(data['folder'])}: {data['tensors']} tensors ({data['dtype']}) in "
              f"{len(data['files'])} safetensors file(s), {fmt_bytes(data['bytes'])}, {data['seconds']:.2f} s")
    return 0
