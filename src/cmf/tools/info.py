"""``cmf info``: what a model file contains (spec §2–§7, §9, §12), rendered as text or JSON.

The data comes from :mod:`cmf.summary` (:func:`info`, :func:`list_tensors`); this module renders
it and holds the command's arguments.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..summary import family_of, info, list_tensors

__all__ = ["NAME", "SUMMARY", "add_parser", "family_of", "info", "list_tensors", "render", "render_tensors", "run"]
from . import fmt_bytes, fmt_count, print_json, sanitize, table

NAME = "info"
SUMMARY = "summarize a model: arch, parameters, dtypes by family, sections, skills, masks"

def _fmt_bpw(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _config_line(config: Any, limit: int = 12) -> str:
    if not isinstance(config, dict):
        return sanitize(json.dumps(config))[:200]
    items = []
    for k, v in config.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            items.append(f"{k}={json.dumps(v) if isinstance(v, str) else v}")
    more = len(config) - min(len(items), limit)
    text = ", ".join(items[:limit])
    return sanitize(text + (f", ... (+{more} more keys)" if more > 0 else ""))


def render(d: dict[str, Any]) -> str:
    """Human-readable text of :func:`info`'s data."""
    a = d["arch"]
    files = d["files"]
    lines = [f"{sanitize(d['path'])}: CMF v{d['version']}, {fmt_bytes(d['size'])}"
             + (f" in {len(files)} shards" if len(files) > 1 else "")
             + ("" if d["runnable"] else "  [standalone skill file: not runnable]"),
             f"features: {', '.join(d['features']) or '-'}"]
    kinds = ", ".join(f"{n} {k}" for k, n in a["layer_types"].items())
    lines.append(f"arch: {sanitize(a['arch_name'])}  layers={a['num_layers']} ({sanitize(kinds)})"
                 + (f" x{a['num_loops']} loops" if "num_loops" in a else ""))
    lines.append(f"  hidden={a['hidden_size']} intermediate={a['intermediate_size']} "
                 f"heads={a['num_attention_heads']}/{a['num_kv_heads']}kv head_dim={a['head_dim']} "
                 f"vocab={a['vocab_size']} ctx={a['max_position_embeddings']} rope_theta={a['rope_theta']:g}")
    if "moe" in a:
        m = a["moe"]
        lines.append(f"  moe: {m['num_experts']} experts, top-{m['top_k']}, "
                     f"expert intermediate={m['moe_intermediate_size']}")
    if "mtp_layers" in a:
        lines.append(f"  mtp: {a['mtp_layers']} layer(s)")
    lines.append(f"quant_type: {sanitize(d['quant_type'])}")
    skill_note = f" (+{fmt_count(d['skill_parameters'])} in skill replacements)" if d["skill_parameters"] else ""
    lines.append(f"parameters: {fmt_count(d['parameters'])} ({d['parameters']:,}){skill_note} "
                 f"in {d['tensors']} tensors")
    lines += ["", table([[r["family"], r["dtype"], r["tensors"], fmt_count(r["params"]), fmt_bytes(r["bytes"]),
                          _fmt_bpw(r["bits_per_weight"])] for r in d["dtypes"]],
                        ["family", "dtype", "tensors", "params", "size", "bpw"], right=(2, 3, 4, 5))]
    sec_header = ["section", "offset", "size"] + (["file"] if len(files) > 1 else [])
    lines += ["", table([[s["name"], s.get("offset", "-"), fmt_bytes(s["bytes"])]
                         + ([s["file"]] if len(files) > 1 else []) for s in d["sections"]],
                        sec_header, right=(1, 2))]
    lines.append(f"hashes: header {d['header_hash']}, dir {d['dir_hash']}")
    tok = d["tokenizer"]
    lines.append(f"tokenizer: {fmt_bytes(tok['vocab_bytes']) if tok['vocab_bytes'] else 'none'}"
                 f"{', chat template' if tok['chat_template'] else ''}")
    if "pipeline" in d:
        lines += ["", "pipeline components:"]
        for c in d["pipeline"]["components"]:
            dts = ", ".join(f"{n} {k}" for k, n in c["dtypes"].items())
            lines.append(f"  {c['namespace']}: {c['tensors']} tensors, {fmt_count(c['params'])} params, "
                         f"{fmt_bytes(c['bytes'])} ({dts})")
            if c.get("config_error"):
                lines.append(f"    config: unreadable ({sanitize(c['config_error'])})")
            elif c["config"] is not None:
                lines.append(f"    config: {_config_line(c['config'])}")
    if d["skills"]:
        lines += ["", table([[s["id"], s["name"] or "-", s["tensors"], fmt_bytes(s["bytes"]),
                              s["layers"] and ",".join(map(str, s["layers"])) or "-",
                              "yes" if s["routable"] else "no"] for s in d["skills"]],
                            ["skill", "name", "tensors", "size", "layers", "routable"], right=(2, 3))]
    else:
        lines.append("skills: none")
    m = d["masks"]
    if m:
        tasks = ", ".join(f"{t['name']}{'*' if t['name'] == m['default_task'] else ''} "
                          f"({t['sparsity']:.3f})" for t in m["tasks"])
        lines.append(f"masks: {len(m['tasks'])} ({sanitize(tasks)}); * = default; 'cmf masks' for details")
    else:
        lines.append("masks: none")
    lines.append(f"signature: {'present (cmf verify checks it)' if d['signature'] else 'none'}")
    lines += _render_interchange(d["interchange"])
    return "\n".join(lines)


def _render_interchange(x: dict[str, Any]) -> list[str]:
    """The needs / runs-here lines (docs/INTERCHANGE.md)."""
    lines = [f"needs: {sanitize(', '.join(x['needs'])) or '-'}",
             "runs here: yes" if x["runs_here"] else f"runs here: no ({sanitize('; '.join(x['why_not']))})"]
    if x["reference_unknown"]:
        lines.append(f"needs a reader that understands: {sanitize(x['reference_unknown_text'])} "
                     f"(the reference's loader does not read it and would compute other numbers)")
    if x["reference_unwritten_dtypes"]:
        dts = ", ".join(f"{k} ({n} tensors)" for k, n in x["reference_unwritten_dtypes"].items())
        lines.append(f"dtypes the reference tools never write: {dts}; allowed by the spec and read by its readers")
    return lines


def render_tensors(d: dict[str, Any]) -> str:
    """Text listing of :func:`list_tensors`' data."""
    rows = [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", fmt_count(t["params"]),
             fmt_bytes(t["bytes"]), _fmt_bpw(t["bits_per_weight"]), t["hash"]] for t in d["tensors"]]
    tot = d["total"]
    return (table(rows, ["name", "dtype", "shape", "params", "size", "bpw", "hash64"], right=(3, 4, 5))
            + f"\n{tot['tensors']} tensors, {fmt_count(tot['params'])} params, {fmt_bytes(tot['bytes'])}")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf info``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("model", metavar="MODEL", help="a .cmf file (any shard of a set)")
    p.add_argument("--tensors", metavar="PREFIX", nargs="?", const="",
                   help="list the tensors whose name starts with PREFIX (all without PREFIX)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf info``."""
    if args.tensors is not None:
        data = list_tensors(args.model, args.tensors)
        if args.json:
            print_json(data)
        else:
            print(render_tensors(data))
    else:
        data = info(args.model)
        if args.json:
            print_json(data)
        else:
            print(render(data))
    return 0
