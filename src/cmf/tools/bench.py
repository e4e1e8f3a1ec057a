"""``cmf bench``: prompt processing and generation speed, llama-bench style (t/s mean ± sd)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from . import sanitize
from ._runtime_args import add_model_options, load_model

NAME = "bench"
SUMMARY = "measure prefill (ppN) and decode (tgN) speed"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    add_model_options(p, sampling=False)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for ppN (0 = skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for tgN (0 = skip)")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-o", "--output", choices=("md", "json"), default="md")
    p.add_argument("--compare", default=None, metavar="ENGINES",
                   help="also run hf and/or llama.cpp on the same weights (comma list: hf,llama.cpp; "
                        "pycmf-int8 adds pycmf with int8 activations on 4-bit files), each engine in a fresh "
                        "process, interleaved; prints one table with ratios")
    p.set_defaults(run=run)
    return p


def bench(model, n_prompt: int, n_gen: int, reps: int) -> list[dict]:
    """Run the measurements; one dict per test with all samples (tokens/s)."""
    rng = np.random.default_rng(0)
    vocab = model.plan.vocab
    out = []
    if n_prompt:
        ids = rng.integers(0, vocab, n_prompt)
        model.prefill(ids[:8], model.new_cache())  # warm up kernels
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.prefill(ids, model.new_cache())
            samples.append(n_prompt / (time.perf_counter() - t0))
        out.append({"test": f"pp{n_prompt}", "samples": samples})
    if n_gen:
        samples = []
        for r in range(reps + 1):
            cache = model.new_cache()
            tok = int(rng.integers(0, vocab))
            t0 = time.perf_counter()
            for _ in range(n_gen):
                logits = model.forward([tok], cache)
                tok = int(np.argmax(logits[-1]))
            if r:  # the first run warms up
                samples.append(n_gen / (time.perf_counter() - t0))
        out.append({"test": f"tg{n_gen}", "samples": samples})
    for d in out:
        s = d["samples"]
        d["mean"], d["sd"] = statistics.fmean(s), (statistics.stdev(s) if len(s) > 1 else 0.0)
    return out


def run(args: argparse.Namespace) -> int:
    if args.compare:
        from .bench_compare import compare, render
        from ._runtime_args import resolve_model

        res = compare(resolve_model(args.model), [e.strip() for e in args.compare.split(",") if e.strip()],
                      n_prompt=args.n_prompt, n_gen=args.n_gen, reps=max(1, args.repetitions),
                      threads=args.threads)
        print(json.dumps(res) if args.output == "json" else render(res))
        return 0
    model = load_model(args)
    res = bench(model, args.n_prompt, args.n_gen, max(1, args.repetitions))
    size = model.file.size
    if args.output == "json":
        print(json.dumps({"model": str(args.model), "size_bytes": size, "results": res}))
    else:
        rows = [[str(args.model), f"{size / 2**20:.1f} MiB", args.threads or "default", d["test"],
                 f"{d['mean']:.2f} ± {d['sd']:.2f}"] for d in res]
        lines = ["| model | size | threads | test | t/s |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(sanitize(c) for c in r) + " |" for r in rows]
        print("\n".join(lines))
    return 0
