#!/usr/bin/env python3
"""Reader fuzzer: run many mutated CMF files through open()+verify() in-process and count outcomes.

Valid seed files are built with the writer (all sections, every dtype family, a minimal one).
Each iteration mutates one in memory (bit flips, byte writes, truncation, splices, insertions,
deletions, and targeted rewrites of envelope fields, the directory prefix, directory record fields
and integers inside tensor payloads with boundary values), writes it to a tmpfs file, then opens,
verifies and walks it. Outcomes: ``clean`` (opened, verify empty), ``verify_problems``, one count
per CmfError subclass, and ``BUG:<type>`` for anything else, including a hang (the input exceeded
--hang-seconds) — each BUG saves a reproducer file and its traceback. Inputs slower than 1 s are
counted as ``slow``.

    python benchmarks/fuzz_reader.py --seconds 60 --seed 1

Exit status: 0 when no BUG was seen, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import cmf
from cmf.format.directory import RECORD_DTYPE, decode_directory
from cmf.format.errors import CmfError
from cmf.format.masks import MaskSet, TaskMask
from cmf.format.writer import CmfWriter

U64 = 2**64 - 1
ENV_FIELDS = [(0x04, 4), (0x08, 4), (0x0C, 4)] + [(0x10 + 8 * i, 8) for i in range(14)]
REC_FIELDS = [(off, dt.base.itemsize) for name, (dt, off) in RECORD_DTYPE.fields.items() if name != "shape"]
REC_FIELDS += [(8 + 4 * k, 4) for k in range(6)]
BOUNDARY = [0, 1, 2, 7, 8, 63, 64, 65, 4095, 4096, 2**16 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1,
            2**63, U64 - 63, U64 - 1, U64]
SLOW_S = 1.0
# Header JSON rewrites: keys (top-level or "arch.<key>") and the values they may take.
HEADER_KEYS = ["version", "quant_type", "arch", "shard", "section_hashes", "skills", "tokenizer_config", "format",
               "arch.hidden_size", "arch.intermediate_size", "arch.num_layers", "arch.num_attention_heads",
               "arch.num_kv_heads", "arch.layer_types", "arch.num_loops", "arch.moe", "arch.mtp", "arch.yarn",
               "arch.rms_norm_eps", "arch.vocab_size"]
HEADER_VALUES: list[Any] = [0, 1, -1, 2, 3, 1000, 2**31, 2**32, 2**64, 1.5, 1e308, "x", "", None, [], {}, True,
                            ["FullAttention"], {"no": 1, "count": 2}, {"no": 2, "count": 1},
                            {"masks": "0", "vocab": "zz", "index": "ffffffffffffffffff"},
                            {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32}]


# ----------------------------------------------------------------------------- seed files


def _arch() -> dict[str, Any]:
    return {"arch_name": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
            "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128,
            "layer_types": ["FullAttention", "FullAttention"], "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256}


def _vbit(rows: int, cols: int, widths: list[int], rng: np.random.Generator, ro: bool) -> bytes:
    """A well-formed vbit (or vbit_ro) payload with random codes."""
    row_bytes = [(w * cols + 7) // 8 for w in widths]
    out = bytes(widths) + rng.uniform(0.01, 0.1, rows * cols // 32).astype("<f2").tobytes()
    if ro:
        out += np.concatenate([[0], np.cumsum(row_bytes)]).astype("<u4").tobytes()
    return out + rng.integers(0, 256, sum(row_bytes), dtype=np.uint8).tobytes()


def _masks() -> MaskSet:
    rng = np.random.default_rng(1)
    a = TaskMask(task_id=0, name="general", sparsity=0.0, quality=None, ffn=np.ones((2, 96), bool),
                 heads=np.ones((2, 4), bool), gates=np.ones(2, bool))
    b = TaskMask(task_id=1, name="coding", sparsity=0.5, quality={"metric": "heldout_ppl_ratio", "value": 1.02},
                 ffn=rng.random((2, 96)) < 0.5, heads=rng.random((2, 4)) < 0.5, gates=np.array([True, False]))
    return MaskSet(default_task="general", masks=[a, b])


def build_seeds(folder: Path) -> list[Path]:
    """Write the seed files; returns their paths."""
    rng = np.random.default_rng(0)

    def rand(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    hdr = {"version": 2, "arch": _arch(), "quant_type": "F32", "provenance": {"tool": "fuzz"},
           "tokenizer_config": None}
    q1s = bytes(6 * 8) + struct.pack("<I", 2) + struct.pack("<I", 5) + b"\x00\x3c" + struct.pack("<I", 200) + b"\x00\xbc"
    q1t = bytes(9 * 8) + np.array([0, 1, 1, 3, 3], "<u4").tobytes() + b"\x01\x00\x00\x3c\x3f\x00\x00\xbc\x02\x00\x00\x40"
    rich = [
        ("model.embed_tokens.weight", "f32", (32, 64), rng.standard_normal((32, 64)).astype("<f4").tobytes()),
        ("model.norm.weight", "f16", (64,), np.ones(64, "<f2").tobytes()),
        ("model.layers.0.mlp.up_proj.weight", "f32", (96, 64), rng.standard_normal((96, 64)).astype("<f4").tobytes()),
        ("model.layers.0.mlp.gate_proj.weight", "q8_row", (8, 64), rand(8 * 64 + 16)),
        ("model.layers.0.mlp.down_proj.weight", "q4_tiled", (8, 64), rand(18 * 16)),
        ("model.layers.0.a", "q4_block", (3, 50), rand(18 * 5)),
        ("model.layers.0.b", "q8_2f", (4, 64), rand(256 + 8 + 128)),
        ("model.layers.1.a", "vbit", (4, 64), _vbit(4, 64, [3, 5, 6, 8], rng, False)),
        ("model.layers.1.b", "vbit_ro", (4, 64), _vbit(4, 64, [3, 4, 8, 6], rng, True)),
        ("model.layers.1.c", "q4tp", (4, 64), rand(4 * 2 * 16 + 16 + 8)),
        ("model.layers.1.d", "q2tp", (4, 64), rand(4 * 2 * 8 + 16 + 8)),
        ("model.layers.1.e", "q1", (4, 64), rand(48)),
        ("model.layers.1.f", "q1s", (4, 64), q1s),
        ("model.layers.1.g", "q1t", (4, 64), q1t),
        ("lm_head.weight", "bf16", (32, 64), rand(32 * 64 * 2)),
        ("te.config_json", "u8", (11,), b'{"dim": 64}'),
    ]
    out = []
    p = folder / "rich.cmf"
    with CmfWriter(p, hdr, sparse_index=True) as w:
        for t in rich:
            w.add(*t)
        w.set_masks(_masks())
        w.set_vocab(b'{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":[]}}')
    out.append(p)
    p = folder / "small.cmf"
    with CmfWriter(p, {"version": 2, "arch": _arch(), "quant_type": "VBIT"}) as w:
        for t in rich[7:9] + rich[12:14] + rich[1:2]:
            w.add(*t)
    out.append(p)
    p = folder / "minimal.cmf"
    with CmfWriter(p, {"version": 2, "arch": _arch(), "quant_type": "F32"}) as w:
        w.add("x", "f32", (2,), np.ones(2, "<f4").tobytes())
    out.append(p)
    for p in out:
        with cmf.open(p) as f:
            assert f.verify() == [], p
    return out


@dataclass(frozen=True)
class Seed:
    data: bytes
    dir_off: int
    count: int
    payloads: tuple[tuple[int, int], ...]


def describe(data: bytes) -> Seed:
    secs = struct.unpack_from("<12Q", data, 0x10)
    rec, _ = decode_directory(data[secs[2]:secs[2] + secs[3]])
    return Seed(data, secs[2], len(rec), tuple((secs[4] + int(r["off"]), int(r["nbytes"])) for r in rec))


# ----------------------------------------------------------------------------- mutator


def _value(rng: random.Random, size: int) -> int:
    r = rng.random()
    if r < 0.6:
        return rng.choice(BOUNDARY)
    if r < 0.75:
        return size + rng.randint(-2, 2)
    if r < 0.9:
        return rng.getrandbits(rng.choice((8, 16, 32, 64)))
    return rng.randint(0, 2 * size + 8)


def _put(buf: bytearray, pos: int, width: int, value: int) -> None:
    value &= (1 << (8 * width)) - 1
    if 0 <= pos and pos + width <= len(buf):
        buf[pos:pos + width] = value.to_bytes(width, "little")


def rewrite_header(buf: bytearray, rng: random.Random) -> None:
    """Set one header key (top-level or in ``arch``) to an odd value and re-lay the head in place.

    The directory moves right after the new header; nothing happens if the envelope no longer
    describes a parsable header or the new head does not fit before data_off.
    """
    if len(buf) < 128:
        return
    h_off, h_len, d_off, d_len, data_off = struct.unpack_from("<5Q", buf, 0x10)
    try:
        hdr = json.loads(bytes(buf[h_off:h_off + h_len]))
    except (ValueError, RecursionError):
        return
    key = rng.choice(HEADER_KEYS)
    target = hdr
    if key.startswith("arch."):
        target, key = hdr.get("arch"), key[5:]
    if not isinstance(target, dict):
        return
    value = rng.choice(HEADER_VALUES)
    if value is None and rng.random() < 0.5:
        target.pop(key, None)
    else:
        target[key] = value
    raw = json.dumps(hdr).encode()
    directory = bytes(buf[d_off:d_off + d_len])
    end = h_off + len(raw) + len(directory)
    if end > data_off or data_off > len(buf) or len(directory) != d_len:
        return
    buf[h_off:end] = raw + directory
    buf[end:data_off] = bytes(data_off - end)
    struct.pack_into("<Q", buf, 0x18, len(raw))
    struct.pack_into("<Q", buf, 0x20, h_off + len(raw))


def mutate(seed: Seed, rng: random.Random) -> tuple[bytes, str]:
    """1-4 random mutations of ``seed``; returns the bytes and the mutation kinds, '+'-joined."""
    buf = bytearray(seed.data)
    kinds = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        kind = rng.choice(("flip", "flip", "byte", "truncate", "splice", "insert", "delete", "env", "env",
                           "dirprefix", "record", "record", "record", "payload", "payload", "header"))
        kinds.append(kind)
        n = max(len(buf), 1)
        if kind == "flip" and buf:
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif kind == "byte" and buf:
            buf[rng.randrange(n)] = rng.randrange(256)
        elif kind == "truncate":
            del buf[rng.randrange(len(buf) + 1):]
        elif kind == "splice":
            src, dst, length = rng.randrange(n), rng.randrange(n), rng.randint(1, 600)
            chunk = buf[src:src + length]
            buf[dst:dst + len(chunk)] = chunk
        elif kind == "insert":
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 64))
        elif kind == "delete":
            pos = rng.randrange(n)
            del buf[pos:pos + rng.randint(1, 600)]
        elif kind == "env":
            off, width = rng.choice(ENV_FIELDS)
            _put(buf, off, width, _value(rng, len(buf)))
        elif kind == "dirprefix":
            _put(buf, seed.dir_off + 8 * rng.randrange(2), 8, _value(rng, len(buf)))
        elif kind == "record" and seed.count:
            off, width = rng.choice(REC_FIELDS)
            _put(buf, seed.dir_off + 16 + 56 * rng.randrange(seed.count) + off, width, _value(rng, len(buf)))
        elif kind == "payload" and seed.payloads:
            p_off, p_len = rng.choice(seed.payloads)
            _put(buf, p_off + rng.randrange(max(p_len, 1)), rng.choice((1, 2, 4, 8)), _value(rng, p_len))
        elif kind == "header":
            rewrite_header(buf, rng)
    return bytes(buf), "+".join(kinds)


# ----------------------------------------------------------------------------- harness


class Hang(Exception):
    """Raised by the interval timer when one input runs past --hang-seconds."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_one(path: Path) -> str:
    """Open, verify and walk one file; return its outcome label (raises for BUGs)."""
    with cmf.open(path) as f:
        problems = f.verify()
        for t in f.tensors():
            if len(t.data) != t.nbytes:
                raise AssertionError(f"tensor {t.name!r}: view of {len(t.data)} B, nbytes {t.nbytes}")
        _ = (f.masks, f.sparse_index, f.tokenizer_json, f.runnable, f.arch, f.skills)
    return "verify_problems" if problems else "clean"


