"""hash64: the CMF per-tensor hash (spec §8, REFERENCE_NOTES §1.5).

    fmix64(word_i) ^ (i * 0x9E3779B97F4A7C15), XOR-folded over 64-bit little-endian words
    (the last partial word zero-padded at its high end), then ``^ len`` and a final fmix64.

The fold is an XOR of independent terms, so any split of the words into chunks can be hashed
in parallel and combined with XOR. Small inputs use numpy (no JIT start-up); large ones use a
numba kernel parallel over chunks.
"""

from __future__ import annotations

import logging
import os
from typing import Union

import numpy as np

log = logging.getLogger(__name__)

_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_SALT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
# Below this size numpy is faster than calling into a JIT kernel.
_NUMBA_MIN_BYTES = 1 << 18
# Words per chunk handed to the numba kernel by each thread (keeps partial XORs cache friendly).
_CHUNK_WORDS = 1 << 16

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


def _fmix64_int(x: int) -> int:
    x ^= x >> 33
    x = (x * _M1) & _MASK
    x ^= x >> 33
    x = (x * _M2) & _MASK
    x ^= x >> 33
    return x


def _fold_numpy(words: np.ndarray, first_index: int) -> int:
    """XOR of fmix64(w_i) ^ (i·SALT) for a run of words starting at word index ``first_index``."""
    if words.size == 0:
        return 0
    x = words.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(33)
        x *= np.uint64(_M1)
        x ^= x >> np.uint64(33)
        x *= np.uint64(_M2)
        x ^= x >> np.uint64(33)
        idx = np.arange(first_index, first_index + words.size, dtype=np.uint64)
        x ^= idx * np.uint64(_SALT)
    return int(np.bitwise_xor.reduce(x))


_numba_fold = None


def _get_numba_fold():
    """Compile (or load from cache) the parallel fold kernel on first use."""
    global _numba_fold
    if _numba_fold is None:
        import numba as nb

        m1, m2, salt = np.uint64(_M1), np.uint64(_M2), np.uint64(_SALT)
        s33 = np.uint64(33)

        @nb.njit(cache=True, parallel=True, nogil=True)
        def fold(words, chunk):  # pragma: no cover - compiled
            n = words.size
            nchunks = (n + chunk - 1) // chunk
            parts = np.zeros(nchunks, dtype=np.uint64)
            for c in nb.prange(nchunks):
                start = c * chunk
                end = min(n, start + chunk)
                acc = np.uint64(0)
                for i in range(start, end):
                    x = words[i]
                    x ^= x >> s33
                    x *= m1
                    x ^= x >> s33
                    x *= m2
                    x ^= x >> s33
                    acc ^= x ^ (np.uint64(i) * salt)
                parts[c] = acc
            out = np.uint64(0)
            for c in range(nchunks):
                out ^= parts[c]
            return out

        _numba_fold = fold
    return _numba_fold


def _as_bytes_array(data: Buffer) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def hash64(data: Buffer) -> int:
    """Return the CMF hash64 of ``data`` (bytes, memoryview or a numpy array's raw bytes)."""
    raw = _as_bytes_array(data)
    n = raw.size
    nwords = n // 8
    body = raw[: nwords * 8]
    acc = 0
    if nwords:
        if body.ctypes.data % 8:
            body = body.copy()  # unaligned (e.g. a header inside the mmap): copy once
        words = body.view("<u8")
        if n >= _NUMBA_MIN_BYTES and os.environ.get("CMF_HASH_NUMPY") != "1":
            try:
                acc = int(_get_numba_fold()(words, _CHUNK_WORDS))
            except Exception:  # pragma: no cover - numba unavailable or broken
                log.warning("numba hash64 kernel unavailable; falling back to numpy", exc_info=True)
                acc = _fold_numpy(words, 0)
        else:
            acc = _fold_numpy(words, 0)
    tail = n - nwords * 8
    if tail:
        word = int.from_bytes(bytes(raw[nwords * 8:]), "little")
        acc ^= _fmix64_int(word) ^ ((nwords * _SALT) & _MASK)
    return _fmix64_int(acc ^ n)


def hash64_hex(data: Buffer) -> str:
    """hash64 as the lowercase, zero-padded 16-digit hex used in JSON and skill keys."""
    return format(hash64(data), "016x")
