"""Codec and kernel benchmark: every dtype on one matrix, in one run.

    python benchmarks/quant.py [--size 4096] [--repeat 9] [--write]

One seeded size×size f32 matrix (Gaussian rows with a log-normal spread of row amplitudes) is
encoded to every dtype. Reported per dtype, medians of ``--repeat`` runs after warm-ups (which
also load the numba cache):

- bits per weight, relative RMS error, encode throughput;
- decode GB/s of f32 output, three ways: ``cmf.quant.decode`` called in a loop that drops each
  result (as gguf-py is timed: the dead output's pages are recycled, ``cmf.quant._outputs``), the
  same call with recycling off (``CMF_DECODE_CACHE_MB=0``: fresh pages from the kernel every
  call), and the numba decoder writing into one preallocated, already-touched array; next to
  gguf-py's numpy ``dequantize`` of the analogous GGUF type (q8_row ↔ Q8_0, q4_block ↔ Q4_0,
  bf16 ↔ BF16) timed in the same loop on the same matrix;
- fused mat-vec (``cmf.kernels``) in GB/s of payload bytes with 1 and 2 threads, next to numpy's
  f32 ``dot`` on the decoded matrix (GB/s of its f32 bytes, same thread counts);
- the batched path (T = 64, prefill) in GFLOP/s, next to numpy's f32 sgemm;
- the fused-vs-batched crossover in T that sets ``fused_max_t`` per family.

``--write`` replaces the ``## quant`` section of benchmarks/RESULTS.md. Run it on a quiet
machine: the load average at start and end is printed with the results.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import idle_fraction, machine, table, times  # noqa: E402

import cmf.quant as q  # noqa: E402
from cmf.kernels import set_threads  # noqa: E402
from cmf.kernels.fused import prepare_fused  # noqa: E402
from cmf.quant import _fast  # noqa: E402

DTYPES = ["f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro",
          "q1", "q1s", "q1t"]
GGUF_PAIRS = {"q8_row": "Q8_0", "q4_block": "Q4_0", "bf16": "BF16"}
INT8 = ["q4_block", "q4_tiled", "q4tp", "q2tp"]  # also measured with int8 activations ("+i8")
TARGETS = {"q8_row": 35.0, "q8_2f": 35.0, "q4_block": 20.0, "q4_tiled": 20.0, "q4tp": 20.0}
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def source(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    amp = np.exp2(rng.normal(0, 0.5, size=(n, 1))).astype(np.float32) * np.float32(0.02)
    return rng.standard_normal((n, n), dtype=np.float32) * amp


def rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
    d = (a.astype(np.float64) - ref).ravel()
    r = ref.astype(np.float64).ravel()
    return float(np.sqrt(d @ d / max(float(r @ r), 1e-300)))


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
    secs = clean_times(f"gguf {kind}", lambda: quants.dequantize(blob, qt), max(3, repeat // 2), warmup=1)[0]
    return w.nbytes / secs / 1e9


def decode_into(name: str, blob: bytes, shape: tuple[int, int], out: np.ndarray) -> bool:
    """The codec's own numba decoder, writing into ``out`` (False where the codec has none)."""
    c = q.get_codec(name)
    data = np.frombuffer(blob, np.uint8)
    if name == "f16":
        _fast.f16_decode(data, _fast.F16_TABLE, out.reshape(-1))
    elif name == "bf16":
        _fast.bf16_decode(data, out.reshape(-1).view(np.uint32))
    elif name in ("q8_row", "q8_2f"):
        parts = c._parts(data, shape)
        _fast.q8_decode(parts[0], parts[1], parts[2] if len(parts) > 2 else np.zeros(0, np.float32), out)
    elif name == "q4_block":
        packed, scales = c._parts(data, shape)
        _fast.q4_groups_decode(packed, scales, out.reshape(-1, 32))
    elif name == "q4_tiled":
        _fast.q4_tiles_decode(c._tiles(data, shape).view(np.uint8).reshape(-1, 18), _fast.F16_TABLE,
                              out.reshape(-1, 32))
    elif name in ("q4tp", "q2tp"):
        planes, params, codes = c.split(data, shape)
        _fast.ladder_decode(planes, codes, c.ladder(params), c._table, out)
    elif name in ("vbit", "vbit_ro"):
        d, widths, starts, soff, cols = c._layout(data, shape)
        _fast.vbit_decode(d, widths, starts, soff, _fast.F16_TABLE, cols, out)
    elif name == "q1":
        _fast.q1_decode(c._tiles_of(data, shape).view(np.uint8).reshape(-1, 6), _fast.F16_TABLE,
                        out.reshape(-1, 32))
    else:
        return False
    return True


