"""u8 × s8 integer dot products in LLVM IR, one form per CPU family, all giving the same sums.

The 4-bit tile kernels (``_ir.tile_dot_i8*``: q4_block/q4_tiled, q4tp, q2tp, q1t) multiply 16
rows' code words (one row per 32-bit lane, four unsigned codes of ≤ 4 bits in its bytes) by four
int8 activations broadcast to every lane, for the eight (word, phase) pairs of a 32-weight group,
and want per lane Σ of the 32 byte products as int32. :func:`group_dot` emits that sum as:

- ``vnni512``: eight chained ``vpdpbusd`` on 512-bit vectors (AVX-512 VNNI);
- ``avxvnni``: the same on two 256-bit halves (AVX-VNNI, or AVX-512 VNNI with VL);
- ``avx2``: per 256-bit half, ``vpmaddubsw`` (u8·s8, byte pairs summed into int16) of each pair,
  the eight int16 results added, then one ``vpmaddwd`` by ones (int16 pairs into int32). No
  saturation or wrap-around: a byte pair is at most 2·15·128 = 3840 and eight of them 30720
  < 2^15, for any int8 activation and 4-bit (or smaller) codes;
- ``portable``: generic IR (bytes widened to int16, multiplied and added in int16 — at most
  8·15·128 per lane — then widened and summed in pairs), which LLVM vectorizes for any target
  (NEON on aarch64).

Integer sums are exact in every form, so the four are bit for bit interchangeable
(tests/test_kernels_avx2.py compares each path the CPU can run against the others and a numpy
oracle). The path is chosen from the features of the CPU numba compiles for
(``numba_prims.target_has``), or forced with ``CMF_DOT_PATH`` (``CMF_NO_VNNI=1`` = portable);
a forced path the target lacks falls back to the automatic choice.
"""

from __future__ import annotations

import logging
import os

from llvmlite import ir
from numba.core import cgutils

from ..numba_prims import target_has

log = logging.getLogger(__name__)

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
PATHS = ("vnni512", "avxvnni", "avx2", "portable")


def path_supported(path: str) -> bool:
    """Whether the CPU numba compiles for can run ``path``."""
    if path == "vnni512":
        return target_has("avx512vnni", "avx512bw")
    if path == "avxvnni":  # the VEX form, or the EVEX one through AVX-512 VL
        return target_has("avxvnni") or target_has("avx512vnni", "avx512vl")
    if path == "avx2":
        return target_has("avx2")
    return path == "portable"


def choose_path() -> str:
    """``CMF_DOT_PATH`` when set and supported, else the fastest path the target has."""
    forced = os.environ.get("CMF_DOT_PATH", "").strip().lower() or ("portable" if os.environ.get("CMF_NO_VNNI") else "")
    if forced:
        if forced in PATHS and path_supported(forced):
            return forced
        log.warning("CMF_DOT_PATH=%s is not available on this target; choosing automatically", forced)
    return next(p for p in PATHS if path_supported(p))


DOT_PATH = choose_path()


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _half(builder: ir.IRBuilder, v: ir.Value, h: int) -> ir.Value:
    """Lanes 8h .. 8h + 7 of a <16 x i32>."""
    idx = ir.Constant(ir.VectorType(_I32, 8), list(range(8 * h, 8 * h + 8)))
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), idx)


def _join(builder: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 16), list(range(16))))


def _splat_i32(builder: ir.IRBuilder, x: ir.Value, n: int) -> ir.Value:
    ty = ir.VectorType(_I32, n)
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ty, [0] * n))


def group_dots(builder: ir.IRBuilder, codes: list, xs: list, path: str | None = None) -> list:
    """:func:`group_dot` of the same ``codes`` against each piece's activations ``xs[j]``.

    On the 256-bit paths each code pair is multiplied for both halves against one broadcast x
    before the next: an x load serves 16 rows, and the sums are two per piece (AVX2: int16, six
    for the three pieces, all in the 16 ymm registers; AVX-VNNI: two ``vpdpbusd`` chains). The
    512-bit order, all codes live across the pieces, spilled on AVX2 (353 stack moves in the
    three-piece tile against ~70), and one half after the other left each x serving 8 rows.
    The integers are the same in every order."""
    path = path or DOT_PATH
    v8 = ir.VectorType(_I32, 8)
    if path == "avxvnni":
        acc = [[ir.Constant(v8, [0] * 8)] * 2 for _ in xs]
        for k in range(len(codes)):
            for j, x in enumerate(xs):
                b = _splat_i32(builder, x[k], 8)
                for h in range(2):
                    acc[j][h] = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                                      [acc[j][h], _half(builder, codes[k], h), b])
        return [_join(builder, *aj) for aj in acc]
    if path != "avx2":
        return [group_dot(builder, list(zip(codes, x)), path) for x in xs]
    b32, w16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    ones = ir.Constant(w16, [1] * 16)
    parts = [[builder.bitcast(_half(builder, c, h), b32) for c in codes] for h in range(2)]
    s16 = [[None, None] for _ in xs]
    for k in range(len(codes)):
        for j, x in enumerate(xs):
            b = builder.bitcast(_splat_i32(builder, x[k], 8), b32)
            for h in range(2):
                p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [parts[h][k], b])
                s16[j][h] = p if s16[j][h] is None else builder.add(s16[j][h], p)
    return [_join(builder, *[_call(builder, "llvm.x86.avx2.pmadd.wd", v8, [sj[h], ones]) for h in range(2)])
            for sj in s16]


