"""Elementwise math that LLVM vectorizes: exp and the gated activations built on it.

numba lowers ``np.exp`` on float32 to a scalar libm call per element (no SVML here), ~5-8 ns
each: a prefill softmax over 512 keys × 512 queries × 16 heads is then 2 M calls, 15+ ms a
layer, and the SiLU of every decoded token ~30 µs. ``exp_f32`` is the classic range reduction
x = n·ln2 + r (|r| ≤ ln2/2, ln2 split in two for exactness), a degree-5 minimax polynomial for
e^r (the Cephes coefficients, ~1 ulp) and 2^n assembled in the exponent bits — only
arithmetic and bit operations, so loops over it run 16 lanes wide. Inputs below −87.33 give 0,
above 88.72 give inf, NaN stays NaN;
(88.37, 88.72] is clamped to e^88.37 (2^n must stay a float; no caller gets near it).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_LOG2E = np.float32(1.4426950408889634)
_C1 = np.float32(0.693359375)
_C2 = np.float32(-2.12194440e-4)
_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                   1.6666665459e-1, 5.0000001201e-1))
_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


@intrinsic
def _pow2i(typingctx, n):  # noqa: ANN001
    """2^n for an integral float32 n in [-126, 127], through the exponent bits (i32 lanes)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        k = builder.fptosi(args[0], i32)
        bits = builder.shl(builder.add(k, ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.float32), codegen


@numba.njit(inline="always")
def exp_f32(x):  # pragma: no cover - compiled
    """e^x in float32 (see the module docstring)."""
    if x != x:
        return x
    y = min(max(x, np.float32(-87.33)), np.float32(88.37))  # n ≤ 127: 2^n stays a float
    n = np.floor(y * _LOG2E + np.float32(0.5))
    r = y - n * _C1 - n * _C2
    p = _P[0]
    p = p * r + _P[1]
    p = p * r + _P[2]
    p = p * r + _P[3]
    p = p * r + _P[4]
    p = p * r + _P[5]
    e = (p * r * r + r + np.float32(1)) * _pow2i(n)
    if x > np.float32(88.72):
        return np.float32(np.inf)
    return e if x >= np.float32(-87.33) else np.float32(0)


@numba.njit(inline="always")
def tanh_f32(x):  # pragma: no cover - compiled
    """tanh through exp_f32: 1 − 2/(e^{2x} + 1) (exact limits ±1)."""
    return np.float32(1) - np.float32(2) / (exp_f32(np.float32(2) * x) + np.float32(1))


@numba.njit(inline="always")
def gated(g, u, act):  # pragma: no cover - compiled
    """act(g)·u for act 0 silu, 1 gelu (tanh form), 2 gelu (erf), 3 relu."""
    if act == 0:
        a = g / (np.float32(1) + exp_f32(-g))
    elif act == 1:
        a = np.float32(0.5) * g * (np.float32(1) + tanh_f32(_SQRT_2_OVER_PI * (g + np.float32(0.044715) * g * g * g)))
    elif act == 2:
        a = np.float32(0.5 * g * (1.0 + math.erf(g / math.sqrt(2.0))))
    else:
        a = max(g, np.float32(0))
    return a * u


__all__ = ["exp_f32", "tanh_f32", "gated"]


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, error_model="numpy")
def gated_rows(Y, width, act, i0, i1):  # pragma: no cover - compiled
    """Y[t, i] = act(Y[t, i])·Y[t, width + i] for i in [i0, i1) and every t: gate in the first
    half of each row, up after it (the one-token and the batched products' gated activation).

    Through 1-D views of each row's two halves: indexing Y[t, i] and Y[t, width + i] directly, the
    loop did not vectorize (LLVM could not tell the two apart: 3.4–4.9 ns an element, a quarter of
    a 16-sequence gate/up product; the views: 0.4 ns, the same values)."""
    for t in range(Y.shape[0]):
        g = Y[t, i0:i1]
        u = Y[t, width + i0:width + i1]
        if act == 0:
            for k in range(i1 - i0):
                x = g[k]
                g[k] = x / (np.float32(1) + exp_f32(-x)) * u[k]
        else:
            for k in range(i1 - i0):
                g[k] = gated(g[k], u[k], act)
