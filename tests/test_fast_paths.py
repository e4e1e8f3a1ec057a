"""The speed paths (issue 7) against the plain ones: prefill sgemm, grouped decode mat-vecs, the
vector exp, blocked and one-token attention, row-parallel norm and activation.

Each fast path has a plain counterpart that the HF parity tests already pin: the reference
LinearOps, ``ops.attention.attend``, ``ops.norm.rms_norm_prepared``, ``ops.activations``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

import cmf.quant as q
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.kernels import gemm, prepare
from cmf.kernels.gemv import ACTS, MatvecGroup
from cmf.kernels.reference import ReferenceLinear
from cmf.kernels.vmath import exp_f32, gated, tanh_f32
from cmf.runtime.ops import activations, attention_block, decode, rowwise
from cmf.runtime.ops.attention import attend
from cmf.runtime.ops.norm import rms_norm_prepared

from _builders import header

DTYPES = ["f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "q1", "q1s", "q1t"]
OPTS = {"q1s": {"keep": 0.02}, "q1t": {"keep": 0.02}}
# (rows, in): a tail past the 64-row tiles, exact tiles, rows not a multiple of four
SHAPES = {"a": (200, 96), "b": (128, 256), "c": (37, 64)}
TOL = 1e-5


def _close(got: np.ndarray, want: np.ndarray, tol: float = TOL) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, f"relative error {err:.2e}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast") / "m.cmf"
    rng = np.random.default_rng(0)
    with CmfWriter(path, header()) as w:
        for tag, shape in SHAPES.items():
            for k in range(3):
                m = (rng.standard_normal(shape) * 0.05).astype(np.float32)
                for name in DTYPES:
                    w.add(f"{name}.{tag}{k}", name, shape, q.encode(m, name, **OPTS.get(name, {})))
    f = cmf_open(path)
    yield f
    f.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tag", list(SHAPES))
@pytest.mark.parametrize("name", DTYPES)
def test_prefill_gemm_matches_reference(model, name, tag, threads) -> None:
    t = model.tensor(f"{name}.{tag}0")
    op = prepare(t)
    w = ReferenceLinear(t).dense().astype(np.float64)
    X = np.random.default_rng(1).standard_normal((37, t.shape[1])).astype(np.float32)
    old = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _close(gemm.matmul(op, X), X @ w.T)
        out = np.full((37, t.shape[0]), np.nan, np.float32)
        assert gemm.matmul(op, X, out) is out
        _close(out, X @ w.T)
    finally:
        numba.set_num_threads(old)
    assert gemm.supported(op)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("tag", list(SHAPES))
@pytest.mark.parametrize("name", DTYPES)
def test_matvec_groups_match_the_ops(model, name, tag, parallel, monkeypatch) -> None:
    from cmf.kernels import _jit

    if parallel:
        monkeypatch.setattr(_jit, "PARALLEL_MIN_BYTES", 0)
    ops = [prepare(model.tensor(f"{name}.{tag}{k}")) for k in range(3)]
    x = np.random.default_rng(2).standard_normal((1, ops[0].in_features)).astype(np.float32)
    want = np.concatenate([np.asarray(o(x[0]), np.float64) for o in ops])
    g = MatvecGroup(ops)
    assert (g.family is None) == (getattr(ops[0], "tiled", None) is not None)  # all but q1t on tiles: one region
    out = np.full((1, g.out_features), np.nan, np.float32)
    _close(g(x, out)[0], want)
    for act, fn in (("silu", activations.silu), ("gelu_pytorch_tanh", activations.gelu_tanh),
                    ("gelu", activations.gelu_erf), ("relu", activations.relu)):
        gu = MatvecGroup(ops[:2], act=act)
        buf = np.full((1, gu.out_features), np.nan, np.float32)
        gu(x, buf)
        g0, u0 = ops[0](x[0]).astype(np.float64), ops[1](x[0]).astype(np.float64)
        _close(buf[0, :gu.width], fn(g0) * u0, 1e-5)


@pytest.mark.parametrize("name", DTYPES)
def test_groups_of_one_to_three_matrices_share_one_specialization(model, name) -> None:
    """Padded to GROUP_SLOTS, a group of 1, 2 or 3 matrices calls the same compiled function with
    the same argument types (one compilation per family on a first run), and the padding slots
    write nothing."""
    from cmf.kernels.gemv import GROUP_SLOTS

    ops = [prepare(model.tensor(f"{name}.a{k}")) for k in range(3)]
    x = np.random.default_rng(6).standard_normal((1, ops[0].in_features)).astype(np.float32)
    kinds = set()
    for n in range(1, GROUP_SLOTS + 1):
        g = MatvecGroup(ops[:n])
        out = np.full((1, g.out_features), np.nan, np.float32)
        call = g.bind(x, out, 1)
        if call is None:  # q1t runs its tiles itself: no group function
            assert g.family is None
            return
        kinds.add((call[0], tuple(numba.typeof(a) for a in call[1])))
        call[0](*call[1])
        _close(out[0], np.concatenate([np.asarray(o(x[0]), np.float64) for o in ops[:n]]))
    assert len(kinds) == 1


@pytest.mark.parametrize("act", [None, "silu"])  # q/k/v-like (tiles split as one list) and gate/up
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("name", DTYPES)
def test_prebound_products_give_the_bound_calls_bits(model, name, int8, act, monkeypatch) -> None:
    """``bound.prebind`` (the token step's calls): the runner computes the call it replaces, bit
    for bit, on one thread and two (which agree: a thread's share of rows changes nothing),
    reading the caller's x as it is at each call and writing the caller's buffer; a call without
    a runner (or none) passes through."""
    from cmf.kernels import _jit
    from cmf.kernels.bound import KIND_OF, prebind, run_bound

    monkeypatch.setattr(_jit, "PARALLEL_MIN_BYTES", 0)
    ops = [prepare(model.tensor(f"{name}.a{k}"), int8_activations=int8) for k in range(3 if act is None else 2)]
    g = MatvecGroup(ops, act=act)
    assert prebind(None) is None
    x = np.empty((1, ops[0].in_features), np.float32)
    seen: dict = {}
    for nt in (1, 2):
        want = np.full((1, g.out_features), np.nan, np.float32)
        got = np.full((1, g.out_features), np.nan, np.float32)
        call = g.bind(x, want, nt)
        if call is None:  # q1t: no group function, nothing to bind
            assert g.family is None
            return
        fn, args = prebind(g.bind(x, got, nt))
        assert fn is run_bound and call[0] in KIND_OF and len(args) == 1
        assert type(numba.typeof(args[0])).driver is call[0]  # the constructor made the driver's kind
        for seed in (4, 5):  # x refilled in place: the bound arguments see it
            x[:] = np.random.default_rng(seed).standard_normal(x.shape)
            call[0](*call[1])
            fn(*args)
            assert np.array_equal(got, want), (nt, seed)
            assert not np.isnan(got).any()
            assert np.array_equal(seen.setdefault(seed, got.copy()), got), (nt, seed)
    other = (np.add, (1, 2))
    assert prebind(other) is other


def test_matvec_group_of_unhandled_family_falls_back(model) -> None:
    ops = [prepare(model.tensor(f"q1t.b{k}")) for k in range(2)]
    g = MatvecGroup(ops, act="silu")
    assert g.family is None
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    out = np.empty((1, g.out_features), np.float32)
    g0, u0 = (o(x[0]).astype(np.float64) for o in ops)
    _close(g(x, out)[0, :g.width], activations.silu(g0) * u0)


def test_mixed_family_group_falls_back(model) -> None:
    ops = [prepare(model.tensor("q8_row.b0")), prepare(model.tensor("f16.b1")), prepare(model.tensor("vbit.b2"))]
    g = MatvecGroup(ops)
    assert g.family is None
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    out = np.empty((1, g.out_features), np.float32)
    _close(g(x, out)[0], np.concatenate([o(x[0]) for o in ops]).astype(np.float64))
    with pytest.raises(ValueError):
        MatvecGroup(ops[:1], act="silu")


def test_vector_exp_and_activations() -> None:
    @numba.njit
    def run(x, e, t, s):
        for i in range(x.shape[0]):
            e[i] = exp_f32(x[i])
            t[i] = tanh_f32(x[i])
            s[i] = gated(x[i], np.float32(1), 0)

    x = np.concatenate([np.linspace(-87, 88, 400001, dtype=np.float32),
                        np.array([-1e4, 1e4, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)])
    e, t, s = (np.empty_like(x) for _ in range(3))
    run(x, e, t, s)
    ref = np.exp(x[:-7].astype(np.float64))
    assert (np.abs(e[:-7] - ref) / ref).max() < 4e-7
    assert e[-7] == 0 and e[-6] == np.inf and e[-5] == np.inf and e[-4] == 0 and np.isnan(e[-3]) and e[-2] == 1
    assert np.abs(t[:-7] - np.tanh(x[:-7].astype(np.float64))).max() < 3e-7
    assert np.abs(s[:-7] - activations.silu(x[:-7].astype(np.float64))).max() < 1e-6 * 88


def _qkv(t, s, h=8, kv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((t, h, d)).astype(np.float32), rng.standard_normal((s, kv, d)).astype(np.float32),
            rng.standard_normal((s, kv, d)).astype(np.float32))


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (40, 2.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_attention_matches_numpy(window, softcap, threads) -> None:
    old = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for t, s, q0, k0 in ((100, 100, 0, 0), (70, 130, 60, 0), (9, 30, 25, 4), (130, 130, 3, 3)):
            q, k, v = _qkv(t, s)
            want = attend(q, k, v, q0, k0, scale=0.25, window=window, softcap=softcap)
            got = attention_block.attend_blocked(q, k, v, q0, k0, scale=0.25, window=window, softcap=softcap)
            _close(got, want.astype(np.float64), 2e-6)
    finally:
        numba.set_num_threads(old)


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 3.0)])
def test_one_token_attention_matches_numpy(window, softcap, monkeypatch) -> None:
    for s, k0 in ((1, 0), (50, 0), (20, 31)):
        q, k, v = _qkv(1, s, seed=s)
        pos = k0 + s - 1
        want = attend(q, k, v, pos, k0, scale=0.25, window=window, softcap=softcap)[0]
        for par in (False, True):
            monkeypatch.setattr(decode, "PARALLEL_ATTEND", 0 if par else 1 << 62)
            got = decode.attend_decode(q[0], k, v, pos, k0, 0.25, window, softcap, np.empty((8, 16), np.float32))
            _close(got, want.astype(np.float64), 2e-6)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (6, 2.0)])
def test_short_blocks_attend_row_by_row_as_the_token_step(window, softcap) -> None:
    """Blocks of 2-7 queries (a speculative draft, an MTP step) run the one-token kernel per row:
    each row is bit for bit what the token step computes at its position, and within 2e-6 of
    numpy's batched form."""
    from cmf.runtime.blocks import BLOCKED_ATTENTION_T, attend_rows

    for t, s, q0, k0 in ((1, 9, 8, 0), (2, 12, 10, 0), (5, 30, 28, 3), (BLOCKED_ATTENTION_T - 1, 20, 13, 0)):
        q, k, v = _qkv(t, s, seed=t)
        got = attend_rows(q, k, v, q0, k0, 0.25, window, softcap)
        want = attend(q, k, v, q0, k0, scale=0.25, window=window, softcap=softcap)
        _close(got, want.astype(np.float64), 2e-6)
        for r in range(t):  # the token step at position q0 + r sees the cache up to it
            n = q0 + r - k0 + 1
            one = decode.attend_decode(q[r], k[:n], v[:n], q0 + r, k0, 0.25, window, softcap,
                                       np.empty((8, 16), np.float32))
            assert np.array_equal(one, got[r])


def test_row_kernels_match_numpy() -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((300, 256)) * 3).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    want = rms_norm_prepared(x, w, 1e-6)
    got = rowwise.rms_norm_rows(x, w, 1e-6)
    assert np.array_equal(got, want)
    assert np.array_equal(rowwise.rms_norm_rows(x, None, 1e-6), rms_norm_prepared(x, None, 1e-6))
    one = np.empty((1, 256), np.float32)
    decode.rms_norm_into(x[:1], w, 1e-6, one)
    assert np.array_equal(one, got[:1])
    g, u = x, (rng.standard_normal((300, 256))).astype(np.float32)
    for name, code in ACTS.items():
        fn = activations.ACTIVATIONS[name]
        _close(rowwise.gated_act(g, u, code), fn(g.astype(np.float64)) * u, 2e-6)
    # in place (the prefill FFN's memory): over g itself, the same values; a read-only or strided
    # g gets a new array and is left unchanged
    want = rowwise.gated_act(g, u, ACTS["silu"])
    g2 = g.copy()
    got = rowwise.gated_act(g2, u, ACTS["silu"], in_place=True)
    assert got is g2 and np.array_equal(got, want)
    frozen = g.copy()
    frozen.flags.writeable = False
    for src in (frozen, g.copy()[:, ::2]):
        before = src.copy()
        got = rowwise.gated_act(src, u[:, :src.shape[1]], ACTS["silu"], in_place=True)
        assert got is not src and np.array_equal(src, before)
        assert np.array_equal(got, rowwise.gated_act(np.ascontiguousarray(src), u[:, :src.shape[1]], ACTS["silu"]))


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 128, 129, 200, 896, 2048, 2049, 5120, 16391])
def test_rms_norm_kernel_is_numpy_to_the_bit(n: int) -> None:
    """The one RMSNorm kernel adds the float64 squares in numpy's pairwise order (blocks of 128,
    splits at multiples of 8), so it equals the numpy reference bit for bit at every width: the
    runtime's norms (any T, final norm, MLA latents, MTP) need no second implementation."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((64, n)) * rng.standard_exponential((64, 1)) * 20).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    want = rms_norm_prepared(x, w, 1e-6)
    assert np.array_equal(rowwise.rms_norm_rows(x, w, 1e-6), want)
    one = np.empty((1, n), np.float32)
    decode.rms_norm_into(x[3:4], w, 1e-6, one)
    assert np.array_equal(one, want[3:4])
    par = np.empty_like(x)  # a batch's rows over the threads (the batched step's norms)
    assert np.array_equal(decode.norm_into(x, w, 1e-6, par), want) and x.shape[0] >= decode.PARALLEL_NORM_ROWS
    wide = np.repeat(x, 2, axis=1)[:, ::2]  # rows that are not contiguous: the scalar leaf
    strided = np.empty_like(x)
    decode.rms_norm_into(wide, w, 1e-6, strided)
    assert not wide.flags.c_contiguous and np.array_equal(strided, want)
    heads = x.reshape(-1, n)  # per-head norms run in place (qk_norm_rope)
    decode.rms_norm_into(heads, w, 1e-6, heads)
    assert np.array_equal(heads, want)


def test_qk_norm_rope_matches_numpy() -> None:
    from cmf.runtime.ops.rope import apply_rope, build_rope

    rope = build_rope(10000.0, 16, partial=0.5)
    cos, sin = rope.cos_sin(np.array([37]))
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((2, 16)).astype(np.float32)
    qn, kn = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    wq = apply_rope(rms_norm_prepared(q, qn, 1e-6)[None].copy(), cos, sin)[0]
    wk = apply_rope(rms_norm_prepared(k, kn, 1e-6)[None].copy(), cos, sin)[0]
    decode.qk_norm_rope(q, k, qn, kn, 1e-6, np.ascontiguousarray(cos[0]), np.ascontiguousarray(sin[0]))
    _close(q, wq.astype(np.float64), 1e-6)
    _close(k, wk.astype(np.float64), 1e-6)
    assert math.isfinite(float(q.sum()))


def test_rope_rows_is_apply_rope_to_the_bit() -> None:
    """Blocks of tokens (MLA) rotate with the decode step's RoPE kernel: the same bits as numpy's."""
    from cmf.runtime.ops.rope import apply_rope, build_rope

    rng = np.random.default_rng(6)
    for dim, partial, t, heads in ((64, 1.0, 37, 4), (16, 0.5, 5, 1), (32, 1.0, 1, 8)):
        rope = build_rope(10000.0, dim, partial=partial)
        cos, sin = rope.cos_sin(np.arange(100, 100 + t))
        x = (rng.standard_normal((t, heads, dim)) * 5).astype(np.float32)
        want = apply_rope(x.copy(), cos, sin)
        got = rowwise.rope_rows(x.copy(), cos, sin)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_packed_4bit_sources_are_released_and_refault_correctly(tmp_path) -> None:
    from cmf.runtime.memory import PackedSourceReleaser

    rng = np.random.default_rng(6)
    m = (rng.standard_normal((200, 2048)) * 0.05).astype(np.float32)  # 3 whole tiles + 8 tail rows
    path = tmp_path / "q4.cmf"
    with CmfWriter(path, header()) as w:
        for name in ("q4tp", "q4_block", "q4_tiled", "q1t"):
            w.add(name, name, m.shape, q.encode(m, name))
    with cmf_open(path) as f:
        rel = PackedSourceReleaser(f)
        x = rng.standard_normal((1, 2048)).astype(np.float32)
        for name in ("q4tp", "q4_block", "q4_tiled", "q1t"):  # q1t: the tiles inside its Q1Linear
            op = prepare(f.tensor(name))
            before = op(x[0]).copy()
            got = rel.release([op])
            assert got > 0 and rel.release([op]) == 0  # each tile once
            assert np.array_equal(op(x[0]), before)  # tail rows re-read their (refaulted) bytes
            _close(op.dense()[:5] @ x[0], before[:5].astype(np.float64))


def test_rope_append_attend_matches_the_separate_calls() -> None:
    """The decode step's fused call = q/k norm + RoPE, the cache write at entry n, attention."""
    from cmf.runtime.cache import LayerKV
    from cmf.runtime.ops.rope import build_rope

    rope = build_rope(10000.0, 16)
    rng = np.random.default_rng(7)
    qn, kn = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    kv = LayerKV(2, 16)
    ref_k, ref_v = [], []
    for pos in range(70):  # past the cache's first capacity (64): reserve() grows it
        q = rng.standard_normal((8, 16)).astype(np.float32)
        k = rng.standard_normal((2, 16)).astype(np.float32)
        v = rng.standard_normal((2, 16)).astype(np.float32)
        cos, sin = (np.ascontiguousarray(a[0]) for a in rope.cos_sin(np.array([pos])))
        wq, wk = q.copy(), k.copy()
        decode.qk_norm_rope(wq, wk, qn, kn, 1e-6, cos, sin)
        ref_k.append(wk)
        ref_v.append(v.copy())
        want = attend(wq[None], np.stack(ref_k), np.stack(ref_v), pos, 0, scale=0.25)[0]
        n = kv.reserve(1)
        assert n == pos
        out = np.empty((8, 16), np.float32)
        decode.rope_append_attend(q, k, v, qn, kn, 1e-6, cos, sin, kv.k, kv.v, n, pos, 0, 0.25, 0, 0.0, out, True)
        kv.n = n + 1
        assert np.array_equal(q, wq) and np.array_equal(kv.k[n], wk) and np.array_equal(kv.v[n], v)
        _close(out, want.astype(np.float64), 2e-6)
    assert np.array_equal(kv.k[:70], np.stack(ref_k))  # the growth kept every earlier entry


