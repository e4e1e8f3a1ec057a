"""``cmf chat``: interactive multi-turn chat (/reset, /system TEXT, /exit; Ctrl-C stops a reply)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._runtime_args import add_model_options, load_model, sampling_kwargs

NAME = "chat"
SUMMARY = "interactive multi-turn chat with the model"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Commands: /reset, /system TEXT, /exit.")
    add_model_options(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    kwargs = sampling_kwargs(args)
    system = args.system
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            return 0
        if not line:
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history.clear()
            sys.stderr.write("[history cleared]\n")
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            history.clear()
            sys.stderr.write(f"[system prompt {'set' if system else 'cleared'}; history cleared]\n")
            continue
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        try:
            for r in model.stream(history, system=system, **kwargs):
                if r.text:
                    reply.append(r.text)
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stderr.write("\n[interrupted]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
