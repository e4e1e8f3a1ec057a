"""``cmf bench``: prompt processing and generation speed, llama-bench style (t/s mean ± sd).

Compile time never enters the table: each test runs once untimed with the timed shapes first
(numba compiles or loads its kernels there), and a timed repetition during which a kernel still
compiled is run again. The seconds spent compiling are reported on a line of their own."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from ..kernels import compiling, sysinfo
from . import sanitize
from ._runtime_args import add_model_options, load_model
from ._warmup import compile_clause

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


MAX_RETRIES = 3  # timed repetitions re-run because a kernel compiled in them, per test


def _timed(run: Callable[[], int], reps: int) -> list[float]:
    """tokens/s of ``reps`` calls of ``run`` (which returns its token count), after one untimed
    warm-up call. A call during which a kernel compiled is run again (up to MAX_RETRIES times,
    then its compile seconds are taken out of its time)."""
    run()
    samples: list[float] = []
    retries = 0
    while len(samples) < reps:
        before = compiling.totals()
        t0 = time.perf_counter()
        n = run()
        dt = time.perf_counter() - t0
        spent = compiling.totals() - before
        if spent.kernels and retries < MAX_RETRIES:
            retries += 1
            continue
        samples.append(n / max(dt - spent.seconds, 1e-9))
    return samples


def bench(model, n_prompt: int, n_gen: int, reps: int) -> list[dict]:
    """Run the measurements; one dict per test with all samples (tokens/s)."""
    compiling.install()
    rng = np.random.default_rng(0)
    vocab = model.plan.vocab
    out = []
    if n_prompt:
        ids = rng.integers(0, vocab, n_prompt)

        def prefill() -> int:
            model.prefill(ids, model.new_cache())
            return n_prompt

        out.append({"test": f"pp{n_prompt}", "samples": _timed(prefill, reps)})
    if n_gen:
        def decode() -> int:
            cache = model.new_cache()
            tok = int(rng.integers(0, vocab))
            for _ in range(n_gen):
                logits = model.forward([tok], cache)
                tok = int(np.argmax(logits[-1]))
            return n_gen

        out.append({"test": f"tg{n_gen}", "samples": _timed(decode, reps)})
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
    compiling.install()
    before = compiling.totals()
    res = bench(model, args.n_prompt, args.n_gen, max(1, args.repetitions))
    compiled = (compiling.totals() - before).seconds  # all in the untimed warm-ups
    size = model.file.size
    if compiled:
        print(sanitize(f"cmf bench: {compile_clause(compiled)}; before the timed repetitions, not in the table"),
              file=sys.stderr, flush=True)
    if args.output == "json":
        print(json.dumps({"model": str(args.model), "size_bytes": size, "results": res,
                          "compile_seconds": round(compiled, 2), "kernels": sysinfo.info()}))
    else:
        rows = [[str(args.model), f"{size / 2**20:.1f} MiB", args.threads or "default", d["test"],
                 f"{d['mean']:.2f} ± {d['sd']:.2f}"] for d in res]
        lines = ["| model | size | threads | test | t/s |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(sanitize(c) for c in r) + " |" for r in rows]
        lines += ["", sanitize(f"kernels: {sysinfo.summary()}")]  # as llama-bench ends with its build line
        print("\n".join(lines))
    return 0
