"""What int8 activations cost in quality: the 4-bit files of ../shared/models/base, exact vs
``int8_activations=True``, decoded token by token and prefilled in blocks.

    python benchmarks/int8_quality.py [--models ../shared/models] [--windows 6] [--write]

Two ways of getting each window's logits, both reported: every scored position as its own
one-token ``forward`` over the cache, as in generation (the decode loop), and the whole window
as one prefill block with all its logits (on CPUs with VNNI the block loop, which takes int8
activations too; without VNNI prefill is exact in both modes and that table shows ratio 1).
Same protocol as benchmarks/quality.py otherwise (paragraphs + "\\n\\n" without special
tokens, non-overlapping 257-token windows scoring positions 1..256). Reported per dtype, path and
held-out text: perplexity exact and int8, their ratio, how often the greedy (argmax) token
agrees, and the largest logit difference relative to the largest |logit|. ``--write`` replaces
``## int8 activations`` in RESULTS.md.
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

from cmf.convert import convert  # noqa: E402
from cmf.runtime.model import load  # noqa: E402
from cmf.tools.perplexity import encode_text  # noqa: E402

DTYPES = ["q4", "q4t", "q4tp", "q2tp"]
WINDOW = 257
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max()
    return z - m - math.log(float(np.exp(z - m).sum()))


def decode_logits(model, win: list[int]) -> np.ndarray:  # noqa: ANN001 - a cmf Model
    """Logits after each of win[:-1], one token per forward (the decode path)."""
    cache = model.new_cache()
    return np.stack([model.forward([t], cache)[-1] for t in win[:-1]])


def prefill_logits(model, win: list[int]) -> np.ndarray:  # noqa: ANN001 - a cmf Model
    """Logits after each of win[:-1] from one prefill of the window (the block path)."""
    return model.prefill(win[:-1], model.new_cache(), all_logits=True)


PATHS = {"decode": decode_logits, "prefill": prefill_logits}


def score(path: Path, texts: list[Path], windows: int, how: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    models = {False: load(path), True: load(path, int8_activations=True)}
    try:
        for text in texts:
            ids = encode_text(models[False].tokenizer, text.read_text(encoding="utf-8"))
            nll = {False: [], True: []}
            agree = total = 0
            worst = 0.0
            for w in range(min(windows, len(ids) // WINDOW)):
                win = ids[w * WINDOW:(w + 1) * WINDOW]
                logits = {k: PATHS[how](m, win) for k, m in models.items()}
                for pos in range(WINDOW - 1):
                    for k in (False, True):
                        nll[k].append(-log_softmax(logits[k][pos])[win[pos + 1]])
                    agree += int(np.argmax(logits[False][pos]) == np.argmax(logits[True][pos]))
                    total += 1
                    a, b = logits[False][pos], logits[True][pos]
                    worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
            out[text.name.split("-")[0]] = {"exact": math.exp(float(np.mean(nll[False]))),
                                            "int8": math.exp(float(np.mean(nll[True]))),
                                            "agree": agree / max(total, 1), "worst": worst, "tokens": total}
    finally:
        for m in models.values():
            m.close()
    return out


def render(res: dict[str, dict[str, dict]], windows: int, secs: float) -> str:
    rows = []
    for (q, how), per in res.items():
        for dom, r in per.items():
            rows.append([q, how, dom, r["tokens"], f"{r['exact']:.3f}", f"{r['int8']:.3f}",
                         f"{r['int8'] / r['exact']:.4f}×", f"{100 * r['agree']:.1f}%", f"{r['worst']:.2e}"])
    return (f"Run {datetime.date.today()} on {machine()} (`benchmarks/int8_quality.py --windows {windows}`, "
            f"{secs:.0f} s): ../shared/models/base at each 4-bit dtype, exact vs int8 activations (`--int8-act`); "
            "\"decode\": every position a one-token forward, \"prefill\": each window one prefill block.\n\n"
            + table(["dtype", "path", "text", "tokens", "ppl exact", "ppl int8", "ratio", "same argmax",
                     "max |Δlogit| / max |logit|"], rows))


def write_section(text: str) -> None:
    body = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = "## int8 activations\n\n" + text + "\n"
    start = body.find("## int8 activations\n")
    if start < 0:
        body = body.rstrip("\n") + "\n\n\n" + section
    else:
        nxt = body.find("\n## ", start + 1)
        body = body[:start] + section + (body[nxt + 1:] if nxt >= 0 else "")
    RESULTS.write_text(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--windows", type=int, default=6, help="257-token windows per held-out text")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    root = Path(args.models)
    if not (root / "base").is_dir():
        sys.exit(f"{root / 'base'} not found: this benchmark needs ../shared/models")
    texts = sorted((root / "texts").glob("*-heldout.txt"))
    t0 = time.time()
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for q in [q for q in args.dtypes.split(",") if q]:
            path = Path(d) / f"base-{q}.cmf"
            convert(root / "base", path, quant=q)
            for how in PATHS:
                res[(q, how)] = score(path, texts, args.windows, how)
                print(f"{q} {how}: {res[(q, how)]}", file=sys.stderr, flush=True)
    text = render(res, args.windows, time.time() - t0)
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
