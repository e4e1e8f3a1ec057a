"""Quality per dtype: held-out perplexity of ../shared/models/base converted at every dtype.

    python benchmarks/quality.py [--models ../shared/models] [--quants f32,q8,...] [--max-windows N]
    python benchmarks/quality.py --real [quality_real.py's options]

``--real`` is the real-model mode: pycmf's perplexity-versus-size front beside llama.cpp's types
quantized from the same F32 GGUF, calibration on one text and evaluation on another (SmolLM2-135M,
or ``--source FILE`` such as the shared model at f32); it runs ``quality_real.py`` with the
options that follow.

Protocol (../shared/models/README.md): split the text on blank lines, encode each paragraph +
"\\n\\n" without special tokens, concatenate, cut non-overlapping 257-token windows, score
positions 1..256 of each window. The f32 file is also compared with transformers' own perplexity
on the same windows (they must agree to 4 significant digits).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.tools.perplexity import encode_text, perplexity  # noqa: E402

QUANTS = ["f32", "f16", "q8", "q8_2f", "q4", "q4t", "q4tp", "vbit", "q2tp", "q1t", "q1s", "q1"]
WINDOW = 257


def hf_perplexity(folder: Path, ids: list[int], windows: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for i in range(windows):
            w = torch.tensor(ids[i * WINDOW:(i + 1) * WINDOW])[None]
            logits = model(w).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1)
            nll.append(-lp[torch.arange(WINDOW - 1), w[0, 1:]].numpy())
    return math.exp(float(np.concatenate(nll).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--max-windows", type=int, default=None, help="cap windows per text (quick runs)")
    args = ap.parse_args()
    root = Path(args.models)
    base = root / "base"
    if not base.is_dir():
        sys.exit(f"{base} not found: this benchmark needs ../shared/models")
    texts = sorted((root / "texts").glob("*-heldout.txt"))
    quants = [q for q in args.quants.split(",") if q]
    t0 = time.time()
    rows, ppl_f32, sizes = {}, {}, {}
    with tempfile.TemporaryDirectory() as d:
        for q in quants:
            out = Path(d) / f"base-{q}.cmf"
            convert(base, out, quant=q)
            sizes[q] = out.stat().st_size
            with cmf.load(out) as m:
                res = {}
                for text in texts:
                    ids = encode_text(m.tokenizer, text.read_text(encoding="utf-8"))
                    n = len(ids) // WINDOW if args.max_windows is None else min(len(ids) // WINDOW, args.max_windows)
                    res[text.name.split("-")[0]] = (perplexity(m, ids, WINDOW, n)["ppl"], ids, n)
            rows[q] = res
            print(f"{q}: " + ", ".join(f"{k} {v[0]:.3f}" for k, v in res.items()), file=sys.stderr, flush=True)
        domains = list(rows[quants[0]])
        if "f32" in rows:
            ppl_f32 = {k: v[0] for k, v in rows["f32"].items()}
            hf = {k: hf_perplexity(base, v[1], v[2]) for k, v in rows["f32"].items()}
        out_rows = []
        for q in quants:
            r = [q, f"{sizes[q] / 2**20:.2f}"]
            for k in domains:
                p = rows[q][k][0]
                r.append(f"{p:.3f}" + (f" ({p / ppl_f32[k]:.3f}×)" if ppl_f32 and q != "f32" else ""))
            out_rows.append(r)
        if ppl_f32:
            out_rows.append(["transformers f32", "—"] + [f"{hf[k]:.3f}" for k in domains])
    print(f"# quality — {datetime.date.today()} — {machine()}\n")
    print(f"Held-out perplexity of ../shared/models/base per dtype ({WINDOW}-token windows, "
          f"{'all' if args.max_windows is None else f'at most {args.max_windows}'} windows per text); "
          f"ratio to the f32 file in parentheses.\n")
    print(table(["dtype", "file MiB"] + [f"{k} ppl" for k in domains], out_rows))
    if ppl_f32:
        agree = all(f"{ppl_f32[k]:.4g}" == f"{hf[k]:.4g}" for k in domains)
        print(f"\nf32 vs transformers agree to 4 significant digits: {'yes' if agree else 'NO'}")
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    if "--real" in sys.argv[1:]:
        import quality_real

        sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a != "--real"]
        quality_real.main()
    else:
        main()