def test_tiles_are_word_interleaved(model) -> None:
    """The repacked 4-bit layout the integer kernels load directly: planes[t, g, w, i, b] is byte
    4w + b of row 64t + i's group g (q4_tiled records: [f16 scale][16 B of nibbles])."""
    op = prepare(model.tensor("q4_tiled.b0"))
    op(np.ones(256, np.float32))  # packs every tile
    rows, gpr = 128, 256 // 32
    rec = np.frombuffer(model.tensor("q4_tiled.b0").numpy(), np.uint8).reshape(rows, gpr, 18)
    want = rec[:, :, 2:].reshape(2, 64, gpr, 4, 4).transpose(0, 2, 3, 1, 4)  # [t, g, w, i, b]
    assert op.planes.shape == (2, gpr, 4, 64, 4)
    assert np.array_equal(op.planes, want)


@pytest.mark.parametrize("name", DTYPES)
def test_bound_group_call_is_the_group_call(model, name) -> None:
    ops = [prepare(model.tensor(f"{name}.b{k}")) for k in range(3)]
    g = MatvecGroup(ops)
    x = np.random.default_rng(8).standard_normal((1, 256)).astype(np.float32)
    want = g(x, np.empty((1, g.out_features), np.float32), 2).copy()
    out = np.full((1, g.out_features), np.nan, np.float32)
    call = g.bind(x, out, 2)
    if g.family is None:  # one product after another: no single call to bind
        assert call is None
        return
    call[0](*call[1])
    assert np.array_equal(out, want)
    if g.family.startswith("tiled"):
        wide = np.zeros((1, 512), np.float32)
        assert g.bind(wide[:, ::2], out, 2) is None  # the int8 preparation needs unit stride


