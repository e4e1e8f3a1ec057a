"""``cmf ppl``: teacher-forced perplexity over non-overlapping windows (llama-perplexity style output)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np

from . import UsageError
from ._runtime_args import add_model_options, load_model

NAME = "ppl"
SUMMARY = "teacher-forced perplexity of a text file"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". The text is split on blank "
                              "lines, each paragraph + '\\n\\n' encoded without special tokens and "
                              "concatenated; windows of CTX tokens score positions 1..CTX-1.")
    add_model_options(p, sampling=False)
    p.add_argument("-f", "--file", required=True, help="text file")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many windows")
    p.add_argument("--window", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def encode_text(tok, text: str) -> list[int]:
    """The project's perplexity protocol: paragraphs + '\\n\\n', no special tokens, concatenated."""
    ids: list[int] = []
    for para in text.split("\n\n"):
        if para.strip():
            ids += tok.encode(para + "\n\n", add_special_tokens=False)
    return ids


def window_nll(model, window: list[int]) -> np.ndarray:
    """Negative log-likelihoods of tokens 1..n-1 of ``window`` given their prefix."""
    logits = model.logits(window)[:-1].astype(np.float64)
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    return lse - logits[np.arange(len(window) - 1), window[1:]]


def perplexity(model, ids: list[int], window: int, chunks: int | None = None, on_chunk=None) -> dict:
    """PPL and its standard error over non-overlapping windows.

    Under ``--skill auto`` / ``--blend auto`` each window is routed on its first 128 tokens (its
    "prompt") before it is scored; ``routes`` then counts the selections.
    """
    n_win = len(ids) // window
    if chunks is not None:
        n_win = min(n_win, chunks)
    if n_win == 0:
        raise UsageError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    nll: list[float] = []
    routes: dict[str, int] = {}
    auto = getattr(model, "auto", None)
    for i in range(n_win):
        win = ids[i * window:(i + 1) * window]
        if auto:
            from ..runtime.routing import BLEND_ROUTE_TOKENS

            r = model.route_select(win[:BLEND_ROUTE_TOKENS])
            key = (",".join(f"{k}:{w:.2f}" for k, w in r.blend.items()) if r.blend else "none") \
                if auto == "blend" else (r.winner or "none")
            routes[key] = routes.get(key, 0) + 1
        nll.extend(window_nll(model, win).tolist())
        if on_chunk:
            on_chunk(i, math.exp(float(np.mean(nll))))
    arr = np.asarray(nll)
    mean = float(arr.mean())
    ppl = math.exp(mean)
    err = ppl * float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else 0.0
    out = {"ppl": ppl, "stderr": err, "tokens": int(arr.size), "windows": n_win, "window": window}
    if auto:
        out["routes"] = routes
    return out


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    with open(args.file, encoding="utf-8") as fh:
        text = fh.read()
    ids = encode_text(model.tokenizer, text)
    window = min(args.window, model.ctx_size)

    def show(i: int, running: float) -> None:
        if not args.json:
            sys.stdout.write(f"[{i + 1}]{running:.4f},")
            sys.stdout.flush()

    res = perplexity(model, ids, window, args.chunks, show)
    if args.json:
        import json

        print(json.dumps(res))
    else:
        print(f"\nFinal estimate: PPL = {res['ppl']:.4f} +/- {res['stderr']:.5f}")
        if "routes" in res:
            from . import sanitize

            print("routed windows: " + ", ".join(f"{sanitize(k)} {n}" for k, n in sorted(res["routes"].items())))
    return 0
