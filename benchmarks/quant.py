"""Codec benchmark: decode/encode throughput, bits per weight and error for every dtype.

    python benchmarks/quant.py [--size 4096] [--repeat 7] [--write]

One seeded size×size f32 matrix (Gaussian rows with a log-normal spread of row amplitudes) is
encoded to every dtype. Decode speed is GB/s of f32 output (median of ``--repeat`` runs after a
warm-up, which also loads the numba cache); gguf-py's numpy ``dequantize`` of the analogous GGUF
type is timed on the same matrix in the same run (q8_row ↔ Q8_0, q4_block ↔ Q4_0, bf16 ↔ BF16).
``--write`` puts the tables into the ``## quant`` section of benchmarks/RESULTS.md.
Fused mat-vec kernels are benchmarked separately (cmf.kernels).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_time, table  # noqa: E402

import cmf.quant as q  # noqa: E402

DTYPES = ["f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro",
          "q1", "q1s", "q1t"]
GGUF_PAIRS = {"q8_row": "Q8_0", "q4_block": "Q4_0", "bf16": "BF16"}
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def source(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    amp = np.exp2(rng.normal(0, 0.5, size=(n, 1))).astype(np.float32) * np.float32(0.02)
    return rng.standard_normal((n, n), dtype=np.float32) * amp


def rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
    d = (a.astype(np.float64) - ref).ravel()
    return float(np.sqrt(d @ d / max(float(ref.astype(np.float64).ravel() @ ref.astype(np.float64).ravel()), 1e-300)))


def once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gguf_decode(w: np.ndarray, kind: str, repeat: int) -> float | None:
    try:
        import gguf
        from gguf import quants
    except ImportError:
        return None
    qt = getattr(gguf.GGMLQuantizationType, kind)
    blob = quants.quantize(w, qt)
    secs = median_time(lambda: quants.dequantize(blob, qt), repeat=max(3, repeat // 2), warmup=1)
    return w.nbytes / secs / 1e9


def run(size: int, repeat: int) -> str:
    w = source(size)
    gb_out = w.nbytes / 1e9
    rows = []
    decoded = {}
    for name in DTYPES:
        enc_s = min(once(lambda: q.encode(w, name)) for _ in range(1 if name in ("q2tp", "q1t", "q1s") else 2))
        blob = q.encode(w, name)
        dec = q.decode(blob, name, w.shape)
        decoded[name] = dec
        secs = median_time(lambda: q.decode(blob, name, w.shape), repeat=repeat, warmup=2)
        gbs = gb_out / secs
        ref = GGUF_PAIRS.get(name)
        g = gguf_decode(w, ref, repeat) if ref else None
        vs = f"{ref} {g:.2f} GB/s → ×{gbs / g:.1f}" if g else ""
        shown = "zero-copy view" if name == "f32" else f"{gbs:.2f}"
        rows.append([name, f"{len(blob) * 8 / w.size:.3f}", f"{rel_rms(dec, w) * 100:.2f}%",
                     f"{w.size / enc_s / 1e6:.1f}", shown, vs])
        print(f"{name}: done", file=sys.stderr, flush=True)
    q4t = decoded["q4_tiled"]
    requant = q.decode(q.encode(q4t, "q4tp"), "q4tp", w.shape)
    extra = (f"q4tp vs q4t: requant of the q4t-decoded matrix moves weights by {rel_rms(requant, q4t) * 100:.2f}% RMS "
             f"(FORMATS.md: 1.14% on published models); direct-encode error ratio q4tp/q4t = "
             f"{rel_rms(decoded['q4tp'], w) / rel_rms(q4t, w):.3f}.")
    head = ["dtype", "bits/weight", "rel RMS err", "encode Mweights/s", "decode GB/s (f32 out)", "gguf-py numpy dequant"]
    stamp = datetime.date.today().isoformat()
    return (f"Run {stamp} on {machine()}; numpy {np.__version__}; matrix {size}×{size} f32, "
            f"median of {repeat} decodes, each into a fresh output array (page faults included, as "
            f"for gguf-py). The machine is shared, so absolute numbers are noisy; ratios come from "
            f"the same run.\n\n{table(head, rows)}\n\n{extra}\n\n"
            "Every decode returns a new array; first-touch page faults on it cost about as much as "
            "the decode kernels themselves on a small VM, so these figures swing with the allocator. "
            "Fused mat-vec throughput belongs to the kernels benchmark.\n")


def write_section(text: str) -> None:
    """Replace (or append) the ``## quant`` section of RESULTS.md, leaving other sections alone."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## quant"), None)
    section = f"## quant\n\n{text}\n"
    if start is None:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + section + "".join(lines[end:])
    RESULTS.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--write", action="store_true", help="update the ## quant section of RESULTS.md")
    args = ap.parse_args()
    text = run(args.size, args.repeat)
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
