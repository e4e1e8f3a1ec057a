"""``cmf route MODEL -p PROMPT``: recon-argmin routing errors per skill and the winner (spec §9)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import print_json, sanitize, table

NAME = "route"
SUMMARY = "routing error E per skill for a prompt, and the skill --skill auto would run"


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """MODEL, -p/-f, -t and --json: what route and explain share."""
    p.add_argument("model", metavar="MODEL", help="a .cmf file (or a HF folder / hub id)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' = stdin)")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads for the kernels")
    p.add_argument("--json", action="store_true", help="print JSON")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file == "-":
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as fh:
        return fh.read()


def open_model(args: argparse.Namespace):
    from ..runtime.model import load
    from ._runtime_args import announce_compiles, resolve_model

    announce_compiles()
    return load(resolve_model(args.model), threads=args.threads)


def route_prompt(model, prompt: str) -> dict[str, Any]:
    """Route ``prompt`` (tokenized without template): E per skill, winner, the auto blend, and the
    skills that carry no routing subspace."""
    from ..runtime.routing import BLEND_ROUTE_TOKENS, auto_blend

    r = model.route(prompt)
    d = r.to_dict()
    d["blend_auto"] = auto_blend(model.route(prompt, max_tokens=BLEND_ROUTE_TOKENS).scores)
    d["unroutable"] = [s for s in model.skills if s not in r.scores]
    return d


def render(d: dict[str, Any]) -> str:
    if not d["scores"]:
        return "no routable skill: the backbone runs"
    rows = [[s, "-" if e is None else f"{e:.6f}", "<- winner" if s == d["winner"] else ""]
            for s, e in d["scores"].items()]
    out = [table(rows, ["skill", "E", ""], right=(1,)), f"winner: {sanitize(d['winner'])} "
           f"({d['tokens']} prompt tokens)"]
    if d["blend_auto"]:
        out.append("blend auto: " + ", ".join(f"{sanitize(k)} {w:.3f}" for k, w in d["blend_auto"].items()))
    if d["unroutable"]:
        out.append("not routable (no selection): " + ", ".join(sanitize(s) for s in d["unroutable"]))
    return "\n".join(out)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". E = ||r||^2 - sum_k (b_k.r)^2 "
                              "over ||phi||^2, r = phi - mean, phi = the prompt's mean residual after phi_layer.")
    add_prompt_args(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with open_model(args) as model:
        d = route_prompt(model, read_prompt(args))
    print_json(d) if args.json else print(render(d))
    return 0


__all__ = ["add_prompt_args", "open_model", "read_prompt", "render", "route_prompt"]
