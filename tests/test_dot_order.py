"""kernels/dot_ir: the one summation order of the q8, f16/bf16 and f32 mat-vec bodies.

Every kernel (four rows × one vector, one row, two rows × two vectors) must give each (row,
vector) the documented sum — two 8-lane FMA chains over blocks of 16, a fixed add tree, scalar
FMAs for the tail — on this CPU, and the IR compiled for other CPUs must hold no operation the
optimizer may reorder (what made the batched rows differ from the one-token rows on AVX-512).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from cmf.kernels.dot_ir import dot1, dot4, dot22

FAST = {"reassoc", "contract", "nsz", "arcp"}  # the kernels' fastmath set: the IR must survive it


@numba.njit(fastmath=FAST)
def _all(w, x, kind):  # pragma: no cover - compiled
    a = dot4(w[0], w[1], w[2], w[3], x[0], kind)
    b = dot22(w[0], w[1], x[0], x[1], kind)
    c = dot1(w[2], x[1], kind)
    return a, b, c


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: the product of two float32 is exact in float64."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _oracle(w: np.ndarray, x: np.ndarray) -> np.float32:
    """The documented order, in numpy (w already as float32)."""
    n = w.shape[0]
    lo = np.zeros(8, np.float32)
    hi = np.zeros(8, np.float32)
    for j in range(n // 16):
        lo = _fma(w[16 * j:16 * j + 8], x[16 * j:16 * j + 8], lo)
        hi = _fma(w[16 * j + 8:16 * j + 16], x[16 * j + 8:16 * j + 16], hi)
    v = hi + lo
    v = v[:4] + v[4:]
    v = v[:2] + v[2:]
    s = np.array([v[0] + v[1]], np.float32)
    for i in range(16 * (n // 16), n):
        s = _fma(w[i:i + 1], x[i:i + 1], s)
    return s[0]


def _weights(kind: str, rng, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(stored rows, the same as float32, kind argument)."""
    if kind == "i8":
        w = rng.integers(-128, 128, (4, n)).astype(np.int8)
        return w, w.astype(np.float32), 0
    f = (rng.standard_normal((4, n)) * 0.1).astype(np.float32)
    if kind == "f16":
        h = f.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float32), 1
    if kind == "bf16":
        b = (f.view(np.uint32) >> 16).astype(np.uint16)
        return b, (b.astype(np.uint32) << 16).view(np.float32), 2
    return f, f, 0


@pytest.mark.parametrize("kind", ["i8", "f16", "bf16", "f32"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 15, 16, 17, 31, 32, 96, 200, 576, 1027])
def test_every_kernel_gives_the_documented_order(kind: str, n: int) -> None:
    rng = np.random.default_rng(n)
    stored, wf, k = _weights(kind, rng, n)
    x = rng.standard_normal((2, n)).astype(np.float32)
    a, b, c = _all(stored, x, k)
    want = {(r, v): _oracle(wf[r], x[v]) for r in range(4) for v in range(2)}
    assert [np.float32(t) for t in a] == [want[r, 0] for r in range(4)]
    assert [np.float32(t) for t in b] == [want[0, 0], want[1, 0], want[0, 1], want[1, 1]]
    assert np.float32(c) == want[2, 1]


def test_strided_views_are_copied_not_misread() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 80)) * 0.1).astype(np.float32)
    x = rng.standard_normal((2, 80)).astype(np.float32)
    a, b, c = _all(w[:, ::2], x[:, ::2], 0)  # every other column: 40 elements, non-contiguous
    assert np.float32(a[3]) == _oracle(w[3, ::2].copy(), x[0, ::2].copy())
    assert np.float32(c) == _oracle(w[2, ::2].copy(), x[1, ::2].copy())


IR = """
import numba, numpy as np
from numba import types
from cmf.kernels.dot_ir import dot1, dot4, dot22
@numba.njit(fastmath={"reassoc", "contract", "nsz", "arcp"})
def f(w, x, kind):
    return dot4(w[0], w[1], w[2], w[3], x[0], kind), dot22(w[0], w[1], x[0], x[1], kind), dot1(w[0], x[0], kind)
sig = (types.Array(types.uint16, 2, "C"), types.Array(types.float32, 2, "C"), types.int64)
f.compile(sig)
ll = f.inspect_llvm(sig)
print("reassoc" in ll, "vector.reduce" in ll, ll.count("@llvm.fma.v8f32") > 0)
"""


@pytest.mark.parametrize("cpu", ["haswell", "icelake-server", "znver4"])
def test_the_ir_for_every_cpu_holds_nothing_reorderable(cpu: str, tmp_path) -> None:
    """Compiled (not run) for AVX2, 256-bit-preferring AVX-512 and 512-bit Zen 4: no reassociable
    operation survives numba's fastmath pass, so the order above is what each of them runs."""
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", IR], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False False True"
