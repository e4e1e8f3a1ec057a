"""``cmf explain MODEL -p PROMPT``: routing plus the first-token distribution under each candidate
(the backbone and every skill), so one sees what the routing choice changes."""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from . import print_json, sanitize
from .route import add_prompt_args, open_model, read_prompt, route_prompt

NAME = "explain"
SUMMARY = "routing plus the first-token distribution under each skill candidate"


def first_token(model, ids: list[int], top: int) -> dict[str, Any]:
    """Top-``top`` next tokens after ``ids`` with probabilities, confidence (max p) and entropy."""
    logits = model.prefill(ids, model.new_cache()).astype(np.float64).reshape(-1)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    k = min(top, p.size)
    idx = np.argpartition(-p, k - 1)[:k]
    idx = idx[np.lexsort((idx, -p[idx]))]
    tok = model.tokenizer
    nz = p[p > 0]
    return {"top": [{"id": int(i), "token": tok.decode([int(i)], skip_special_tokens=False), "p": float(p[i])}
                    for i in idx],
            "confidence": float(p.max()), "entropy": float(-(nz * np.log(nz)).sum())}


def explain(model, prompt: str, *, top: int = 8, raw: bool = False) -> dict[str, Any]:
    """Route ``prompt`` and list each candidate's first-token distribution (backbone first, then
    skills by routing error)."""
    from ..runtime.generate import prompt_ids_for

    d = route_prompt(model, prompt)
    ids = prompt_ids_for(model, prompt, raw=raw)
    order = [None] + list(d["scores"]) + d["unroutable"]
    cands = []
    for sid in order:
        model.select(skill=sid)
        c = {"skill": sid, "E": d["scores"].get(sid) if sid else None, **first_token(model, ids, top)}
        cands.append(c)
    model.select(skill=None)
    d["candidates"] = cands
    d["prompt_tokens"] = len(ids)
    return d


def render(d: dict[str, Any]) -> str:
    from .route import render as render_route

    out = [render_route(d)]
    for c in d["candidates"]:
        name = c["skill"] or "backbone"
        e = "" if c["E"] is None else f", E {c['E']:.6f}"
        mark = "  <- winner" if c["skill"] == d["winner"] and c["skill"] else ""
        out.append(f"\n{sanitize(name)}{e}: confidence {c['confidence']:.3f}, entropy {c['entropy']:.3f}{mark}")
        for t in c["top"]:
            out.append(f"  {t['p']:7.4f}  {sanitize(repr(t['token']))}")
    return "\n".join(out)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". The distribution is of the "
                              "token after the prompt as run would feed it (chat template unless --raw).")
    add_prompt_args(p)
    p.add_argument("--top", type=int, default=8, help="tokens listed per candidate (default 8)")
    p.add_argument("--raw", action="store_true", help="no chat template for the distribution")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with open_model(args) as model:
        d = explain(model, read_prompt(args), top=max(1, args.top), raw=args.raw)
    if args.json:
        for c in d["candidates"]:  # JSON has no infinity
            c["E"] = None if c["E"] is None or not math.isfinite(c["E"]) else c["E"]
        print_json(d)
    else:
        print(render(d))
    return 0
