"""pycmf and llama.cpp with and without AVX-512, in one run (issue 27's peer figure).

    bash benchmarks/build_llama_tools.sh                  # native llama.cpp tools (+ llama-bench)
    LLAMA_CPU=avx2 bash benchmarks/build_llama_tools.sh   # llama-bench restricted to AVX2
    python benchmarks/avx2_peer.py --gguf-f32 smol-f32.gguf --cmf smol-q8.cmf --cmf smol-q4tp.cmf \\
        --native-bin <build/bin> --avx2-bin <build-avx2/bin> [--rounds 3] [--threads 2] [--write]

llama.cpp's files are quantized from the F32 GGUF (``cmf export --gguf`` of the same model) with
its own ``llama-quantize`` (Q8_0, Q4_0) and measured with ``llama-bench`` (``-p 512 -n 64``:
prefill of 512 tokens, 64 decoded tokens from an empty context); pycmf's files with the runtime
matrix's worker (benchmarks/runtime.py: 512-token prefill, 64 tokens decoded after a 32-token
prompt), natively and compiled for haswell (AVX2, FMA, no AVX-512; ``_common.cpu_env``). Every
cell runs in a fresh process, rounds interleaved with the order flipped each round, each pycmf
cell right beside its llama.cpp peer's on the same target (``adjacent``); medians. A
second table sets each pycmf file beside the llama.cpp type of its matrices (q8 files beside Q8_0,
the 4-bit family beside Q4_0) on each target: the ratio of the cell medians and the median of the
per-round ratios (both cells of a ratio ran in the same round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cmf.format.reader import open as open_cmf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_env  # noqa: E402
from runtime import WORKER  # noqa: E402  - the same measurement as the runtime matrix

ROOT = Path(__file__).resolve().parent.parent
LLAMA_TYPES = ("Q8_0", "Q4_0")


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """{"decode": t/s, "prefill": t/s} of one llama-bench run (its own average over 2 repetitions)."""
    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "512", "-n", "64", "-t", str(threads),
                        "-r", "2", "-o", "json"], capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"llama-bench {gguf.name}: {r.stderr[-2000:]}")
    out = {}
    for rec in json.loads(r.stdout):
        out["prefill" if rec["n_prompt"] else "decode"] = float(rec["avg_ts"])
    return out


def pycmf_cell(model: Path, threads: int, cpu: str, cache: Path, int8: bool = False) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), NUMBA_CACHE_DIR=str(cache))
    env.pop("CMF_INT8_ACT", None)
    if int8:  # activations quantized to int8 per product, as llama.cpp's quantized types do
        env["CMF_INT8_ACT"] = "1"
    if cpu:
        env.update(cpu_env(cpu))
    r = subprocess.run([sys.executable, "-c", WORKER, "matrix", str(model), str(threads)], env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"pycmf {model.name} cpu={cpu or 'native'}: {r.stderr[-2000:]}")
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    return {"decode": float(rec["decode_tps"]), "prefill": float(rec["prefill_tps"])}


def peer_type(model: Path) -> str:
    """The llama.cpp type a pycmf file is set beside: Q8_0 where q8_row holds most of its matrix
    bytes, else Q4_0 (the 4-bit family and lower)."""
    by: dict[str, int] = {}
    with open_cmf(model) as f:
        for name in f.keys():
            t = f.tensor(name)
            if len(t.shape) == 2:
                by[t.dtype.name] = by.get(t.dtype.name, 0) + int(t.nbytes)
    return "Q8_0" if max(by, key=by.get) == "Q8_ROW" else "Q4_0"


def peer_lines(results: dict, peers: dict[str, str]) -> list[str]:
    """Rows of pycmf ÷ llama.cpp decode per target: cell medians, the median per-round ratio, and
    AVX2's per-round ratios."""
    lines = ["", "| pycmf file ÷ llama.cpp, decode | native (cells) | native (per round) | AVX2 (cells) | "
             "AVX2 (per round) | AVX2 rounds |", "|---|---:|---:|---:|---:|---|"]
    for name, kind in peers.items():
        cols: list[str] = []
        ratios: dict[str, list[float]] = {}
        for cpu in ("native", "haswell"):
            mine = [r["decode"] for r in results[(name, cpu)]]
            theirs = [r["decode"] for r in results[(f"llama.cpp {kind}", cpu)]]
            ratios[cpu] = [m / t for m, t in zip(mine, theirs)]  # the same round's two cells
            cols += [f"{statistics.median(mine) / statistics.median(theirs):.2f}×",
                     f"{statistics.median(ratios[cpu]):.2f}×"]
        rounds = " / ".join(f"{r:.2f}" for r in ratios["haswell"])
        lines.append(f"| {name} ÷ {kind} | {' | '.join(cols)} | {rounds} |")
    return lines