def wait_idle(limit: float) -> bool:
    """Wait (up to ``limit`` seconds) until the machine is at least 90% idle; whether it was."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if idle_fraction(2.0) >= 0.9:
            return True
    return False


FLOOR: dict = {}  # time to allocate and touch one fresh output array; gguf-py GB/s per type
WAIT = 0.0  # seconds to wait for an idle machine before each timed kernel (--wait-idle)
QUIET: list[bool] = []
DISTURBED: list[str] = []
DEADLINE = float("inf")  # no retries after this (time.monotonic()); set from --wait-idle


def _busy_jiffies() -> int:
    with open("/proc/stat") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    return sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)


def clean_times(label: str, fn, repeat: int, warmup: int = 3) -> tuple[float, float]:
    """``times`` in a window where no other process used the CPUs: with --wait-idle, wait for an
    idle machine, time, and measure again (3 more tries at most) when the CPU time spent outside
    this process during the timing exceeded 10% of one core."""
    import resource

    tries = 4 if WAIT else 1
    for attempt in range(tries):
        if attempt and time.monotonic() > DEADLINE:
            break  # the run has waited long enough: keep the last measurement, flagged
        if WAIT and time.monotonic() < DEADLINE:
            QUIET.append(wait_idle(WAIT))
        try:
            j0 = _busy_jiffies()
        except OSError:
            return times(fn, repeat, warmup)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        result = times(fn, repeat, warmup)
        wall = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        mine = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        foreign = (_busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK") - mine
        if foreign <= 0.1 * wall:
            return result
    DISTURBED.append(label)
    return result


def _qtensor(name: str, blob: bytes, shape: tuple[int, int]) -> SimpleNamespace:
    arr = np.frombuffer(blob, np.uint8)
    return SimpleNamespace(numpy=lambda: arr, dtype=q.resolve_dtype(name), shape=shape, name=name,
                           nbytes=arr.nbytes)


def codec_rows(w: np.ndarray, repeat: int) -> tuple[list[list[object]], dict[str, bytes], str]:
    gb_out = w.nbytes / 1e9
    out = np.empty_like(w)
    out.fill(0)  # touched once: no page faults inside the timed decodes
    rows, blobs, decoded, gguf_gbs = [], {}, {}, {}
    for name in DTYPES:
        enc_s = min(once(lambda: q.encode(w, name)) for _ in range(1 if name in ("q2tp", "q1t", "q1s") else 2))
        blob = q.encode(w, name)
        blobs[name] = blob
        dec = q.decode(blob, name, w.shape)
        decoded[name] = dec
        loop = gb_out / clean_times(f"{name} decode", lambda: q.decode(blob, name, w.shape), repeat, 2)[0]
        os.environ["CMF_DECODE_CACHE_MB"] = "0"
        try:
            fresh = gb_out / clean_times(f"{name} decode fresh", lambda: q.decode(blob, name, w.shape), repeat, 2)[0]
        finally:
            del os.environ["CMF_DECODE_CACHE_MB"]
        pre = None
        if name != "f32" and decode_into(name, blob, w.shape, out):
            assert np.array_equal(out, dec)
            pre = gb_out / clean_times(f"{name} decode into", lambda: decode_into(name, blob, w.shape, out),
                                       repeat, 2)[0]
        ref = GGUF_PAIRS.get(name)
        g = gguf_decode(w, ref, repeat) if ref else None
        if g:
            gguf_gbs[ref] = g
        vs = f"{ref} {g:.2f} GB/s → ×{loop / g:.1f} / ×{fresh / g:.1f}" if g else ""
        rows.append([name, f"{len(blob) * 8 / w.size:.3f}", f"{rel_rms(dec, w) * 100:.2f}%",
                     f"{w.size / enc_s / 1e6:.1f}", "zero-copy view" if name == "f32" else f"{loop:.2f}",
                     "" if name == "f32" else f"{fresh:.2f}", "" if pre is None else f"{pre:.2f}", vs])
        print(f"codec {name}: done", file=sys.stderr, flush=True)
    def fresh_touch() -> None:  # what every fresh output costs before a decoder writes a byte
        _touch_pages(np.empty(w.size, np.float32))  # on every thread, as the decoders fault
    floor = clean_times("fresh array", fresh_touch, repeat, 2)[0]
    FLOOR.update(seconds=floor, gguf=gguf_gbs)
    q4t = decoded["q4_tiled"]
    requant = q.decode(q.encode(q4t, "q4tp"), "q4tp", w.shape)
    extra = (f"q4tp vs q4t: requant of the q4t-decoded matrix moves weights by {rel_rms(requant, q4t) * 100:.2f}% "
             f"RMS (FORMATS.md: 1.14% on published models); direct-encode error ratio q4tp/q4t = "
             f"{rel_rms(decoded['q4tp'], w) / rel_rms(q4t, w):.3f}.")
    return rows, blobs, extra


def kernel_rows(w: np.ndarray, blobs: dict[str, bytes], repeat: int) -> tuple[list[list[object]], str]:
    n = w.shape[0]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(np.float32)
    X = rng.standard_normal((64, n)).astype(np.float32)
    flops = 2.0 * 64 * w.size
    rows = []
    cells = [(name, False) for name in DTYPES]
    for name in INT8:  # the 4-bit family again with int8 activations, after its exact row
        cells.insert(cells.index((name, False)) + 1, (name, True))
    for name, i8 in cells:
        op = prepare_fused(_qtensor(name, blobs[name], w.shape))
        if i8:
            op.use_int8_activations(True)
        label = f"{name} +i8" if i8 else name
        gbs = []
        for th in (1, 2):
            # numba's threads only: re-setting OpenBLAS's thread count wakes its pool, whose
            # spinning workers then take a core from the next 2-thread product (measured 25 -> 13 GB/s)
            numba.set_num_threads(th)
            time.sleep(0.5)  # let the previous batched product's BLAS / numba workers stop spinning
            med, best = clean_times(f"{label} mat-vec {th}t", lambda: op(x), repeat * 3)
            gbs.append((op.nbytes / med / 1e9, op.nbytes / best / 1e9))
        gmed, gbest = clean_times(f"{label} batched", lambda: op(X), max(3, repeat // 2), warmup=1)
        tgt = TARGETS.get(name)
        mark = "" if tgt is None else f"{gbs[1][0] / tgt:.2f}× of {tgt:.0f}"
        weights = w.size / (op.nbytes / gbs[1][0] / 1e9) / 1e9 if gbs[1][0] else 0.0
        rows.append([label, f"{op.nbytes / 1e6:.1f}", f"{gbs[0][0]:.1f} ({gbs[0][1]:.1f})",
                     f"{gbs[1][0]:.1f} ({gbs[1][1]:.1f})", mark, f"{weights:.1f}",
                     f"{flops / gmed / 1e9:.0f} ({flops / gbest / 1e9:.0f})"])
        print(f"kernel {label}: done", file=sys.stderr, flush=True)
    dense = {}
    for th in (1, 2):
        set_threads(th)
        mv = clean_times(f"f32 dot {th}t", lambda: w @ x, repeat * 3)
        mm = clean_times(f"f32 sgemm {th}t", lambda: X @ w.T, max(3, repeat // 2), warmup=1)
        dense[th] = (w.nbytes / mv[0] / 1e9, w.nbytes / mv[1] / 1e9, flops / mm[0] / 1e9, flops / mm[1] / 1e9)
    note = (f"numpy f32 on the decoded matrix, median (best): `dot` {dense[1][0]:.1f} ({dense[1][1]:.1f}) / "
            f"{dense[2][0]:.1f} ({dense[2][1]:.1f}) GB/s of f32 on 1 / 2 threads "
            f"(= {w.size / (w.nbytes / dense[2][0] / 1e9) / 1e9:.1f} G weights/s on 2); sgemm T=64 "
            f"{dense[1][2]:.0f} ({dense[1][3]:.0f}) / {dense[2][2]:.0f} ({dense[2][3]:.0f}) GFLOP/s.")
    return rows, note


def crossover(w: np.ndarray, blobs: dict[str, bytes]) -> list[list[object]]:
    """Fused kernel vs dequantize-tiles + sgemm for small batches (2 threads)."""
    numba.set_num_threads(2)
    rows = []
    rng = np.random.default_rng(2)
    for name in ("f16", "q8_row", "q4tp", "vbit_ro"):
        op = prepare_fused(_qtensor(name, blobs[name], w.shape))
        cells = [name, op.fused_max_t]
        for T in (1, 8, 16, 32):
            X = rng.standard_normal((T, w.shape[1])).astype(np.float32)
            Y = np.empty((T, op.out_features), np.float32)
            fused = clean_times(f"{name} fused T={T}", lambda: op._matmul(X, Y, True), 9, warmup=1)[1]
            batched = clean_times(f"{name} batched T={T}", lambda: op._batched(X, None), 5, warmup=1)[1]
            cells.append(f"{fused * 1e3:.2f} / {batched * 1e3:.2f}")
        rows.append(cells)
    return rows


@numba.njit(parallel=True)
def _touch_pages(a: np.ndarray) -> None:
    """Write one float per 4 KB page, the pages split across the threads."""
    for i in numba.prange(a.size // 1024):
        a[i * 1024] = 0


def floor_note(nbytes: int) -> str:
    """How long a fresh output array costs on its own (page faults + the kernel zeroing pages)."""
    sec = FLOOR.get("seconds")
    if not sec:
        return ""
    return (f"Allocating a fresh {nbytes >> 20} MB array and touching each page from every thread alone takes "
            f"{sec * 1e3:.1f} ms here ({nbytes / sec / 1e9:.1f} GB/s of output), as long as or longer than the "
            "preallocated decodes: that, not the decoder, sets the fresh-pages column.")


def run(size: int, repeat: int) -> str:
    load0 = os.getloadavg()[0]
    w = source(size)
    crows, blobs, extra = codec_rows(w, repeat)
    krows, knote = kernel_rows(w, blobs, repeat)
    xrows = crossover(w, blobs)
    load1 = os.getloadavg()[0]
    quiet = (f" Every timing waited for a >= 90% idle machine ({sum(QUIET)} of {len(QUIET)} waits found one) "
             f"and was repeated when another process used over 10% of a core meanwhile; still disturbed after "
             f"four tries: {', '.join(DISTURBED) or 'none'}." if QUIET else "")
    stamp = datetime.date.today().isoformat()
    chead = ["dtype", "bits/weight", "rel RMS err", "encode Mweights/s", "decode GB/s (in a loop)",
             "decode GB/s (fresh pages)", "decode GB/s (preallocated)",
             "gguf-py numpy dequant (in a loop) → ratio in a loop / fresh pages"]
    khead = ["dtype", "payload MB", "fused mat-vec GB/s 1 thread, median (best)", "2 threads", "median vs target",
             "G weights/s (2 threads)", "batched T=64 GFLOP/s, 2 threads, median (best)"]
    xhead = ["dtype", "fused_max_t", "T=1 fused / batched ms (best)", "T=8", "T=16", "T=32"]
    return (
        f"Run {stamp} on {machine()}; numpy {np.__version__}; matrix {size}×{size} f32; medians of {repeat}+ "
        f"runs; load average {load0:.2f} at start, {load1:.2f} at end (the machine is shared: ratios come from "
        f"the same run).{quiet}\n\n"
        f"### Codecs\n\n{table(chead, crows)}\n\n{extra}\n\n"
        f"Decoding into a fresh {w.nbytes >> 20} MB array costs a page fault per page and the kernel zeroing it "
        "first: about as much time as the decode itself. `cmf.quant.decode` therefore recycles the pages of its "
        "dead outputs (`cmf.quant._outputs`: at least 4 MB, up to 4 blocks / 256 MB waiting, reused only once "
        "no array or view reaches them): the *in a loop* column is a loop that decodes and drops the result, "
        "timed exactly as gguf-py is (whose numpy output gets fresh pages every call). *Fresh pages* is the same "
        "call with recycling off (`CMF_DECODE_CACHE_MB=0`), what a first call costs; *preallocated* is the "
        "decoder alone, writing into one array touched beforehand. "
        f"{floor_note(w.nbytes)}\n\n"
        f"### Fused kernels (`cmf.kernels`)\n\n{table(khead, krows)}\n\n{knote}\n\n"
        "Mat-vec GB/s counts the payload bytes read per product (x = one vector). At 4096² a q8/q4 payload "
        "(8–17 MB) fits this CPU's 32 MB L3 cache, so repeated products can run above the DRAM bound (~45 GB/s "
        "on 2 threads); a model's layers do not. q4_block/q4_tiled/q4tp/q2tp run on 64-row tiles repacked at first "
        "use (no larger than the payload, see docs/ARCHITECTURE.md); the first product pays the repack. "
        "`+i8` rows: the same kernels with int8 activations (`use_int8_activations`, opt-in; x quantized per "
        "group of 32, integer dot products, results ~1e-2 relative from the exact product; the batched path "
        "stays exact).\n\n"
        f"### Fused vs batched for small T (2 threads)\n\n{table(xhead, xrows)}\n\n"
        "Batches up to `fused_max_t` vectors use the fused kernel (weights read once per product), larger "
        "ones the batched path: for f16/bf16/q8/4-bit, `kernels.gemm` (each numba thread dequantizes its rows "
        "and calls single-threaded sgemm on them: one thread pool), else 1 MB tiles dequantized on the calling "
        "thread and a threaded sgemm per tile.\n")


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
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--write", action="store_true", help="update the ## quant section of RESULTS.md")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each timing, wait up to S seconds for a >= 90%% idle machine, and time again "
                         "(3 more tries, for 30 minutes at most) when another process used the CPUs meanwhile")
    args = ap.parse_args()
    global WAIT, DEADLINE
    WAIT = args.wait_idle
    DEADLINE = time.monotonic() + 1800
    text = run(args.size, args.repeat)
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
