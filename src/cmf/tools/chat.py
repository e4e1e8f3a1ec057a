"""``cmf chat``: interactive multi-turn chat (/reset, /system TEXT, /exit; Ctrl-C stops a reply).

The kernels are warmed before the first prompt (``_warmup``); when that or a later reply compiled
kernels, one ``[compiled kernels in N s ...]`` line on stderr says so."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._runtime_args import add_model_options, load_model, sampling_kwargs
from ._warmup import compile_clause, drain, warm_up

WARM_UP_CHAT = [{"role": "user", "content": "Hello!"}]  # a short turn: the template's own shapes

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
    _say_compiled(warm_up(model, lambda: drain(model.stream(WARM_UP_CHAT, system=system,
                                                            **dict(kwargs, max_tokens=2)))))
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
        compiled = 0.0
        try:
            for r in model.stream(history, system=system, **kwargs):
                compiled = r.compile_seconds
                if r.text:
                    reply.append(r.text)
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stderr.write("\n[interrupted]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        _say_compiled(compiled)  # a prompt shape the warm-up did not take
        history.append({"role": "assistant", "content": "".join(reply)})


def _say_compiled(seconds: float) -> None:
    if seconds:
        sys.stderr.write(f"[{compile_clause(seconds)}]\n")
        sys.stderr.flush()
