"""Shared helpers for benchmark scripts: timing with medians, tables, machine description."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable


def times(fn: Callable[[], object], repeat: int = 15, warmup: int = 2) -> tuple[float, float]:
    """(median, best) wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs:
    on a shared machine the best run is the one that was not preempted, the median what a caller sees."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def median_time(fn: Callable[[], object], repeat: int = 15, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    return times(fn, repeat, warmup)[0]


def idle_fraction(seconds: float = 1.0) -> float:
    """Share of CPU time spent idle (idle + iowait) over the next ``seconds``, all cores
    (/proc/stat); 1.0 where that cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        return sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)
    try:
        t1, i1 = sample()
        time.sleep(seconds)
        t2, i2 = sample()
    except OSError:
        return 1.0
    return (i2 - i1) / max(t2 - t1, 1)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def append_entry(results: "os.PathLike[str]", section: str, entry: str, intro: str = "") -> None:
    """Append ``entry`` at the end of ``section`` (a ``## `` heading line) of the markdown file
    ``results``, creating the file or the section (followed by ``intro``) when missing."""
    from pathlib import Path

    path = Path(results)
    body = path.read_text() if path.exists() else "# Benchmark results\n"
    if section + "\n" not in body:
        body = body.rstrip("\n") + f"\n\n\n{section}\n\n{intro}\n"
    start = body.index(section + "\n")
    nxt = body.find("\n## ", start + 1)
    entry = "\n" + entry.strip("\n") + "\n"
    if nxt >= 0:  # the next section follows: insert before it
        body = body[:nxt + 1] + entry.lstrip("\n") + "\n" + body[nxt + 1:]
    else:
        body = body.rstrip("\n") + "\n" + entry
    path.write_text(body)


# OpenBLAS core types for the LLVM CPU names the "@cpu" cells use: numpy's OpenBLAS picks its
# sgemm by the host's CPU, so without this an AVX-512 host's prefill stays AVX-512 in a cell
# that is meant to show an AVX2 machine.
OPENBLAS_CORE = {"haswell": "Haswell", "broadwell": "Haswell", "skylake": "Haswell", "alderlake": "Haswell",
                 "znver1": "Zen", "znver2": "Zen", "znver3": "Zen", "skylake-avx512": "SkylakeX",
                 "cascadelake": "SkylakeX", "cooperlake": "Cooperlake", "sapphirerapids": "SapphireRapids"}


def cpu_env(cpu: str) -> dict[str, str]:
    """The environment that compiles every kernel for LLVM CPU ``cpu`` with that CPU's own
    features (numba pairs a bare NUMBA_CPU_NAME with the host's features, so the empty
    NUMBA_CPU_FEATURES matters) and has OpenBLAS use that CPU's sgemm where it knows one."""
    env = {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": ""}
    if cpu in OPENBLAS_CORE:
        env["OPENBLAS_CORETYPE"] = OPENBLAS_CORE[cpu]
    return env
