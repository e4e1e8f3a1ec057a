"""One query's attention arithmetic in LLVM IR: the q·k scores of a range of cache entries and
the probability-weighted sum of their values, with explicit float vectors of the target's width.

Why not numba loops: a score is a 64–256-element dot product, and the position-major loop that
streams the cache in address order reduced every (position, head) product to a scalar on its own
— a horizontal sum per score, plus a store of the whole output row per (position, head) in the
value pass: ~80–88 ns per cached position for SmolLM2-135M's 9 heads of 64. Here (42–55 ns):

- :data:`head_dots`: blocks of ``L`` positions (``L`` = 16 lanes with AVX-512, else 8), every
  head inside a block, so the block's key rows stay in L1 while the heads read them; per head,
  ``L`` vector accumulators each take one position's element-wise products chunk by chunk, and
  one transposing reduction (``L − 1`` adds, ``2(L − 1)`` shuffles) gives the ``L`` scores as one
  vector; a vector pass then finds each head's maximum.
- ``weigh_rows{1,2,4}``: blocks of :data:`WEIGH_BLOCK` positions, every head inside; ``U`` chunks
  of a head's output row stay in registers over the block's positions (even and odd positions in
  two sets), added to the row once.
- Each block prefetches the next one's rows; :func:`prefetch_rows` asks for a first block early.

Keys and values are float32 or f16 bits (uint16, widened in registers). The arrays' strides are
read from their descriptors: only each cache row's elements must be contiguous and a multiple of
the lane width long, which the callers check (``decode._vector_rows``). The lane width follows
the CPU numba compiles for. Multiply-adds are ``llvm.fmuladd`` so that every caller of a body
rounds alike.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...numba_prims import L1, ir_prefetch, ir_splat, target_has

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
LANES = 16 if target_has("avx512f") else 8
WEIGH_CHUNKS = (4, 2, 1)
# f16 caches: the widest key/value row (floats) a kv head's rows are widened once per block for,
# in a stack buffer the group's query heads then read (wider rows: each head widens its own)
SCRATCH_DIM = 256  # weigh_rows variants: output chunks of LANES floats kept in registers


def _array(context, builder, ty, val):  # noqa: ANN001, ANN202
    """(byte pointer to the data, shape list, byte strides list) of an array argument."""
    a = context.make_array(ty)(context, builder, val)
    data = builder.bitcast(a.data, ir.IntType(8).as_pointer())
    return data, cgutils.unpack_tuple(builder, a.shape), cgutils.unpack_tuple(builder, a.strides)


def _at(builder, base, *terms):  # noqa: ANN001, ANN202
    """``base`` + Σ index·stride (bytes), terms as (index, stride) pairs of i64 values."""
    off = ir.Constant(_I64, 0)
    for i, s in terms:
        off = builder.add(off, builder.mul(i, s))
    return builder.gep(base, [off])


def _by_kv_head(builder, staged: bool, fits, kvh, group, direct, widen, head) -> None:  # noqa: ANN001
    """``direct()`` (every query head loads and widens its own cache rows) or, when ``staged``
    (an f16 cache) and ``fits`` holds at run time, per kv head h: ``widen(h)`` into the stack
    buffer, then ``head(j)`` for each query head j = h·group + g of its group."""
    if not staged:
        direct()
        return
    with builder.if_else(fits) as (then, otherwise):
        with then:
            with cgutils.for_range(builder, kvh) as hh:
                widen(hh.index)
                with cgutils.for_range(builder, group) as gg:
                    head(builder.add(builder.mul(hh.index, group), gg.index))
        with otherwise:
            direct()


def _scratch(builder, vf, floats: int):  # noqa: ANN001, ANN202
    """A byte pointer to ``floats`` float32 of stack space (vector-aligned, in the entry block)."""
    space = cgutils.alloca_once(builder, vf, size=ir.Constant(_I64, floats // vf.count))
    return builder.bitcast(space, ir.IntType(8).as_pointer())


def _floats_at(builder, base, index, ty):  # noqa: ANN001, ANN202
    """Pointer of type ``ty*`` to the float32 element ``index`` (an i64) after byte pointer ``base``."""
    return builder.bitcast(builder.gep(base, [builder.mul(index, ir.Constant(_I64, 4))]), ty.as_pointer())


def _prefetch_rows(builder, base, first, stop, stride, part=None):  # noqa: ANN001, ANN202
    """Prefetch (into L1) every cache line of rows [first, stop) at byte ``stride`` apart from
    ``base`` — the next block's rows while this block computes (rows are contiguous). ``part``
    (k, of): only the k-th of ``of`` equal shares of those lines, so that a block's heads ask
    for the next block a share each rather than all at once (a burst of ~100 requests at the
    block's start left most of a 16-sequence step's cache reads to wait on L3)."""
    c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
    start = builder.mul(first, stride)
    span = builder.sub(builder.mul(stop, stride), start)
    lines = builder.sdiv(builder.add(span, c64(63)), c64(64))
    lo, hi = c64(0), lines
    if part is not None:
        share = builder.sdiv(builder.add(lines, builder.sub(part[1], c64(1))), part[1])
        lo = builder.mul(part[0], share)
        hi = builder.add(lo, share)
        hi = builder.select(builder.icmp_signed("<", hi, lines), hi, lines)
    with cgutils.for_range_slice(builder, lo, hi, c64(1)) as (ln, _):
        ir_prefetch(builder, builder.gep(base, [builder.add(start, builder.mul(ln, c64(64)))]), L1)


def _load_row(builder, ptr, is_f16: bool, lanes: int):  # noqa: ANN001, ANN202
    """``lanes`` floats at a byte pointer: float32, or f16 bits widened (``vcvtph2ps``)."""
    if is_f16:
        vh = ir.VectorType(_I16, lanes)
        raw = builder.load(builder.bitcast(ptr, vh.as_pointer()), align=2)
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(_F32, lanes))
    vf = ir.VectorType(_F32, lanes)
    return builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)


def _fmuladd(builder, a, b, c):  # noqa: ANN001, ANN202
    """a·b + c as ``llvm.fmuladd``: one fused multiply-add wherever the target has FMA, in every
    caller alike (a ``contract`` flag on an fmul/fadd pair left the choice to each call site's
    optimisation, and two call sites of one body rounded differently)."""
    ty = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]),
                                        f"llvm.fmuladd.v{ty.count}f32")
    return builder.call(fn, [a, b, c])


def transpose_sum(builder, vecs: list):  # noqa: ANN001, ANN201
    """One vector whose lane t is the sum of ``vecs[t]``'s lanes (len(vecs) == lanes, a power
    of two): pairs are merged level by level, each output block summing the two halves of one
    input block, so lanes stay in order and the sums take ``lanes − 1`` vector adds."""
    lanes = vecs[0].type.count
    cur, width = list(vecs), lanes
    while len(cur) > 1:
        half, blocks = width // 2, lanes // width
        lo, hi = [], []
        for k in range(2 * blocks):
            base = (k * width) if k < blocks else (lanes + (k - blocks) * width)
            lo += range(base, base + half)
            hi += range(base + half, base + width)
        mlo, mhi = (ir.Constant(ir.VectorType(_I32, lanes), m) for m in (lo, hi))
        cur = [builder.fadd(builder.shuffle_vector(a, b, mlo), builder.shuffle_vector(a, b, mhi))
               for a, b in zip(cur[0::2], cur[1::2])]
        width = half
    return cur[0]


def _make_head_dots(lanes: int):  # noqa: ANN202 - returns a numba intrinsic
    vf = ir.VectorType(_F32, lanes)
    vi = ir.VectorType(_I64, lanes)

    @intrinsic
    def head_dots(typingctx, q, keys, group, lo, n, scale, p, mx):  # noqa: ANN001
        """p[j, s] = scale·(q[j] · keys[lo + s, j // group]) for every head j and s < n, and
        mx[j] = max_s p[j, s] (−inf when n == 0). p's rows must hold n rounded up to LANES (the
        last block's spare lanes are written); q's row length must be a multiple of LANES.

        Blocks of LANES positions outside, heads inside: a block's cache rows (LANES × KV × D
        elements) stay in L1 while every head reads them, so each cache line comes from L2 or
        memory once (a head-outer loop read each line ``group`` times)."""
        is_f16 = keys.dtype == types.uint16
        sig = types.void(q, keys, types.int64, types.int64, types.int64, types.float32, p, mx)

        def codegen(context, builder, signature, args):
            qp, qsh, qst = _array(context, builder, signature.args[0], args[0])
            kp, _, kst = _array(context, builder, signature.args[1], args[1])
            pp, _, pst = _array(context, builder, signature.args[6], args[6])
            mp, _, mst = _array(context, builder, signature.args[7], args[7])
            group, lo, n, scale = args[2], args[3], args[4], args[5]
            one, nl = ir.Constant(_I64, 1), ir.Constant(_I64, lanes)
            esize = ir.Constant(_I64, 2 if is_f16 else 4)
            chunks = builder.sdiv(qsh[1], nl)
            last = builder.sub(n, one)
            blocks = builder.sdiv(builder.add(n, ir.Constant(_I64, lanes - 1)), nl)
            accs = [cgutils.alloca_once(builder, vf) for _ in range(lanes)]
            top = cgutils.alloca_once(builder, vf)
            sv = ir_splat(builder, scale, vf)
            ninf = ir.Constant(vf, [float("-inf")] * lanes)
            kbase = _at(builder, kp, (lo, kst[0]))
            first = builder.select(builder.icmp_signed("<", nl, n), nl, n)
            _prefetch_rows(builder, kbase, ir.Constant(_I64, 0), first, kst[0])  # block 0: its lines at once
            heads, kvh = qsh[0], builder.sdiv(qsh[0], group)
            # f16 keys of a kv head converted once per block into an L1 buffer, read there by the
            # group's query heads (a row per lane, SCRATCH_DIM floats apart): the exact float32
            # values the direct loads widen, so the same sums
            staged = is_f16
            buf = _scratch(builder, vf, lanes * SCRATCH_DIM) if staged else None
            fits = builder.and_(builder.icmp_signed("<=", qsh[1], ir.Constant(_I64, SCRATCH_DIM)),
                                builder.icmp_signed(">", group, ir.Constant(_I64, 1)))  # a group shares the rows
            with cgutils.for_range(builder, blocks) as blk:
                s0 = builder.mul(blk.index, nl)
                nxt = builder.add(s0, nl)
                stop = builder.add(nxt, nl)
                stop = builder.select(builder.icmp_signed("<", stop, n), stop, n)
                offs = []
                for t in range(lanes):  # spare lanes of the last block re-read its last row
                    s = builder.add(s0, ir.Constant(_I64, t))
                    s = builder.select(builder.icmp_signed("<", s, n), s, last)
                    offs.append(builder.mul(builder.add(lo, s), kst[0]))

                def one_head(j, key):  # noqa: ANN001, ANN202 - p[j, block] from key(t, c): lane t's chunk c
                    with builder.if_then(builder.icmp_signed("<", nxt, stop)):
                        _prefetch_rows(builder, kbase, nxt, stop, kst[0], (j, heads))
                    qrow = _at(builder, qp, (j, qst[0]))
                    for a in accs:
                        builder.store(ir.Constant(vf, [0.0] * lanes), a)
                    with cgutils.for_range(builder, chunks) as ch:
                        c = ch.index
                        qv = builder.load(_floats_at(builder, qrow, builder.mul(c, nl), vf), align=4)
                        for t in range(lanes):
                            builder.store(_fmuladd(builder, qv, key(t, c), builder.load(accs[t])), accs[t])
                    r = builder.fmul(transpose_sum(builder, [builder.load(a) for a in accs]), sv)
                    prow = _at(builder, pp, (j, pst[0]))
                    builder.store(r, _floats_at(builder, prow, s0, vf), align=4)

                def direct():  # noqa: ANN202 - every head loads (and widens) its keys itself
                    with cgutils.for_range(builder, heads) as hj:
                        krow = _at(builder, kp, (builder.sdiv(hj.index, group), kst[1]))
                        rows = [builder.gep(krow, [o]) for o in offs]
                        one_head(hj.index, lambda t, c: _load_row(
                            builder, builder.gep(rows[t], [builder.mul(c, builder.mul(esize, nl))]), is_f16, lanes))

                def widen(h):  # noqa: ANN001, ANN202 - the block's key rows of kv head h into the buffer
                    krow = _at(builder, kp, (h, kst[1]))
                    for t in range(lanes):
                        row = builder.gep(krow, [offs[t]])
                        with cgutils.for_range(builder, chunks) as ch:
                            v = _load_row(builder, builder.gep(row, [builder.mul(ch.index, builder.mul(esize, nl))]),
                                          True, lanes)
                            dst = _floats_at(builder, buf, builder.add(ir.Constant(_I64, t * SCRATCH_DIM),
                                                                        builder.mul(ch.index, nl)), vf)
                            builder.store(v, dst, align=4)

                _by_kv_head(builder, staged, fits, kvh, group, direct, widen, lambda j: one_head(j, lambda t, c: builder.load(
                    _floats_at(builder, buf, builder.add(ir.Constant(_I64, t * SCRATCH_DIM), builder.mul(c, nl)), vf),
                    align=4)))
            # the maxima: one vector pass over each row, the last block's spare lanes left out
            lane_ids = ir.Constant(vi, list(range(lanes)))
            with cgutils.for_range(builder, qsh[0]) as hj:
                j = hj.index
                prow = _at(builder, pp, (j, pst[0]))
                builder.store(ninf, top)
                with cgutils.for_range(builder, blocks) as blk:
                    s0 = builder.mul(blk.index, nl)
                    r = builder.load(_floats_at(builder, prow, s0, vf), align=4)
                    spots = builder.add(ir_splat(builder, s0, vi), lane_ids)
                    live = builder.icmp_signed("<", spots, ir_splat(builder, n, vi))
                    r = builder.select(live, r, ninf)
                    cur = builder.load(top)
                    builder.store(builder.select(builder.fcmp_ordered(">", r, cur), r, cur), top)
                v = builder.load(top)
                best = builder.extract_element(v, ir.Constant(_I32, 0))
                for t in range(1, lanes):
                    e = builder.extract_element(v, ir.Constant(_I32, t))
                    best = builder.select(builder.fcmp_ordered(">", e, best), e, best)
                dst = builder.bitcast(_at(builder, mp, (j, mst[0])), _F32.as_pointer())
                builder.store(best, dst)
            return context.get_dummy_value()

        return sig, codegen

    return head_dots


WEIGH_BLOCK = 32  # positions per block of weigh_rows: their value rows (32 × KV × D) stay in L1


def _make_weigh_rows(lanes: int, u: int):  # noqa: ANN202 - returns a numba intrinsic
    vf = ir.VectorType(_F32, lanes)

    @intrinsic
    def weigh_rows(typingctx, p, vals, group, lo, n, out):  # noqa: ANN001
        """out[j] = Σ_{s < n} p[j, s]·vals[lo + s, j // group] for every head j (out's row length
        a multiple of LANES·U). Blocks of WEIGH_BLOCK positions outside, heads inside (each value
        line read once from beyond L1); within a block, U chunks of a head's output row are
        accumulated in registers, even and odd positions apart (two independent multiply-add
        chains: one chain per position was latency-bound), and added to the row once."""
        is_f16 = vals.dtype == types.uint16
        sig = types.void(p, vals, types.int64, types.int64, types.int64, out)

        def codegen(context, builder, signature, args):
            pp, _, pst = _array(context, builder, signature.args[0], args[0])
            vp, _, vst = _array(context, builder, signature.args[1], args[1])
            op, osh, ost = _array(context, builder, signature.args[5], args[5])
            group, lo, n = args[2], args[3], args[4]
            esize = 2 if is_f16 else 4
            one, two = ir.Constant(_I64, 1), ir.Constant(_I64, 2)
            step = lanes * u
            sets = builder.sdiv(osh[1], ir.Constant(_I64, step))
            accs = [[cgutils.alloca_once(builder, vf) for _ in range(u)] for _ in range(2)]
            zv = ir.Constant(vf, [0.0] * lanes)
            nl = ir.Constant(_I64, lanes)
            with cgutils.for_range(builder, osh[0]) as hj:  # out = 0
                orow = _at(builder, op, (hj.index, ost[0]))
                with cgutils.for_range(builder, builder.sdiv(osh[1], nl)) as c:
                    builder.store(zv, _floats_at(builder, orow, builder.mul(c.index, nl), vf), align=4)
            vbase = _at(builder, vp, (lo, vst[0]))
            nb = ir.Constant(_I64, WEIGH_BLOCK)
            blocks = builder.sdiv(builder.add(n, ir.Constant(_I64, WEIGH_BLOCK - 1)), nb)
            heads, dv = osh[0], osh[1]
            kvh = builder.sdiv(heads, group)
            staged = is_f16  # as head_dots: a kv head's value rows widened once per block
            buf = _scratch(builder, vf, WEIGH_BLOCK * SCRATCH_DIM) if staged else None
            fits = builder.and_(builder.icmp_signed("<=", dv, ir.Constant(_I64, SCRATCH_DIM)),
                                builder.icmp_signed(">", group, ir.Constant(_I64, 1)))
            with cgutils.for_range(builder, blocks) as blk:
                s0 = builder.mul(blk.index, nb)
                s1 = builder.select(builder.icmp_signed("<", builder.add(s0, nb), n), builder.add(s0, nb), n)
                m = builder.sub(s1, s0)
                s2 = builder.select(builder.icmp_signed("<", builder.add(s1, nb), n), builder.add(s1, nb), n)

                def one_head(j, value):  # noqa: ANN001, ANN202 - value(s, off): position s's row at float off
                    with builder.if_then(builder.icmp_signed("<", s1, s2)):
                        _prefetch_rows(builder, vbase, s1, s2, vst[0], (j, heads))
                    prow = _at(builder, pp, (j, pst[0]))
                    orow = _at(builder, op, (j, ost[0]))
                    with cgutils.for_range(builder, sets) as cs:
                        c0 = builder.mul(cs.index, ir.Constant(_I64, step))

                        def position(s, acc):  # noqa: ANN001, ANN202 - acc[k] += p[j, s0 + s]·v[s0 + s, chunk k]
                            w = builder.load(_floats_at(builder, prow, builder.add(s0, s), _F32))
                            wv = ir_splat(builder, w, vf)
                            for k, a in enumerate(acc):
                                vv = value(j, s, builder.add(c0, ir.Constant(_I64, k * lanes)))
                                builder.store(_fmuladd(builder, wv, vv, builder.load(a)), a)

                        for a in accs[0] + accs[1]:
                            builder.store(zv, a)
                        with cgutils.for_range(builder, builder.sdiv(m, two)) as sl:
                            s = builder.mul(sl.index, two)
                            position(s, accs[0])
                            position(builder.add(s, one), accs[1])
                        with builder.if_then(builder.icmp_signed("==", builder.srem(m, two), one)):
                            position(builder.sub(m, one), accs[0])
                        for k in range(u):
                            dst = _floats_at(builder, orow, builder.add(c0, ir.Constant(_I64, k * lanes)), vf)
                            total = builder.fadd(builder.load(accs[0][k]), builder.load(accs[1][k]))
                            builder.store(builder.fadd(builder.load(dst, align=4), total), dst, align=4)

                def from_cache(j, s, off):  # noqa: ANN001, ANN202 - the value chunk, loaded (and widened) here
                    row = _at(builder, vp, (builder.add(lo, builder.add(s0, s)), vst[0]), (builder.sdiv(j, group), vst[1]))
                    return _load_row(builder, builder.gep(row, [builder.mul(off, ir.Constant(_I64, esize))]), is_f16, lanes)

                def direct():  # noqa: ANN202
                    with cgutils.for_range(builder, heads) as hj:
                        one_head(hj.index, from_cache)

                def widen(h):  # noqa: ANN001, ANN202 - the block's value rows of kv head h into the buffer
                    with cgutils.for_range(builder, m) as ss:
                        row = _at(builder, vp, (builder.add(lo, builder.add(s0, ss.index)), vst[0]), (h, vst[1]))
                        with cgutils.for_range(builder, builder.sdiv(dv, nl)) as ch:
                            off = builder.mul(ch.index, nl)
                            v = _load_row(builder, builder.gep(row, [builder.mul(off, ir.Constant(_I64, esize))]), True,
                                          lanes)
                            at = builder.add(builder.mul(ss.index, ir.Constant(_I64, SCRATCH_DIM)), off)
                            builder.store(v, _floats_at(builder, buf, at, vf), align=4)

                _by_kv_head(builder, staged, fits, kvh, group, direct, widen, lambda j: one_head(j, lambda j_, s, off: builder.load(
                    _floats_at(builder, buf, builder.add(builder.mul(s, ir.Constant(_I64, SCRATCH_DIM)), off), vf),
                    align=4)))
            return context.get_dummy_value()

        return sig, codegen

    return weigh_rows


@intrinsic
def prefetch_rows(typingctx, a, lo, n):  # noqa: ANN001
    """Prefetch rows [lo, lo + n) of ``a``'s first axis into L1 (rows contiguous): the value rows
    the weighing will read first, asked for before the softmax's exp pass."""
    sig = types.void(a, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ap, _, ast = _array(context, builder, signature.args[0], args[0])
        _prefetch_rows(builder, ap, args[1], builder.add(args[1], args[2]), ast[0])
        return context.get_dummy_value()

    return sig, codegen


head_dots = _make_head_dots(LANES)
weigh_rows4, weigh_rows2, weigh_rows1 = (_make_weigh_rows(LANES, u) for u in WEIGH_CHUNKS)