def adjacent(cells: list, peers: dict[str, str]) -> list:
    """The cells in the order a round runs them: on each target, each llama.cpp type followed by
    the pycmf files set beside it, so that a ratio's two cells run back to back. This host's
    speed moves by 15-25% over minutes (other tenants), and with all of llama.cpp's cells first a
    ratio's two cells ran up to a round (~2 minutes) apart."""
    out = []
    for cpu in dict.fromkeys(c for _, c, _ in cells):
        for kind in LLAMA_TYPES:
            out += [c for c in cells if c[1] == cpu and c[0] == f"llama.cpp {kind}"]
            out += [c for c in cells if c[1] == cpu and peers.get(c[0]) == kind]
    return out + [c for c in cells if c not in out]


def quantized(native_bin: Path, f32: Path, kind: str, work: Path) -> Path:
    out = work / f"{f32.stem}-{kind}.gguf"
    if not out.exists():
        subprocess.run([str(native_bin / "llama-quantize"), str(f32), str(out), kind], check=True,
                       capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf-f32", type=Path, required=True)
    ap.add_argument("--cmf", type=Path, action="append", required=True, help="a pycmf file (repeatable)")
    ap.add_argument("--native-bin", type=Path, required=True, help="llama.cpp build with llama-bench, llama-quantize")
    ap.add_argument("--avx2-bin", type=Path, required=True, help="llama.cpp AVX2-only build with llama-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="where the quantized GGUFs go (default: beside the F32)")
    ap.add_argument("--int8", action="store_true", help="also pycmf with int8 activations (CMF_INT8_ACT=1)")
    ap.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    a = ap.parse_args()
    work = a.work or a.gguf_f32.parent
    ggufs = [quantized(a.native_bin, a.gguf_f32, k, work) for k in LLAMA_TYPES]
    caches = {cpu: Path(tempfile.mkdtemp(prefix=f"cmf-peer-{cpu or 'native'}-")) for cpu in ("", "haswell")}
    cells: list[tuple[str, str, object]] = []
    peers: dict[str, str] = {}
    for g in ggufs:
        for cpu, b in (("native", a.native_bin), ("haswell", a.avx2_bin)):
            cells.append((f"llama.cpp {g.stem.rsplit('-', 1)[-1]}", cpu, lambda g=g, b=b: llama_bench(b, g, a.threads)))
    for f in a.cmf:
        for int8 in ((False, True) if a.int8 else (False,)):
            peers[f"pycmf {f.stem}{' +i8' if int8 else ''}"] = peer_type(f)
            for cpu in ("", "haswell"):
                cells.append((f"pycmf {f.stem}{' +i8' if int8 else ''}", cpu or "native",
                              lambda f=f, cpu=cpu, int8=int8: pycmf_cell(f, a.threads, cpu, caches[cpu], int8)))
    cells = adjacent(cells, peers)
    for name, _, run in cells:  # compile into each numba cache once, untimed
        if name.startswith("pycmf"):
            run()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(a.rounds):
        order = cells if rnd % 2 == 0 else cells[::-1]
        for name, cpu, run in order:
            rec = run()
            results.setdefault((name, cpu), []).append(rec)
            print(f"round {rnd + 1} {name} {cpu}: decode {rec['decode']:.1f} prefill {rec['prefill']:.1f}", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode", "prefill")} for k, v in results.items()}
    lines = [f"\n### AVX2 peer ({time.strftime('%Y-%m-%d %H:%M')}, {a.threads} threads, {a.rounds} rounds, medians)\n",
             "| engine / file | decode native | decode AVX2 | AVX2 ÷ native | prefill-512 native | prefill AVX2 | "
             "AVX2 ÷ native |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(n for n, _, _ in cells):
        n, h = med[(name, "native")], med[(name, "haswell")]
        lines.append(f"| {name} | {n['decode']:.1f} | {h['decode']:.1f} | {h['decode'] / n['decode']:.2f}× | "
                     f"{n['prefill']:.1f} | {h['prefill']:.1f} | {h['prefill'] / n['prefill']:.2f}× |")
    lines += peer_lines(results, peers)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
