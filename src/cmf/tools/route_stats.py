"""``cmf route-stats``: per-layer expert selection counts of an MoE model over a text.

The JSON is ``{layer: [count per expert]}`` — what ``cmf convert --route-stats`` (vbit B-field),
``moe-defrag --stats`` and ``CMF_MOE_MASK`` read (spec §11.1). The text is encoded with the
perplexity protocol (paragraphs + "\\n\\n", no special tokens) and run teacher-forced in windows
with a fresh cache each, so every token is routed exactly once per MoE layer: the counts of a
layer sum to tokens × top_k.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import UsageError
from ._runtime_args import add_model_options, load_model

NAME = "route-stats"
SUMMARY = "count expert selections per MoE layer over a text (JSON for --route-stats, moe-defrag, CMF_MOE_MASK)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    add_model_options(p, sampling=False)
    p.add_argument("-f", "--file", required=True, help="text file ('-' = stdin)")
    p.add_argument("-o", "--output", default=None, help="write the JSON here (default: stdout)")
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window (default 512)")
    p.add_argument("--max-tokens", type=int, default=None, help="route at most this many tokens")
    p.set_defaults(run=run)
    return p


def route_stats(model, ids: list[int], window: int = 512) -> dict[str, list[int]]:
    """Selection counts {layer: [count per expert]} of the MoE layers over ``ids``.

    Windows of ``window`` tokens, each from a fresh cache. Raises ValueError for a model without
    MoE layers or an empty text.
    """
    if not model.moe_layers:
        raise UsageError("the model has no MoE layers: nothing to count")
    if not ids:
        raise UsageError("the text encodes to no tokens")
    window = max(1, min(int(window), model.ctx_size))
    model.reset_route_stats()
    model.collect_route_stats(True)
    try:
        for s in range(0, len(ids), window):
            model.prefill(ids[s:s + window], model.new_cache())
        return model.route_stats()
    finally:
        model.collect_route_stats(False)


def run(args: argparse.Namespace) -> int:
    from .perplexity import encode_text

    model = load_model(args)
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    ids = encode_text(model.tokenizer, text)
    if args.max_tokens is not None:
        ids = ids[:max(0, args.max_tokens)]
    stats = route_stats(model, ids, args.window)
    blob = json.dumps(stats)
    if args.output:
        Path(args.output).write_text(blob + "\n", encoding="utf-8")
        print(f"{len(ids)} tokens routed through {len(stats)} MoE layers -> {args.output}")
    else:
        print(blob)
    return 0
