"""The host's memory bandwidth as the benchmarks measure it: a plain multi-thread read.

Each thread sums its share of a 64-float-wide matrix into 64 lanes: one vectorized add per 4
bytes, far below what the cores can do, so it runs at the rate the memory delivers (the
shared host's rate moves with the other tenants: 30–62 GB/s seen on 2 threads)."""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np


@numba.njit(fastmath=True)
def _part(a, i0, i1):  # pragma: no cover - compiled
    acc = np.zeros(64, np.float32)
    for i in range(i0, i1):
        for k in range(64):
            acc[k] += a[i, k]
    return acc.sum()


@numba.njit(parallel=True)
def _read(a, nt):  # pragma: no cover - compiled
    n = a.shape[0] // nt
    tot = np.zeros(nt, np.float32)
    for j in numba.prange(nt):
        tot[j] = _part(a, j * n, (j + 1) * n)
    return tot.sum()


def buffer(mb: int = 256) -> np.ndarray:
    """A resident [n, 64] float32 buffer of ``mb`` MB (much larger than any cache)."""
    return np.ones((mb * 2**20 // 256, 64), np.float32)


def read_gbps(buf: np.ndarray, threads: int = 2, reps: int = 8) -> float:
    """GB/s of a ``threads``-thread read of ``buf`` (from :func:`buffer`), median of ``reps``."""
    _read(buf, threads)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _read(buf, threads)
        ts.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(ts) / 1e9
