"""The components of a pipeline container (spec §12), from the directory alone (no torch).

Used by ``cmf verify`` and ``cmf diff`` (``cmf info`` has its own pipeline section), and by the
runtime verbs to refuse a pipeline file with a pointer to ``cmf imagine``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..format.constants import Dtype
from ..format.errors import NotRunnable
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .recipes import CONFIG_SUFFIX

NAMESPACES = ("te", "dit", "vae", "scheduler")
_WEIGHTS = ("te", "dit", "vae")  # a file with any of these is a pipeline container


def is_pipeline(names: list[str]) -> bool:
    """Whether tensor ``names`` hold a §12 component namespace."""
    return any(n.split(".", 1)[0] in _WEIGHTS for n in names)


def _class_of(f: CmfFile, ns: str) -> str | None:
    name = f"{ns}.{CONFIG_SUFFIX}"
    if name not in f:
        return None
    try:
        cfg = json.loads(bytes(f.tensor(name).data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    arch = cfg.get("architectures")
    cls = cfg.get("_class_name") or (arch[0] if isinstance(arch, list) and arch else cfg.get("model_type"))
    return str(cls) if cls is not None else None


def components(f: CmfFile) -> list[dict[str, Any]] | None:
    """Per component: namespace, class, tensors, params, bytes and {dtype: {tensors, params}};
    None for a file that is not a pipeline container. Config blobs (u8) are not parameters."""
    names = f.keys()
    if not is_pipeline(names):
        return None
    out: dict[str, dict[str, Any]] = {}
    for t in f.tensors():
        ns = t.name.split(".", 1)[0]
        if ns not in NAMESPACES:
            continue
        c = out.setdefault(ns, {"namespace": ns, "class": None, "tensors": 0, "params": 0, "bytes": 0, "dtypes": {}})
        p = 0 if t.dtype == Dtype.U8 else t.numel
        c["tensors"] += 1
        c["params"] += p
        c["bytes"] += t.nbytes
        d = c["dtypes"].setdefault(t.dtype.label, {"tensors": 0, "params": 0})
        d["tensors"] += 1
        d["params"] += p
    for ns, c in out.items():
        c["class"] = _class_of(f, ns)
    return [out[ns] for ns in NAMESPACES if ns in out]


def render_lines(comps: list[dict[str, Any]], fmt_count: Any, fmt_bytes: Any, indent: str = "  ") -> list[str]:
    """One line per component: ``te (Gemma2Model): 25 tensors, 98.9K params, 68.8 KiB; q4tp 14 (86K), ...``."""
    lines = []
    for c in comps:
        dts = ", ".join(f"{k} {v['tensors']}" + (f" ({fmt_count(v['params'])})" if v["params"] else "")
                        for k, v in sorted(c["dtypes"].items(), key=lambda kv: -kv[1]["params"]))
        cls = f" ({c['class']})" if c["class"] else ""
        lines.append(f"{indent}{c['namespace']}{cls}: {c['tensors']} tensors, {fmt_count(c['params'])} params, "
                     f"{fmt_bytes(c['bytes'])}; {dts}")
    return lines


def refuse_if_pipeline(path: str | os.PathLike[str], verb: str) -> None:
    """Raise :class:`NotRunnable` pointing at ``cmf imagine`` when ``path`` is a pipeline container.

    Anything that is not a readable .cmf is left for the caller's own loader to report.
    """
    try:
        f = cmf_open(path)
    except Exception:  # noqa: BLE001 - not ours to report: the runtime's loader says what is wrong
        return
    with f:
        if not is_pipeline(f.keys()):
            return
        arch = f.arch.arch_name
    raise NotRunnable(f"{path} is a text-to-image pipeline container (arch {arch!r}, spec §12: text encoder, "
                      f"denoiser and VAE), not a language model; 'cmf {verb}' cannot run it. Generate an image "
                      f"with: cmf imagine {path} -p PROMPT -o out.png", unmet=("pipeline",))
