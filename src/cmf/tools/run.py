"""``cmf run``: generate from a prompt, streaming the text to stdout and stats to stderr.

The kernels are warmed before the timed run (``_warmup``): on a first run after an install the
stats line says how long compiling took, and its tokens/s are measured without it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import sanitize
from ._runtime_args import add_model_options, load_model, sampling_kwargs
from ._warmup import compile_clause, drain, warm_up

NAME = "run"
SUMMARY = "generate text from a prompt (streams to stdout; stats on stderr)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    add_model_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' = stdin)")
    p.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as given")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(run=run)
    return p


def _prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file == "-":
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as fh:
        return fh.read()


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    prompt = _prompt(args)
    kwargs = sampling_kwargs(args)
    compile_s = warm_up(model, lambda: drain(model.stream(prompt, raw=args.raw, system=args.system,
                                                          **dict(kwargs, max_tokens=2))))
    text, last = [], None
    for r in model.stream(prompt, raw=args.raw, system=args.system, **kwargs):
        last = r
        if r.text:
            text.append(r.text)
            if not args.json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    assert last is not None
    compiled = compile_s + last.compile_seconds  # warm-up, then whatever the timed run still compiled
    stats = {"prompt_tokens": last.prompt_tokens, "generated_tokens": last.generation_tokens,
             "prompt_tps": round(last.prompt_tps, 2), "decode_tps": round(last.generation_tps, 2),
             "finish_reason": last.finish_reason, "peak_memory_mb": round(last.peak_memory_mb, 1),
             "compile_seconds": round(compiled, 2)}
    if last.spec_rounds:
        stats.update(spec_acceptance=round(last.acceptance_rate, 4), spec_drafted=last.spec_drafted,
                     spec_accepted=last.spec_accepted,
                     spec_tokens_per_round=round((last.spec_accepted + last.spec_rounds) / last.spec_rounds, 3))
    if args.json:
        print(json.dumps({"text": "".join(text), **stats}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stderr.write(sanitize(
            f"[{stats['prompt_tokens']} prompt tokens at {stats['prompt_tps']:.1f} t/s, "
            f"{stats['generated_tokens']} generated at {stats['decode_tps']:.1f} t/s, "
            f"finish: {stats['finish_reason']}, peak {stats['peak_memory_mb']:.0f} MB"
            + (f", MTP drafts accepted {100 * stats['spec_acceptance']:.0f}% "
               f"({stats['spec_tokens_per_round']:.2f} tokens/round)" if last.spec_rounds else "")
            + (f", {compile_clause(compiled)}" if compiled else "")
            + "]") + "\n")
    return 0