@pytest.mark.parametrize("name", ["vbit", "vbit_ro"])
def test_vbit_row_lookup_is_the_codecs_rows(name) -> None:
    """VbitLinear decodes embedding rows itself (not through the validating codec per token)."""
    import types

    w = np.random.default_rng(9).standard_normal((70, 128)).astype(np.float32)
    buf = np.frombuffer(q.encode(w, name), np.uint8)
    op = prepare(types.SimpleNamespace(numpy=lambda: buf, dtype=q.resolve_dtype(name), shape=w.shape, name=name,
                                       nbytes=buf.size))
    rows = np.array([0, 69, 5, 5, 33])
    assert type(op).__name__ == "VbitLinear"
    assert np.array_equal(op.dequant_rows(rows), q.decode_rows(buf, name, w.shape, rows))
    assert np.array_equal(op.dequant_row(7), q.decode_rows(buf, name, w.shape, [7]))


@pytest.mark.parametrize("name", ["f32", "f16", "q8_row", "q4tp", "q2tp", "vbit", "q1t"])
def test_one_row_lookup_equals_the_rows_lookup(model, name) -> None:
    from cmf.format.errors import BoundsError

    op = prepare(model.tensor(f"{name}.a0"))
    if not hasattr(op, "dequant_row"):
        pytest.skip("reference op")
    for r in (0, 77, 199):
        got = op.dequant_row(r)
        assert got.shape == (1, 96) and got.flags.c_contiguous
        assert np.array_equal(got, op.dequant_rows(np.array([r])))
    for bad in (-1, 200):
        with pytest.raises(BoundsError, match="outside 0..199"):
            op.dequant_row(bad)


