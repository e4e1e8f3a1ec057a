"""Container benchmarks: open time, verify/hash throughput, write throughput vs safetensors and gguf-py.

    python benchmarks/container.py [--gb 1.0] [--repeat 15]

Prints Markdown tables (medians and ratios measured in the same run).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_time, table  # noqa: E402

import cmf  # noqa: E402
from cmf.format.hash64 import hash64  # noqa: E402
from cmf.format.writer import CmfWriter  # noqa: E402

HEADER = {"version": 2, "quant_type": "F32", "arch": {
    "arch_name": "bench", "hidden_size": 64, "intermediate_size": 64, "num_layers": 1,
    "num_attention_heads": 1, "num_kv_heads": 1, "head_dim": 64, "vocab_size": 64,
    "layer_types": ["FullAttention"], "rms_norm_eps": 1e-6, "max_position_embeddings": 64}}


def tensors(count: int, shape=(64, 64)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(shape).astype(np.float32)
    return {f"model.layers.{i // 10}.t{i % 10}.weight": base for i in range(count)}


def write_cmf(path: Path, ts: dict[str, np.ndarray], direct: bool = False) -> None:
    with CmfWriter(path, HEADER, expected_names=list(ts) if direct else None) as w:
        for name, a in ts.items():
            w.add(name, "f32", a.shape, a)


def write_st(path: Path, ts: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(ts, str(path))


def write_gguf(path: Path, ts: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "bench")
    for name, a in ts.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def open_cmf(path: Path) -> None:
    with cmf.open(path) as f:
        f.keys()


def open_st(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        list(f.keys())


def open_gguf(path: Path) -> None:
    import gguf

    r = gguf.GGUFReader(str(path))
    len(r.tensors)


def bench_open(tmp: Path, repeat: int) -> str:
    rows = []
    for count in (300, 10_000):
        ts = tensors(count, (16, 16) if count > 1000 else (64, 64))
        paths = {"pycmf": tmp / f"o{count}.cmf", "safetensors": tmp / f"o{count}.safetensors",
                 "gguf-py": tmp / f"o{count}.gguf"}
        write_cmf(paths["pycmf"], ts)
        write_st(paths["safetensors"], ts)
        write_gguf(paths["gguf-py"], ts)
        t_cmf = median_time(lambda: open_cmf(paths["pycmf"]), repeat)
        t_st = median_time(lambda: open_st(paths["safetensors"]), repeat)
        t_gg = median_time(lambda: open_gguf(paths["gguf-py"]), max(3, repeat // 3), 1)
        rows.append([count, f"{t_cmf * 1e3:.3f}", f"{t_st * 1e3:.3f}", f"{t_gg * 1e3:.1f}",
                     f"{t_st / t_cmf:.2f}×", f"{t_gg / t_cmf:.0f}×"])
    return table(["tensors", "pycmf open (ms)", "safetensors safe_open (ms)", "gguf GGUFReader (ms)",
                  "safetensors / pycmf", "gguf / pycmf"], rows)


def bench_hash(tmp: Path, gb: float, repeat: int) -> str:
    import numba

    n = int(gb * (1 << 30))
    path = tmp / "big.cmf"
    chunk = np.random.default_rng(1).standard_normal(1 << 22).astype(np.float32)  # 16 MiB
    count = max(1, n // chunk.nbytes)
    with CmfWriter(path, HEADER) as w:
        for i in range(count):
            w.add(f"t{i}", "f32", chunk.shape, chunk)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = np.frombuffer(mm, dtype=np.uint8)
        hash64(buf[: 1 << 20])  # compile / load the kernel
        rows = []
        reps = max(3, repeat // 3)
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            t = median_time(lambda: hash64(buf), reps, 1)
            rows.append([f"hash64, {threads} thread(s)", f"{size / t / 1e9:.2f}"])
        t_sha = median_time(lambda: hashlib.sha256(buf).digest(), reps, 1)
        rows.append(["hashlib.sha256 (1 thread)", f"{size / t_sha / 1e9:.2f}"])
        del buf
        mm.close()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

    def verify() -> None:
        with cmf.open(path) as f:
            assert f.verify() == []

    t_ver = median_time(verify, reps, 1)
    rows.append([f"cmf verify (open + every hash, {count} tensors)", f"{size / t_ver / 1e9:.2f}"])
    out = table([f"over a {size / 1e9:.2f} GB file (page cache warm)", "GB/s"], rows)
    rows2 = []
    ts = {f"t{i}": chunk for i in range(count)}
    writers = {"pycmf CmfWriter (compact layout: spool + one copy)": write_cmf,
               "pycmf CmfWriter(expected_names=...) (direct, no copy)": lambda p, t: write_cmf(p, t, True),
               "safetensors save_file": write_st, "gguf GGUFWriter": write_gguf}
    for name, fn in writers.items():
        target = tmp / f"w_{len(rows2)}.bin"

        def run() -> None:
            fn(target, ts)
            os.sync()

        t = median_time(run, 3, 1)
        rows2.append([name, f"{size / t / 1e9:.2f}"])
        target.unlink(missing_ok=True)
    path.unlink()
    return out + "\n\n" + table([f"write {size / 1e9:.2f} GB of f32 tensors (+ sync)", "GB/s"], rows2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=1.0, help="size of the hash/verify/write file")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--tmp", default=None, help="folder for the test files")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        print(f"# container benchmark — {datetime.date.today()} — {machine()}\n")
        print("## open time (median)\n")
        print(bench_open(tmp, args.repeat))
        print("\n## hash / verify / write throughput (median)\n")
        print(bench_hash(tmp, args.gb, args.repeat))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\n(total {time.time() - t0:.0f} s)")
