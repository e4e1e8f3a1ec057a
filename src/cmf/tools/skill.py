"""``cmf skill add|list|remove|export|apply``: the skill registry's life cycle (spec §9, §9.1).

The work is done by :mod:`cmf.tools._skill_graft` (add, remove, list) and
:mod:`cmf.tools._skill_file` (standalone skill files); this module is the argparse wiring and
the text rendering.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import fmt_bytes, fmt_ranges, print_json, sanitize, table

NAME = "skill"
SUMMARY = "graft, list, remove, export and apply skills (replacement tensors + routing subspace)"


def _quality(q: Any) -> str:
    if not isinstance(q, dict) or not isinstance(q.get("backbone"), (int, float)) \
            or not isinstance(q.get("overlaid"), (int, float)):
        return "unmeasured" if q is None else "declared"
    bb, ov = float(q["backbone"]), float(q["overlaid"])
    pct = f" ({100.0 * (ov - bb) / bb:+.1f}%)" if bb else ""
    return f"{q.get('metric', 'ppl')} {bb:g} -> {ov:g}{pct}"


def render_list(rows: list[dict[str, Any]]) -> str:
    """The ``skill list`` table."""
    if not rows:
        return "no skills"
    body = [[r["id"], r["name"] or "-", r["tensors"], f"{r['bytes'] / 1e6:.2f}", fmt_ranges(r["layers"]),
             "yes" if r["routable"] else "no", _quality(r["quality"])
             + (" [standalone]" if r.get("standalone") else "")] for r in rows]
    return table(body, ["id", "name", "tensors", "MB", "layers", "routable", "quality"], right=(2, 3))


def render_add(d: dict[str, Any]) -> str:
    rec = d["record"]
    lines = [f"skill {sanitize(d['id'])}: {len(d['tensors'])} tensors, {fmt_bytes(d['bytes'])}, "
             f"layers {fmt_ranges(rec['layers'])} -> {sanitize(d['output'])}"
             + (" (grown in place)" if d["in_place"] else "")]
    sel = rec.get("selection")
    if sel:
        lines.append(f"routing: metric {sel['metric']}, phi_layer {sel['phi_layer']}, rank {sel['rank']}, "
                     f"training error {sel.get('err_mean', 0):.4f} +/- {sel.get('err_std', 0):.4f}")
    if "quality" in rec:
        lines.append(f"quality: {_quality(rec['quality'])} on {sanitize(rec['quality']['file'])} "
                     f"({rec['quality']['tokens']} tokens)")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf skill`` and its subcommands."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    sub = p.add_subparsers(dest="skill_command", metavar="SUBCOMMAND", title="subcommands")
    sub.required = True

    a = sub.add_parser("add", help="graft a fine-tuned donor's differing tensors as a skill",
                       description="Graft the tensors of DONOR (a fine-tune of the same architecture: HF "
                                   "folder, hub id or .cmf) that differ from BASE as skill.ID.* entries.")
    a.add_argument("base", metavar="BASE.cmf")
    a.add_argument("--from", dest="donor", required=True, metavar="DONOR")
    a.add_argument("--id", dest="skill_id", required=True, help="skill id, [A-Za-z0-9_-]")
    a.add_argument("--name", default=None, help="human-readable name")
    a.add_argument("--layers", default="all", help="all | A-B | i,j,k (default all)")
    a.add_argument("--tensors", choices=("ffn", "attn", "all"), default="ffn",
                   help="which tensors of each layer (default ffn)")
    a.add_argument("--min-delta", type=float, default=0.0,
                   help="keep a tensor only if ||donor - base|| / ||base|| exceeds this (default 0)")
    a.add_argument("--skill-quant", default=None, metavar="DTYPE",
                   help="dtype of the replacements (default: each base tensor's own)")
    a.add_argument("--prompts", default=None, metavar="FILE", help="prompts, one a line, to fit routing on")
    a.add_argument("--phi-layer", type=int, default=None, help="routing layer (default 2/3 of the depth)")
    a.add_argument("--rank", type=int, default=2, help="routing subspace rank (<= N-1, <= 8; default 2)")
    a.add_argument("--metric", choices=("mse", "mse_unit"), default="mse", help="routing metric (default mse)")
    a.add_argument("--quality", default=None, metavar="FILE", help="held-out text: measure ppl backbone vs skill")
    a.add_argument("--quality-tokens", type=int, default=1024, help="tokens scored for --quality (default 1024)")
    out = a.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output", default=None, metavar="OUT")
    out.add_argument("--in-place", action="store_true", help="append-only growth of BASE (no byte moves)")
    a.add_argument("--json", action="store_true")
    a.set_defaults(run=run_add)

    ls = sub.add_parser("list", help="the skills of a model: tensors, MB, layers, routable, quality")
    ls.add_argument("model", metavar="MODEL")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=run_list)

    rm = sub.add_parser("remove", help="rewrite a model without one skill's tensors and record")
    rm.add_argument("model", metavar="MODEL")
    rm.add_argument("--id", dest="skill_id", required=True)
    rm.add_argument("-o", "--output", default=None, metavar="OUT", help="write here (default: rewrite MODEL)")
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(run=run_remove)

    ex = sub.add_parser("export", help="cut a specialist into a standalone skill file bound to its base")
    ex.add_argument("specialist", metavar="SPECIALIST.cmf")
    ex.add_argument("--base", required=True, metavar="BASE.cmf")
    ex.add_argument("--id", dest="skill_id", required=True)
    ex.add_argument("-o", "--output", required=True, metavar="SKILL.cmf")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(run=run_export)

    ap = sub.add_parser("apply", help="overlay a standalone skill file on its base: a complete model")
    ap.add_argument("base", metavar="BASE.cmf")
    ap.add_argument("skill", metavar="SKILL.cmf")
    ap.add_argument("-o", "--output", required=True, metavar="OUT.cmf")
    ap.add_argument("--force", action="store_true",
                    help="apply even if the base's directory hash differs (the result is out of spec)")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(run=run_apply)
    return p


def _progress(enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None

    def show(name: str) -> None:
        sys.stderr.write(f"\r\x1b[Kcomparing {sanitize(name)[:100]}")
        sys.stderr.flush()

    return show


def run_add(args: argparse.Namespace) -> int:
    from ._skill_graft import add_skill

    d = add_skill(args.base, args.donor, args.skill_id, name=args.name, layers=args.layers, tensors=args.tensors,
                  min_delta=args.min_delta, skill_quant=args.skill_quant, prompts=args.prompts,
                  phi_layer=args.phi_layer, rank=args.rank, metric=args.metric, quality=args.quality,
                  quality_tokens=args.quality_tokens, output=args.output, in_place=args.in_place,
                  progress=_progress(not args.json))
    if sys.stderr.isatty() and not args.json:
        sys.stderr.write("\r\x1b[K")
    print_json(d) if args.json else print(render_add(d))
    return 0


def run_list(args: argparse.Namespace) -> int:
    from ._skill_graft import list_skills

    rows = list_skills(args.model)
    print_json(rows) if args.json else print(render_list(rows))
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from ._skill_graft import remove_skill

    d = remove_skill(args.model, args.skill_id, args.output)
    if args.json:
        print_json(d)
    else:
        print(f"removed skill {sanitize(d['id'])}: {d['tensors']} tensors, {fmt_bytes(d['bytes'])} "
              f"-> {sanitize(d['output'])}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from ._skill_file import export_skill

    d = export_skill(args.specialist, args.base, args.skill_id, args.output)
    if args.json:
        print_json(d)
    else:
        print(f"skill file {sanitize(d['output'])}: {d['tensors']} tensors, {fmt_bytes(d['size'])}, "
              f"layers {fmt_ranges(d['layers'])}, bound to base directory hash {d['base_dir_hash']}")
    return 0


def run_apply(args: argparse.Namespace) -> int:
    from ._skill_file import apply_skill

    d = apply_skill(args.base, args.skill, args.output, force=args.force)  # --force warns through the log
    if args.json:
        print_json(d)
    else:
        print(f"applied skill {sanitize(d['id'])}: {d['replaced']} tensors replaced -> {sanitize(d['output'])} "
              f"({fmt_bytes(d['size'])})")
    return 0
