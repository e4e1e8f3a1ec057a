"""``cmf imagine-pack``: a diffusers text-to-image folder into one pipeline container (spec §12).

The work is :func:`cmf.image.packer.plan` / :func:`~cmf.image.packer.execute`; this module parses
arguments, draws the progress bar (source bytes, stderr, only on a TTY) and prints the result
or, with ``--dry-run``, the plan: the role policy, each tensor's role and dtype, per-component
totals.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import fmt_bytes, fmt_count, print_json, sanitize, table

NAME = "imagine-pack"
SUMMARY = "pack a diffusers text-to-image pipeline folder (Lumina-Image 2.0) into one .cmf file"
QUANT_HELP = "te/dit matrices: f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp (default q8)"
POLICY_HELP = ("ROLE=QUANT, repeatable: override a role's dtype; roles te, dit, vae, token_table, "
               "modulation, vector, other (docs/IMAGE.md)")


def render_plan(d: dict[str, Any], full: bool = True) -> str:
    """Text of :meth:`PackPlan.summary`."""
    pol = ", ".join(f"{k}={v}" for k, v in d["policy"].items())
    lines = [f"{sanitize(d['folder'])}: {sanitize(d['pipeline'])} -> arch {sanitize(d['arch_name'])}",
             f"policy: quant={d['quant']}; {sanitize(pol)}"]
    if full:
        rows = [[t["name"], "x".join(map(str, t["shape"])), t["source_dtype"], t["role"], t["dtype"], t["reason"],
                 fmt_bytes(t["bytes"])] for t in d["tensors"]]
        lines += ["", table(rows, ["tensor", "shape", "from", "role", "dtype", "why", "size"], right=(6,))]
    rows = []
    for prefix, c in d["components"].items():
        dts = ", ".join(f"{k} {v['tensors']}" for k, v in c["dtypes"].items())
        rows.append([prefix, c["tensors"], fmt_count(c["params"]), fmt_bytes(c["bytes"]), dts])
    lines += ["", table(rows, ["component", "tensors", "params", "size", "dtypes (tensors)"], right=(1, 2, 3))]
    if d["dropped"]:
        lines.append(f"not packed: {len(d['dropped'])} source tensor(s) text-to-image does not use "
                     f"(e.g. {sanitize(d['dropped'][0])})")
    if not d["validated"]:
        lines.append("configs not checked against weights (diffusers is not installed; the loader checks them)")
    lines.append(f"total: {len(d['tensors'])} tensors, source {fmt_bytes(d['source_bytes'])} -> "
                 f"{fmt_bytes(d['bytes'])} of tensors + {fmt_bytes(d['vocab_bytes'])} tokenizer")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf imagine-pack``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("folder", metavar="PIPELINE_DIR",
                   help="a diffusers pipeline folder (model_index.json, text_encoder, tokenizer, transformer, "
                        "vae, scheduler)")
    p.add_argument("-o", "--output", metavar="OUT.cmf", help="the file to write (required unless --dry-run)")
    p.add_argument("--quant", default="q8", metavar="QUANT", help=QUANT_HELP)
    p.add_argument("--policy", action="append", metavar="ROLE=QUANT", help=POLICY_HELP)
    p.add_argument("--dry-run", action="store_true", help="print the plan (tensor -> role, dtype); write nothing")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf imagine-pack``."""
    from ..image import packer
    from ..image.policy import parse_overrides

    if not args.dry_run and not args.output:
        sys.stderr.write(f"cmf: error: -o/--output is required unless --dry-run (see 'cmf {NAME} --help')\n")
        return 2
    plan = packer.plan(args.folder, args.quant, parse_overrides(args.policy))
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

        bar = tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=NAME,
                   file=sys.stderr, leave=False)
    try:
        result = packer.execute(plan, args.output, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    data = result.to_dict()
    summary = plan.summary()
    if args.json:
        data["plan"] = {k: v for k, v in summary.items() if k != "tensors"}
        print_json(data)
    else:
        print(f"{sanitize(data['path'])}: {data['tensors']} tensors, {fmt_bytes(data['bytes'])} "
              f"(source {fmt_bytes(data['source_bytes'])}) in {data['seconds']:.2f} s")
        print(render_plan(summary, full=False))
    return 0
