"""Before/after A/B of the runtime: the same CMF files decoded and prefilled by two git revisions
of pycmf (and, with ``--cpu``, compiled for other CPUs too), in fresh processes interleaved round
by round with the order flipped every round, so background load hits every cell alike.

    python benchmarks/ab.py --old e7e2d71^ --model smol-q8.cmf --model smol-q4tp.cmf \\
                            [--new HEAD] [--cpu haswell] [--rounds 5] [--threads 2]

``--old``/``--new`` are checked out with ``git worktree`` into a temporary folder (``--new``
defaults to the working tree itself); each version × CPU keeps its own numba cache, warmed by one
untimed process before the rounds. A cell = decode (64 tokens after a 32-token prompt, or
``--context N`` tokens; best of two) and prefill (512 tokens, best of two), as
benchmarks/runtime.py measures them; reported as the median over rounds and new ÷ old per round
(median and range). ``--int8`` adds every cell again with int8 activations (``CMF_INT8_ACT=1``).
Prints a Markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_env  # noqa: E402
from runtime import WORKER  # noqa: E402  - the same measurement as the runtime matrix


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into``; returns its ``src`` folder."""
    dest = into / rev.replace("^", "_parent").replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(dest), rev],
                   check=True, capture_output=True)
    return dest / "src"


def run_cell(src: Path, model: str, threads: int, cpu: str, int8: bool, cache: Path, context: int = 32) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), NUMBA_CACHE_DIR=str(cache))
    env.pop("CMF_INT8_ACT", None)
    if int8:
        env["CMF_INT8_ACT"] = "1"
    if cpu:  # the CPU's own features and sgemm, not the host's (docs/PERFORMANCE.md "Without AVX-512")
        env.update(cpu_env(cpu))
    r = subprocess.run([sys.executable, "-c", WORKER, "matrix", model, str(threads), str(context)], env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{src} {model} cpu={cpu or 'native'}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision measured as 'old'")
    ap.add_argument("--new", default="", help="git revision measured as 'new' (default: the working tree)")
    ap.add_argument("--model", action="append", required=True, help="a .cmf file (repeatable)")
    ap.add_argument("--cpu", default="", help="comma-separated LLVM CPU names measured besides native")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also every cell with CMF_INT8_ACT=1")
    ap.add_argument("--context", type=int, default=32,
                    help="prompt tokens before the 64 timed decode steps (attention reads that many and more)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cmf-ab-"))
    versions = {"old": checkout(args.old, work),
                "new": checkout(args.new, work) if args.new else ROOT / "src"}
    cpus = [""] + [c.strip() for c in args.cpu.split(",") if c.strip()]
    cells = [(m, cpu, i8) for m in args.model for cpu in cpus for i8 in ([False, True] if args.int8 else [False])]
    got: dict[tuple, dict[str, list[dict]]] = {c: {"old": [], "new": []} for c in cells}

    def cache(v: str, cpu: str) -> Path:
        return work / f"numba-{v}-{cpu or 'native'}"

    for cell in cells:  # compile and pack once per version, untimed
        for v, src in versions.items():
            run_cell(src, cell[0], args.threads, cell[1], cell[2], cache(v, cell[1]), args.context)
    for rnd in range(args.rounds):
        order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
        for cell in cells:
            for v in order:
                r = run_cell(versions[v], cell[0], args.threads, cell[1], cell[2], cache(v, cell[1]), args.context)
                got[cell][v].append(r)
                print(f"round {rnd + 1} {v} {Path(cell[0]).name} {cell[1] or 'native'}{' +i8' if cell[2] else ''}: "
                      f"decode {r['decode_tps']:.1f} prefill {r['prefill_tps']:.1f}", file=sys.stderr, flush=True)
    print(f"old = {args.old}, new = {args.new or 'working tree'}; {args.threads} threads, {args.rounds} rounds, "
          f"decode after a {args.context}-token prompt\n")
    print("| file | cpu | decode old → new (median t/s) | new ÷ old, median (range) "
          "| prefill-512 old → new | new ÷ old, median (range) |")
    print("|---|---|---|---|---|---|")
    for cell in cells:
        row = [Path(cell[0]).name, (cell[1] or "native") + (" +i8" if cell[2] else "")]
        for key in ("decode_tps", "prefill_tps"):
            old = [r[key] for r in got[cell]["old"]]
            new = [r[key] for r in got[cell]["new"]]
            ratios = [n / o for n, o in zip(new, old)]
            row.append(f"{statistics.median(old):.1f} → {statistics.median(new):.1f}")
            row.append(f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
        print("| " + " | ".join(row) + " |")
    for src in versions.values():
        if src != ROOT / "src":
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src.parent)],
                           capture_output=True)


if __name__ == "__main__":
    main()
