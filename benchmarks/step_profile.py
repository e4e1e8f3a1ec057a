"""Where one decode step goes, product by product (issue 27): the fused layer step's calls timed
one by one, natively and compiled for other CPUs, in fresh processes interleaved.

    python benchmarks/step_profile.py --model FILE [--model FILE ...] [--cpu haswell] [--threads 2]
                                      [--steps 64] [--rounds 3] [--repeat 2] [--write]

Each worker loads the model, wraps the step's calls in timers (the q/k/v, o, gate/up and down
products as ``BlockStep._bind`` hands them out, attention, the norms and residual adds of
``runtime/step.py``, the logits projection) without changing what they compute, prefills a
32-token prompt and decodes ``--steps`` tokens ``--rounds`` times; it reports µs a token per part
from its fastest round. The wrappers add a Python call per product (~1 µs), the same for every
target. ``--cpu`` adds every file again compiled by numba for that LLVM CPU (its own features and
cache, OpenBLAS for it; ``_common.cpu_env``), so an AVX2 machine's split is read on this one.
``--repeat`` runs the whole matrix that many times (cells interleaved) and reports each part's
range. ``--write`` appends a dated entry to ``## Without AVX-512 (issue 27)`` of RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_entry, cpu_env, machine, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Without AVX-512 (issue 27)"
PARTS = ("qkv", "o", "gate_up", "down", "attention", "norms", "head")

WORKER = r"""
import collections, json, sys, time
import numpy as np
from cmf import kernels
from cmf.runtime import step as S
from cmf.runtime.model import load

path, threads, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
T = collections.defaultdict(float)
clock = time.perf_counter

def timed(name, fn):
    def run(*a, **k):
        t0 = clock()
        out = fn(*a, **k)
        T[name] += clock() - t0
        return out
    return run

for fn in ("rms_norm_into", "add_norm_into", "add_into"):
    setattr(S, fn, timed("norms", getattr(S, fn)))
S.TokenAttention.__call__ = timed("attention", S.TokenAttention.__call__)
bind = S.BlockStep._bind

def _bind(self, nt, ffn):
    calls = bind(self, nt, ffn)
    if calls is None:
        return None
    *four, scatter, _layer = calls
    # without the one-call layer (layer_step.py), and so without the layer stack (layer_stack.py):
    # its products could not be timed one by one; the total is the eight-call step's
    return (*[(timed(n, f), a) for n, (f, a) in zip(("qkv", "o", "gate_up", "down"), four)], scatter, None)

S.BlockStep._bind = _bind
m = load(path, threads=threads)
kernels.set_threads(threads)
m.project = timed("head", m.project)
ids = np.random.default_rng(0).integers(0, m.plan.vocab, 32)
best = None
for r in range(rounds + 1):  # the first round warms up (tiles packed, caches filled)
    c = m.new_cache()
    tok = int(np.argmax(m.prefill(ids, c)))
    T.clear()
    t0 = clock()
    for _ in range(steps):
        tok = int(np.argmax(m.forward([tok], c)[-1]))
    row = {k: v / steps * 1e6 for k, v in T.items()}
    row["total"] = (clock() - t0) / steps * 1e6
    if r and (best is None or row["total"] < best["total"]):
        best = row
print(json.dumps(best))
"""


def measure(model: Path, cpu: str | None, threads: int, steps: int, rounds: int, cache: Path) -> dict:
    """µs a token per part (and ``total``) from one fresh worker."""
    env = dict(os.environ)
    if cpu:
        env.update(cpu_env(cpu))
        env["NUMBA_CACHE_DIR"] = str(cache / cpu)
    proc = subprocess.run([sys.executable, "-c", WORKER, str(model), str(threads), str(steps), str(rounds)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"step profile of {model} ({cpu or 'native'}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"


def profile_table(cells: dict) -> str:
    """Markdown: one row per (file, cpu), µs a token per part as ranges over the repeats, and the
    total against the same file's native total."""
    rows = []
    for (name, cpu), runs in cells.items():
        parts = [span([r.get(p, 0.0) for r in runs]) for p in PARTS]
        other = span([r["total"] - sum(r.get(p, 0.0) for p in PARTS) for r in runs])
        native = cells.get((name, "native"))
        ratio = ""
        if cpu != "native" and native:
            rs = [n["total"] / r["total"] for n, r in zip(native, runs)]
            ratio = f"{min(rs):.2f}–{max(rs):.2f}×" if len(rs) > 1 else f"{rs[0]:.2f}×"
        rows.append([name, cpu, *parts, other, span([r["total"] for r in runs]), ratio])
    return table(["file", "cpu", *PARTS, "other", "total", "÷ native"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, type=Path, help="a .cmf file (repeatable)")
    ap.add_argument("--cpu", default="", help="comma-separated LLVM CPU names measured besides native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per worker (the fastest is kept)")
    ap.add_argument("--repeat", type=int, default=2, help="workers per cell, the matrix interleaved")
    ap.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args(argv)
    for m in args.model:
        if not m.is_file():
            ap.error(f"--model {m}: no such file")
    if min(args.threads, args.steps, args.rounds, args.repeat) < 1:
        ap.error("--threads, --steps, --rounds and --repeat must be at least 1")
    cpus = ["native"] + [c.strip() for c in args.cpu.split(",") if c.strip()]
    cells: dict = {(m.name, c): [] for m in args.model for c in cpus}
    with tempfile.TemporaryDirectory(prefix="cmf-step-") as tmp:
        for rep in range(args.repeat):
            for m in args.model:
                for c in cpus:
                    r = measure(m, None if c == "native" else c, args.threads, args.steps, args.rounds, Path(tmp))
                    cells[(m.name, c)].append(r)
                    print(f"repeat {rep + 1} {m.name} {c}: {r['total']:.0f} µs a token", file=sys.stderr)
    out = profile_table(cells)
    print(out)
    if args.write:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        body = (f"`benchmarks/step_profile.py` ({args.threads} threads, {args.steps} decode steps after a "
                f"32-token prompt, the fastest of {args.rounds} rounds per worker, {args.repeat} workers per "
                f"cell interleaved); µs a token per part, ranges over the workers.\n\n{out}\n")
        append_entry(RESULTS, SECTION, f"### {when} — {machine()} — where a decode step goes\n\n{body}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
