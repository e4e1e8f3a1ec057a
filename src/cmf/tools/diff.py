"""``cmf diff A B``: semantic difference of two models.

Compares what the files *mean*, not their bytes: arch keys, quant type and other header keys,
tensors by name (added, removed, changed = same name with a different dtype, shape or hash64),
skill records, task masks and the tokenizer. Layout (offsets, dead bytes, sharding) and the
derived ``section_hashes`` / ``shard`` header keys are ignored, so a model and its compacted or
re-sharded copy are identical.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..format.hash64 import hash64
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from ..image.components import components, render_lines
from . import fmt_bytes, fmt_count, print_json, sanitize

NAME = "diff"
SUMMARY = "semantic difference of two models (arch, tensors, skills, masks)"

_IGNORED_HEADER_KEYS = frozenset({"arch", "skills", "section_hashes", "shard"})


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (``moe.num_experts``); lists and scalars are leaves."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _key_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in b:
            out.append({"key": k, "change": "removed", "a": a[k]})
        elif k not in a:
            out.append({"key": k, "change": "added", "b": b[k]})
        elif a[k] != b[k]:
            out.append({"key": k, "change": "changed", "a": a[k], "b": b[k]})
    return out


def _tensor_map(f: CmfFile) -> dict[str, tuple[str, list[int], int]]:
    return {t.name: (t.dtype.label, list(t.shape), t.hash) for t in f.tensors()}


def _mask_key(m: Any) -> tuple[Any, ...]:
    arrays = [m.ffn, m.heads, m.gates] + ([] if m.experts is None else [m.experts])
    return (m.sparsity, json.dumps(m.quality, sort_keys=True), m.description, m.parent, m.priority,
            tuple(hash64(a.tobytes()) for a in arrays))


def diff(a: str | os.PathLike | CmfFile, b: str | os.PathLike | CmfFile) -> dict[str, Any]:
    """Semantic diff of two models (paths or open files). ``identical`` is True when nothing differs."""
    if not isinstance(a, CmfFile):
        with cmf_open(a) as fa:
            return diff(fa, b)
    if not isinstance(b, CmfFile):
        with cmf_open(b) as fb:
            return diff(a, fb)
    ha, hb = a.header.to_dict(), b.header.to_dict()
    arch = _key_changes(_flatten(ha.get("arch", {})), _flatten(hb.get("arch", {})))
    header = _key_changes({k: v for k, v in ha.items() if k not in _IGNORED_HEADER_KEYS},
                          {k: v for k, v in hb.items() if k not in _IGNORED_HEADER_KEYS})

    ta, tb = _tensor_map(a), _tensor_map(b)
    added = [{"name": n, "dtype": tb[n][0], "shape": tb[n][1]} for n in tb if n not in ta]
    removed = [{"name": n, "dtype": ta[n][0], "shape": ta[n][1]} for n in ta if n not in tb]
    changed = []
    for n, (dt, shape, h) in ta.items():
        if n in tb and tb[n] != (dt, shape, h):
            dt2, shape2, h2 = tb[n]
            entry: dict[str, Any] = {"name": n}
            if dt != dt2:
                entry["dtype"] = [dt, dt2]
            if shape != shape2:
                entry["shape"] = [shape, shape2]
            if h != h2:
                entry["hash"] = [f"{h:016x}", f"{h2:016x}"]
            changed.append(entry)
    unchanged = sum(1 for n in ta if n in tb) - len(changed)

    sa = {s["id"]: s for s in ha.get("skills") or [] if isinstance(s, dict) and "id" in s}
    sb = {s["id"]: s for s in hb.get("skills") or [] if isinstance(s, dict) and "id" in s}
    skills = {"added": [k for k in sb if k not in sa], "removed": [k for k in sa if k not in sb],
              "changed": [k for k in sa if k in sb and sa[k] != sb[k]]}

    ma = {m.name: m for m in a.masks} if a.masks is not None else {}
    mb = {m.name: m for m in b.masks} if b.masks is not None else {}
    masks = {"added": [k for k in mb if k not in ma], "removed": [k for k in ma if k not in mb],
             "changed": [k for k in ma if k in mb and _mask_key(ma[k]) != _mask_key(mb[k])]}
    default_a = a.masks.default_task if a.masks is not None else None
    default_b = b.masks.default_task if b.masks is not None else None
    if default_a != default_b:
        masks["default_task"] = [default_a, default_b]

    va, vb = a.tokenizer_json, b.tokenizer_json
    tokenizer_changed = (va is None) != (vb is None) or (va is not None and va != vb)

    comps = _components(a, b, changed, added, removed)
    identical = not (arch or header or added or removed or changed or tokenizer_changed
                     or any(skills.values()) or any(masks.values()))
    return {"a": str(a.path), "b": str(b.path), "identical": identical, "arch": arch, "header": header,
            "tensors": {"added": added, "removed": removed, "changed": changed, "unchanged": unchanged},
            "skills": skills, "masks": masks, "tokenizer_changed": tokenizer_changed,
            **({"components": comps} if comps is not None else {})}


def _components(a: CmfFile, b: CmfFile, changed: list[dict[str, Any]], added: list[dict[str, Any]],
                removed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pipeline containers (spec §12): each side's components and the tensor changes per component."""
    ca, cb = components(a), components(b)
    if ca is None and cb is None:
        return None
    per: dict[str, dict[str, int]] = {}
    for what, rows in (("changed", changed), ("added", added), ("removed", removed)):
        for e in rows:
            ns = e["name"].split(".", 1)[0]
            per.setdefault(ns, {"changed": 0, "added": 0, "removed": 0})[what] += 1
    return {"a": ca or [], "b": cb or [], "tensors": per}