def signed_dots_avx2(builder: ir.IRBuilder, codes: list, xs: list) -> list:
    """s8 × s8 sums on AVX2: per lane of ``codes[w]`` (<16 x i32> of *signed* bytes q), and for
    each vector v, Σ_w Σ_bytes q·x over the words ``xs[v][w]`` (i32 of four int8 activations).

    Per 256-bit half ``vpmaddubsw(|q|, sign(q)·x)`` — the weight's magnitude as the unsigned
    operand (128 for q = −128), x carrying the weight's sign (``vpsignb``; |x| ≤ 127, so no
    overflow) — then ``vpmaddwd`` by ones and an int32 add per word. A byte pair is at most
    2·128·127 = 32512 < 2^15: no saturation, the exact sums. |q| is formed once per code half and
    serves every vector. Returns sums[v] (<16 x i32>)."""
    b32, w16, v8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    ones = ir.Constant(w16, [1] * 16)
    absb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(b32, [b32, ir.IntType(1)]), "llvm.abs.v32i8")
    q = [[builder.bitcast(_half(builder, c, h), b32) for c in codes] for h in range(2)]
    mag = [[builder.call(absb, [qw, ir.Constant(ir.IntType(1), 0)]) for qw in qh] for qh in q]
    out = []
    for xv in xs:
        halves = []
        for h in range(2):
            acc = None
            for w, x in enumerate(xv):
                xb = builder.bitcast(_splat_i32(builder, x, 8), b32)
                sx = _call(builder, "llvm.x86.avx2.psign.b", b32, [xb, q[h][w]])
                wide = _call(builder, "llvm.x86.avx2.pmadd.wd", v8,
                             [_call(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [mag[h][w], sx]), ones])
                acc = wide if acc is None else builder.add(acc, wide)
            halves.append(acc)
        out.append(_join(builder, *halves))
    return out


def vnni512_acc(builder: ir.IRBuilder, acc: ir.Value, codes: ir.Value, xs: ir.Value) -> ir.Value:
    """acc + one 512-bit ``vpdpbusd`` of ``codes`` by ``xs`` (four int8 activations already
    broadcast to every lane): for callers that interleave several accumulators themselves."""
    return _call(builder, "llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, codes, xs])


def group_dot(builder: ir.IRBuilder, pairs: list, path: str | None = None) -> ir.Value:
    """<16 x i32>: lane l = Σ over (codes, x) in ``pairs`` of Σ_k u8(codes.byte[4l+k])·s8(x.byte[k]).

    ``codes``: <16 x i32> whose bytes are unsigned codes ≤ 15; ``x``: an i32 holding four int8
    activations (the same for every lane). At most 8 pairs (the int16 bound of the avx2 form)."""
    path = path or DOT_PATH
    if len(pairs) > 8:
        raise ValueError("group_dot takes at most 8 (codes, x) pairs")
    v16, v8 = ir.VectorType(_I32, 16), ir.VectorType(_I32, 8)
    if path == "vnni512":
        acc = ir.Constant(v16, [0] * 16)
        for codes, x in pairs:
            acc = _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [acc, codes, _splat_i32(builder, x, 16)])
        return acc
    if path == "avxvnni":
        halves = []
        for h in range(2):
            acc = ir.Constant(v8, [0] * 8)
            for codes, x in pairs:
                acc = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                            [acc, _half(builder, codes, h), _splat_i32(builder, x, 8)])
            halves.append(acc)
        return _join(builder, *halves)
    if path == "avx2":
        b32, w16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
        ones = ir.Constant(w16, [1] * 16)
        halves = []
        for h in range(2):
            s16 = None
            for codes, x in pairs:
                a = builder.bitcast(_half(builder, codes, h), b32)
                b = builder.bitcast(_splat_i32(builder, x, 8), b32)
                p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [a, b])
                s16 = p if s16 is None else builder.add(s16, p)
            halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", v8, [s16, ones]))
        return _join(builder, *halves)
    # portable: products and their sum per byte lane in int16, then each lane's four bytes added
    b64, w64, d64 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 64), ir.VectorType(_I32, 64)
    s16 = None
    for codes, x in pairs:
        c = builder.zext(builder.bitcast(codes, b64), w64)
        xb = builder.sext(builder.bitcast(_splat_i32(builder, x, 16), b64), w64)
        p = builder.mul(c, xb)
        s16 = p if s16 is None else builder.add(s16, p)
    tot = builder.sext(s16, d64)
    undef = ir.Constant(d64, ir.Undefined)
    for n in (32, 16):  # add lanes pairwise twice: lane l sums bytes 4l..4l+3
        even = builder.shuffle_vector(tot, undef, ir.Constant(ir.VectorType(_I32, n), list(range(0, 2 * n, 2))))
        odd = builder.shuffle_vector(tot, undef, ir.Constant(ir.VectorType(_I32, n), list(range(1, 2 * n, 2))))
        tot, undef = builder.add(even, odd), ir.Constant(ir.VectorType(_I32, n), ir.Undefined)
    return tot


__all__ = ["DOT_PATH", "PATHS", "choose_path", "group_dot", "group_dots", "path_supported", "signed_dots_avx2",
           "vnni512_acc"]