def test_add_norm_into_is_the_add_then_the_norm() -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    a = rng.standard_normal((1, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    want_x = x + a
    want = np.empty_like(x)
    decode.rms_norm_into(want_x, w, 1e-6, want)
    got = np.empty_like(x)
    decode.add_norm_into(x, a, w, 1e-6, got)
    assert np.array_equal(x, want_x) and np.array_equal(got, want)
    decode.add_into(x, a)
    assert np.array_equal(x, want_x + a)
    for rows in (3, decode.PARALLEL_NORM_ROWS + 5):  # one call, and the add then the split norm
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        a = rng.standard_normal((rows, 96)).astype(np.float32)
        want_x = x + a
        want = decode.norm_into(want_x, w, 1e-6, np.empty_like(x))
        got = decode.add_norm(x, a, w, 1e-6, np.empty_like(x))
        assert np.array_equal(x, want_x) and np.array_equal(got, want)


def test_a_product_from_128_kb_runs_on_both_threads(tmp_path) -> None:
    """A product of at least ``PARALLEL_MIN_BYTES`` (128 KB) binds the parallel driver with two
    threads, a smaller one the serial body: SmolLM2-135M's q4tp o-projection (576×576, 173 KB)
    ran on one thread at the old 256 KB (docs/PERFORMANCE.md, "Small products on two threads"),
    and the bits are the serial body's either way."""
    from cmf.kernels import _jit
    from cmf.kernels.gemv import tiled_group, tiled_group_serial

    assert _jit.PARALLEL_MIN_BYTES == 1 << 17
    rng = np.random.default_rng(5)
    path = tmp_path / "o.cmf"
    with CmfWriter(path, header()) as w:
        for name, shape in (("o", (576, 576)), ("small", (128, 576))):
            m = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            w.add(name, "q4tp", shape, q.encode(m, "q4tp"))
    with cmf_open(path) as f:
        x = rng.standard_normal((1, 576)).astype(np.float32)
        for name, want in (("o", tiled_group), ("small", tiled_group_serial)):
            g = MatvecGroup([prepare(f.tensor(name))])
            assert (g.work >= 1 << 17) == (name == "o") and (g.work < 1 << 18)
            out2, out1 = np.empty((1, g.out_features), np.float32), np.empty((1, g.out_features), np.float32)
            fn, _ = g.bind(x, out2, 2)
            assert fn is want
            g(x, out1, 1)
            old = numba.get_num_threads()
            numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
            try:
                g(x, out2, 2)
            finally:
                numba.set_num_threads(old)
            assert np.array_equal(out1, out2)