def _val(v: Any) -> str:
    return sanitize(json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v))


def _key_lines(title: str, changes: list[dict[str, Any]]) -> list[str]:
    if not changes:
        return []
    lines = [f"{title}:"]
    for c in changes:
        k = sanitize(c["key"])
        if c["change"] == "added":
            lines.append(f"  + {k}: {_val(c['b'])}")
        elif c["change"] == "removed":
            lines.append(f"  - {k}: {_val(c['a'])}")
        else:
            lines.append(f"  ~ {k}: {_val(c['a'])} -> {_val(c['b'])}")
    return lines


def render(d: dict[str, Any]) -> str:
    """Text of :func:`diff`'s result: ``+`` in B only, ``-`` in A only, ``~`` changed."""
    lines = [f"--- {sanitize(d['a'])}", f"+++ {sanitize(d['b'])}"]
    lines += _key_lines("arch", d["arch"])
    lines += _key_lines("header", d["header"])
    t = d["tensors"]
    lines.append(f"tensors: {len(t['added'])} added, {len(t['removed'])} removed, "
                 f"{len(t['changed'])} changed, {t['unchanged']} unchanged")
    for e in t["added"]:
        lines.append(f"  + {sanitize(e['name'])}  {e['dtype']} {e['shape']}")
    for e in t["removed"]:
        lines.append(f"  - {sanitize(e['name'])}  {e['dtype']} {e['shape']}")
    for e in t["changed"]:
        parts = [f"{k} {e[k][0]} -> {e[k][1]}" for k in ("dtype", "shape", "hash") if k in e]
        lines.append(f"  ~ {sanitize(e['name'])}: {'; '.join(parts)}")
    for what in ("skills", "masks"):
        g = d[what]
        for sign, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
            for n in g[key]:
                lines.append(f"{what[:-1]} {sign} {sanitize(n)}")
        if "default_task" in g:
            lines.append(f"default mask: {_val(g['default_task'][0])} -> {_val(g['default_task'][1])}")
    if "components" in d:
        c = d["components"]
        for side, sign in (("a", "-"), ("b", "+")):
            lines.append(f"components {sign} {side.upper()}:")
            lines += [sanitize(x) for x in render_lines(c[side], fmt_count, fmt_bytes, indent="  ")]
        for ns, n in c["tensors"].items():
            lines.append(sanitize(f"component {ns}: {n['changed']} changed, {n['added']} added, "
                                  f"{n['removed']} removed tensors"))
    if d["tokenizer_changed"]:
        lines.append("tokenizer: changed")
    lines.append("identical" if d["identical"] else "models differ")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf diff``."""
    p = subparsers.add_parser(NAME, help=SUMMARY,
                              description=SUMMARY + ". Exit 0 when identical, 1 when they differ.")
    p.add_argument("a", metavar="A", help="first model")
    p.add_argument("b", metavar="B", help="second model")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf diff``: 0 identical, 1 different."""
    d = diff(args.a, args.b)
    if args.json:
        print_json(d)
    else:
        print(render(d))
    return 0 if d["identical"] else 1