def fuzz(iterations: int, seconds: float | None, seed: int, workdir: Path, bug_dir: Path,
         hang_s: float, progress: Callable[[int, Counter], None] | None = None) -> dict[str, Any]:
    """The fuzz loop. Returns a summary dict (counts, rates, bugs)."""
    seeds = [describe(p.read_bytes()) for p in build_seeds(workdir)]
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    bugs: list[dict[str, Any]] = []
    saved_signatures: Counter[str] = Counter()
    path = workdir / "input.cmf"
    slow = 0
    worst = 0.0
    old = signal.signal(signal.SIGALRM, _on_alarm)
    start = time.perf_counter()
    deadline = start + seconds if seconds else None
    i = 0
    try:
        while i < iterations:
            if deadline is not None and (i & 63) == 0 and time.perf_counter() >= deadline:
                break
            s = seeds[rng.randrange(len(seeds))]
            data, kinds = mutate(s, rng)
            path.write_bytes(data)
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, hang_s)
            try:
                outcome = run_one(path)
            except CmfError as exc:
                outcome = type(exc).__name__
            except BaseException as exc:  # noqa: BLE001 - anything else is the bug we hunt
                if isinstance(exc, KeyboardInterrupt):
                    raise
                signal.setitimer(signal.ITIMER_REAL, 0)
                outcome = "BUG:hang" if isinstance(exc, Hang) else f"BUG:{type(exc).__name__}"
                tb = traceback.format_exc()
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                signature = f"{outcome}@{Path(frame.filename).name}:{frame.lineno}"
                saved_signatures[signature] += 1
                if saved_signatures[signature] <= 3:
                    bug_dir.mkdir(parents=True, exist_ok=True)
                    repro = bug_dir / f"bug-{seed}-{i}-{type(exc).__name__}.cmf"
                    repro.write_bytes(data)
                    repro.with_suffix(".txt").write_text(f"mutations: {kinds}\n{tb}")
                    bugs.append({"iteration": i, "outcome": outcome, "signature": signature,
                                 "reproducer": str(repro), "error": str(exc)[:300]})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            dt = time.perf_counter() - t0
            worst = max(worst, dt)
            if dt > SLOW_S:
                slow += 1
            outcomes[outcome] += 1
            for k in kinds.split("+"):
                by_kind[k] += 1
            i += 1
            if progress is not None and i % 20000 == 0:
                progress(i, outcomes)
    finally:
        signal.signal(signal.SIGALRM, old)
        path.unlink(missing_ok=True)
    elapsed = time.perf_counter() - start
    return {"inputs": i, "seconds": round(elapsed, 2), "inputs_per_second": round(i / elapsed, 1) if elapsed else 0,
            "seed": seed, "outcomes": dict(outcomes.most_common()), "mutations": dict(by_kind.most_common()),
            "slow_over_1s": slow, "worst_ms": round(worst * 1e3, 2), "bug_signatures": dict(saved_signatures),
            "bugs": bugs}


