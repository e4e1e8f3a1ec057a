"""``cmf convert``: a Hugging Face checkpoint (local folder or hub id) into one verified .cmf.

The work is :func:`cmf.convert.convert`; this module parses arguments, draws the progress bar
(bytes of the source, stderr, only on a TTY) and prints the result or, with ``--dry-run``, the
plan: every tensor with its dtype and size, then totals per dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import fmt_bytes, fmt_count, print_json, sanitize, table
from ._calib_args import add_calib_arguments, add_size_arguments, calib_progress

NAME = "convert"
SUMMARY = "convert a Hugging Face checkpoint (folder or hub id) into a .cmf file"
QUANT_HELP = ("f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp (MoE profile: expert gate/up q2tp, rest q4tp), "
              "vbit, q1, q1p, q1s, q1t (default q8)")


def render_plan(d: dict[str, Any], full: bool = True) -> str:
    """Text of a plan summary (``Plan.summary()``)."""
    a = d["arch"]
    lines = [f"{sanitize(d['model'])}: {sanitize(d['model_type'])} -> arch {sanitize(a['arch_name'])}, "
             f"{a['num_layers']} layers, hidden {a['hidden_size']}, vocab {a['vocab_size']}",
             f"options: {sanitize(', '.join(f'{k}={v}' for k, v in d['options'].items()))}"]
    if full:
        rows = [[t["name"], "x".join(map(str, t["shape"])), t["source_dtype"], t["dtype"], t["reason"],
                 fmt_bytes(t["source_bytes"]), ("" if t["exact"] else "~") + fmt_bytes(t["bytes"])]
                for t in d["tensors"]]
        lines += ["", table(rows, ["tensor", "shape", "from", "dtype", "why", "source", "size"], right=(5, 6))]
    rows = [[k, v["tensors"], fmt_count(v["params"]), fmt_bytes(v["bytes"])] for k, v in d["dtypes"].items()]
    lines += ["", table(rows, ["dtype", "tensors", "params", "size"], right=(1, 2, 3))]
    if d["dropped"]:
        lines.append(f"dropped {len(d['dropped'])} tensor(s) of other towers (e.g. {sanitize(d['dropped'][0])})")
    lines.append(f"total: {len(d['tensors'])} tensors, source {fmt_bytes(d['source_bytes'])} -> "
                 f"{fmt_bytes(d['bytes'])} of tensors + {fmt_bytes(d['vocab_bytes'])} tokenizer"
                 + (", chat template" if d["chat_template"] else ""))
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf convert``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("-m", "--model", required=True, metavar="DIR_OR_HUB_ID",
                   help="a folder with config.json + safetensors, or a Hugging Face hub id")
    p.add_argument("-o", "--output", metavar="OUT.cmf", help="the file to write (required unless --dry-run)")
    p.add_argument("--quant", default="q8", metavar="QUANT", help=QUANT_HELP)
    p.add_argument("--attn-quant", metavar="QUANT", help="a different quant for attention projections")
    p.add_argument("--mean-bits", type=float, metavar="N", help="vbit budget in bits per weight (3..8, default 4.25)")
    p.add_argument("--route-stats", metavar="FILE",
                   help="router selection counts {layer: [count per expert]} for vbit MoE bit allocation")
    p.add_argument("--shard-max-gb", type=float, metavar="N", help="split the output into shards of at most N GB")
    p.add_argument("--dry-run", action="store_true", help="print the plan (tensor -> dtype, sizes); write nothing")
    p.add_argument("--revision", metavar="R", help="hub revision (branch, tag or commit)")
    add_calib_arguments(p)
    add_size_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf convert``."""
    from ..convert import hf

    if not args.dry_run and not args.output:
        sys.stderr.write("cmf: error: -o/--output is required unless --dry-run (see 'cmf convert --help')\n")
        return 2
    plan = hf.plan(args.model, args.quant, attn_quant=args.attn_quant, mean_bits=args.mean_bits,
                   route_stats=args.route_stats, shard_max_gb=args.shard_max_gb, revision=args.revision)
    if args.dry_run:
        plan.close()
        data = plan.summary()
        if args.json:
            print_json(data)
        else:
            print(render_plan(data))
        return 0
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
                   file=sys.stderr, leave=False)
    try:
        if args.calib is not None:
            with calib_progress(args) as cal_bar:
                from ..convert.calibrate import sensitivity_tokens_for

                hf.attach_calibration(plan, args.model, args.calib, Path(args.output).parent, revision=args.revision,
                                      tokens=args.calib_tokens, progress=cal_bar,
                                      sensitivity_tokens=sensitivity_tokens_for(args.sensitivity_tokens,
                                                                                args.target_mb, args.bpw))
        if args.target_mb is not None or args.bpw is not None:
            hf.fit_budget(plan, args.target_mb, args.bpw)
        result = hf.execute(plan, args.output, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    data = result.to_dict()
    if args.json:
        data["plan"] = {k: v for k, v in plan.summary().items() if k != "tensors"}
        print_json(data)
    else:
        files = ", ".join(sanitize(p) for p in data["paths"])
        print(f"{files}: {data['tensors']} tensors, {fmt_bytes(data['bytes'])} "
              f"(source {fmt_bytes(data['source_bytes'])}) in {data['seconds']:.2f} s, "
              f"{data['source_gb_per_s']:.2f} GB/s")
        print(render_plan(plan.summary(), full=False))
    return 0
