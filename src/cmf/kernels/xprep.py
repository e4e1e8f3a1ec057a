"""The input vector of the 4-bit tile kernels (``q4.py``), prepared once per product.

Two forms: ``split_x`` regroups float32 x by a weight's position within its byte (nibble or
crumb phase) for the float kernels; ``quantize_x`` turns each group of 32 into int8 pieces laid
out for the integer kernels (``_ir.tile_dot_i8*``): one piece for the opt-in int8 activations,
three for exact mode. ``fill_x`` picks the form from the buffers it is given.
"""

from __future__ import annotations

import numba
import numpy as np

from ..format.constants import GROUP
from ._ir import quantize_group_c1, quantize_group_c3, quantize_group_n1, quantize_group_n3
from ._jit import SERIAL, bits_as_f32


@numba.njit(**SERIAL)
def fill_x(X, xp, xs, q8, xd, zero):  # pragma: no cover - compiled
    """A product's shared input: int8 activations when ``q8`` has rows (``quantize_x``), else x
    regrouped by byte position (``split_x``)."""
    if q8.shape[0]:
        quantize_x(X, q8, xd, xs, zero)
    else:
        split_x(X, xp, xs, zero)


@numba.njit(**SERIAL)
def split_x(X, xp, xs, zero):  # pragma: no cover - compiled
    """Regroup X by a weight's position within its byte; xs[t, g] = zero·Σ of group g.

    Nibbles: 2 phases (even and odd features), crumbs: 4; xp[t, j, g, k] = X[t, 32g + P·k + j].
    """
    T, phases, gpr, per = xp.shape
    for t in range(T):
        for g in range(gpr):
            tot = np.float32(0)
            for k in range(per):
                for j in range(phases):
                    v = X[t, g * GROUP + phases * k + j]
                    xp[t, j, g, k] = v
                    tot += v
            xs[t, g] = tot * zero


@numba.njit(inline="always")
def group_scale(bits):  # pragma: no cover - compiled
    """(d, 1/d, special) of one group of 32 float32 values given as their uint32 bits: d =
    max|x|/127 (the abs max an integer max of the sign-cleared bits, which order as |x| for
    finite x: a loop LLVM vectorizes), 1/d (0 for d = 0), special when the group holds inf or
    NaN (d is then 0; the caller stores NaN). The int8 activations' rule, for every kernel."""
    top = np.uint32(0)
    special = False
    for j in range(GROUP):
        m = bits[j] & np.uint32(0x7FFFFFFF)
        top = max(top, m)
        special |= m >= np.uint32(0x7F800000)
    d = bits_as_f32(top) / np.float32(127) if not special else np.float32(0)
    inv = np.float32(1) / d if d > 0 else np.float32(0)
    return d, inv, special


@numba.njit(**SERIAL)
def quantize_x(X, q8, xd, xz, zero):  # pragma: no cover - compiled
    """int8 activations for the ``i8`` kernels, per group of 32: d = max|x|/127, q = rint(x/d)
    (ties to even; computed as x·(1/d) in float32, as ``reference.int8_activations`` does).

    ``q8[t, g, j, w, p, k]`` = piece j of weight P·(4w + k) + p of group g (P = 2 phases for
    nibbles, 4 for crumbs), so that word (j, w, p) read as int32 holds the four activations that
    meet the four codes of phase p in bytes 4w..4w+3; xd[t, g] = d, xz[t, K·g + j] = zero·Σ of
    piece j. With one piece (opt-in int8 activations) q = rint(x/d). With three (exact mode) the
    residual is split on: v = x·(1/d), q0 = rint(v), q1 = rint((v − q0)·128), q2 = rint(((v − q0)
    ·128 − q1)·128), every step after v exact in float32, so d·(q0 + q1/128 + q2/128²) is within
    d/2^15 of v·d, and of x within max|x|·3.6e-7 (with the roundings of 1/d and x·(1/d)).
    A group holding inf or NaN gets d = NaN, so its rows come out NaN as in the float32 kernels.

    One group per ``_ir.quantize_group_*`` (a single vector pass), scaled by :func:`group_scale`."""
    T, gpr, K, nw, P, _ = q8.shape
    bits = X.view(np.uint32)
    flat = q8.reshape(T, gpr * K * GROUP)
    sums = np.empty(3, np.int32)
    for t in range(T):
        xt = X[t]
        for g in range(gpr):
            d, inv, special = group_scale(bits[t, g * GROUP:(g + 1) * GROUP])
            at = g * K * GROUP
            if P == 2:
                if K == 3:
                    quantize_group_n3(xt, g * GROUP, inv, flat[t], at, sums)
                else:
                    quantize_group_n1(xt, g * GROUP, inv, flat[t], at, sums)
            elif K == 3:
                quantize_group_c3(xt, g * GROUP, inv, flat[t], at, sums)
            else:
                quantize_group_c1(xt, g * GROUP, inv, flat[t], at, sums)
            xd[t, g] = np.float32(np.nan) if special else d
            for j in range(K):
                xz[t, K * g + j] = zero * np.float32(sums[j])