def default_tmp() -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=1_000_000, help="number of mutated inputs (default 1e6)")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--tmpdir", default=default_tmp(), help="where inputs are written (default: /dev/shm)")
    ap.add_argument("--bug-dir", type=Path, default=Path("fuzz-bugs"), help="where reproducers are saved")
    ap.add_argument("--hang-seconds", type=float, default=5.0, help="an input running longer is a BUG:hang")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    def progress(i: int, outcomes: Counter) -> None:
        print(f"  {i:,} inputs; bugs so far: {sum(v for k, v in outcomes.items() if k.startswith('BUG'))}",
              file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="cmf-fuzz-", dir=args.tmpdir) as work:
        summary = fuzz(args.iterations, args.seconds, args.seed, Path(work), args.bug_dir, args.hang_seconds,
                       progress=None if args.json else progress)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"inputs: {summary['inputs']:,} in {summary['seconds']} s "
              f"({summary['inputs_per_second']:,.0f} inputs/s), seed {args.seed}")
        print("outcomes:")
        for k, v in summary["outcomes"].items():
            print(f"  {k:<22} {v:>10,}  {100 * v / max(summary['inputs'], 1):6.2f}%")
        print("mutations applied:", ", ".join(f"{k} {v:,}" for k, v in summary["mutations"].items()))
        print(f"slower than 1 s: {summary['slow_over_1s']}   worst: {summary['worst_ms']} ms")
        for b in summary["bugs"]:
            print(f"BUG {b['signature']}: {b['error']}  -> {b['reproducer']}")
    return 1 if summary["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
