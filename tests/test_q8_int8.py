"""q8 with int8 activations (kernels/q8i.py, q8i_ir.py): integer products over 32-row blocks.

Each (row, vector) value is ``s_r·Σ_g d_g·Σ_k q_k·x̂_k`` with exact integer group sums, so a
product equals the decoded matrix times ``reference.int8_activations(x)`` up to float32
summation order, is bit-identical whatever else is in the batch (one token, a decode batch, a
prefill block, a row-restricted product, a grouped product), and every integer path the CPU can
run (VNNI 512/256, AVX2's nibble split, portable IR) gives the same bits.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import cmf.quant as q
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.kernels import int_dot, prepare, q8i, q8i_ir
from cmf.kernels.gemv import MatvecGroup
from cmf.kernels.gemv_batch import BatchGroup
from cmf.kernels.reference import ReferenceLinear, int8_activations

from _builders import header

SHAPES = [(200, 320), (70, 100), (64, 1024)]  # partial last block; columns not whole groups; plain


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    rng = np.random.default_rng(8)
    path = tmp_path_factory.mktemp("q8i") / "m.cmf"
    with CmfWriter(path, header()) as wr:
        for rows, cols in SHAPES:
            for dt in ("q8_row", "q8_2f"):
                for k in range(2):
                    w = (rng.standard_normal((rows, cols)) * np.exp2(rng.normal(0, 1, (rows, 1))) * 0.05)
                    w = w.astype(np.float32)
                    w[3] = 0  # a zero row
                    wr.add(f"{dt}.{rows}x{cols}.{k}", dt, w.shape, q.encode(w, dt))
    f = cmf_open(path)
    yield f
    f.close()


def _names(f, dt: str) -> list[str]:
    return sorted(n for n in f.keys() if n.startswith(dt) and n.endswith(".0"))


def _inputs(cols: int) -> np.ndarray:
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    x[1, :32] = 0  # an all-zero group: d = 0
    x[2, min(40, cols - 1)] = 60.0  # an outlier dominating its group
    return x


def _want(f, name: str, x: np.ndarray) -> np.ndarray:
    w = ReferenceLinear(f.tensor(name)).dense().astype(np.float64)
    cols = w.shape[1]
    xp = np.zeros((x.shape[0], -(-cols // 32) * 32), np.float32)
    t = f.tensor(name)
    col = np.ones(cols, np.float32)
    if t.dtype.label == "q8_2f":  # the column field is folded into x before it is quantized
        raw = t.numpy()
        rows = w.shape[0]
        col = raw[rows * cols + 2 * rows:rows * cols + 2 * rows + 2 * cols].view("<f2").astype(np.float32)
        w = w / col.astype(np.float64)
    xp[:, :cols] = x * col
    return int8_activations(xp)[:, :cols].astype(np.float64) @ w.T


@pytest.mark.parametrize("dt", ["q8_row", "q8_2f"])
def test_products_match_the_int8_oracle_and_stay_near_exact(mats, dt: str) -> None:
    for name in _names(mats, dt):
        op = prepare(mats.tensor(name), int8_activations=True)
        assert op.int8 and op.fused_max_t > 512  # prefill blocks take the integer kernel too
        x = _inputs(op.in_features)
        got = op(x)
        want = _want(mats, name, x)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 2e-6 * scale, name
        exact = prepare(mats.tensor(name))(x)
        plain = [0, 1, 3, 4, 5]  # (row 2's planted outlier flattens its group: no bound there)
        err = np.abs(got[plain] - exact[plain]).max()
        assert err <= 2e-2 * np.abs(exact[plain]).max()  # the price of int8 activations
        assert np.array_equal(op(x[0]), got[0])  # one vector


@pytest.mark.parametrize("dt", ["q8_row", "q8_2f"])
def test_every_batch_size_and_row_selection_gives_the_same_bits(mats, dt: str) -> None:
    for name in _names(mats, dt):
        op = prepare(mats.tensor(name), int8_activations=True)
        X = np.random.default_rng(1).standard_normal((11, op.in_features)).astype(np.float32)
        full = op(X)
        for t in range(11):
            assert np.array_equal(op(X[t:t + 1])[0], full[t]), (name, t)
        for T in (2, 3, 5, 9):
            assert np.array_equal(op(X[:T]), full[:T])
        pick = np.array([op.out_features - 1, 0, 3, 35, 33, op.out_features // 2])
        assert np.array_equal(op.rows(pick, X[:3]), full[:3, pick])


def test_grouped_and_batched_products_equal_the_ops(mats) -> None:
    """MatvecGroup (one token) and BatchGroup (a decode batch) with the gated activation: the
    q8i group kernel, each row the op's own bits."""
    for name in _names(mats, "q8_row"):
        base = name.rsplit(".", 1)[0]
        ops = [prepare(mats.tensor(f"{base}.{k}"), int8_activations=True) for k in range(2)]
        X = np.random.default_rng(2).standard_normal((7, ops[0].in_features)).astype(np.float32)
        gate, up = ops[0](X), ops[1](X)
        silu = gate / (1 + np.exp(-gate.astype(np.float64)))
        for act in (None, "silu"):
            one = MatvecGroup(ops, act)
            assert one.kernel == "q8i"
            bg = BatchGroup(ops, act)
            Y = bg(X)
            for t in range(7):
                y = one(X[t:t + 1], np.empty((1, one.out_features), np.float32))[0]
                assert np.array_equal(y, Y[t])
            if act is None:
                assert np.array_equal(Y, np.concatenate([gate, up], 1))
            else:
                np.testing.assert_allclose(Y[:, :gate.shape[1]], silu * up, rtol=1e-5, atol=1e-6 * np.abs(up).max())


def test_non_finite_input_gives_nan_rows(mats) -> None:
    op = prepare(mats.tensor("q8_row.200x320.0"), int8_activations=True)
    x = _inputs(320)
    x[0, 5] = np.inf
    x[4, 300] = np.nan
    y = op(x)
    assert np.isnan(y[0]).all() and np.isnan(y[4]).all()
    assert np.isfinite(y[[1, 2, 3, 5]]).all()


def test_the_repacked_matrix_gives_its_mapped_rows_back(mats) -> None:
    """Once packed, products read only the blocks: the mapped q8 rows are released (as the 4-bit
    tiles' sources are), and a product after that is unchanged (row lookups fault them back)."""
    from cmf.runtime.memory import PackedSourceReleaser

    op = prepare(mats.tensor("q8_row.64x1024.0"), int8_activations=True)
    rel = PackedSourceReleaser(mats)
    assert rel.release([op]) == 0  # nothing packed yet
    x = _inputs(1024)
    before = op(x)
    assert rel.release([op]) > 0 and rel.release([op]) == 0  # once
    assert np.array_equal(op(x), before)
    assert np.array_equal(op.dequant_rows(np.array([5])), prepare(mats.tensor("q8_row.64x1024.0")).dequant_rows(
        np.array([5])))


def test_off_by_default(mats) -> None:
    op = prepare(mats.tensor("q8_row.200x320.0"))
    assert not op.int8 and op.group_family == "rows:q8"
    assert op._blocks is None  # nothing repacked


_RUNNERS: dict = {}


def _runner(path: str, nv: int):  # noqa: ANN202 - a compiled function
    if (path, nv) not in _RUNNERS:
        k = q8i_ir.kernels_for(path)[nv - 1]

        @numba.njit
        def run(planes, xv, xc, d, gpr, out):  # pragma: no cover - compiled
            k(planes, 0, xv, 0, gpr * 8, xc, d, 0, gpr, out, 0)

        _RUNNERS[path, nv] = run
    return _RUNNERS[path, nv]


@pytest.mark.parametrize("path", [p for p in int_dot.PATHS if int_dot.path_supported(p)])
def test_every_runnable_integer_path_gives_the_oracles_bits(path: str) -> None:
    """Extreme codes (−128, 127) and activations included: the integer sums are exact, so each
    path's floats equal a float64 oracle's rounding of the same sequence of multiply-adds."""
    rng = np.random.default_rng(3)
    gpr = 5
    for trial in range(4):
        q8 = rng.integers(-128, 128, (32, gpr * 32)).astype(np.int8)
        x8 = rng.integers(-127, 128, (4, gpr * 32)).astype(np.int8)
        if trial == 0:
            q8[:] = -128
            x8[:] = np.where(rng.random(x8.shape) < 0.5, -127, 127)
        d = rng.random((4, gpr)).astype(np.float32)
        xc = (128 * x8.reshape(4, gpr, 32).astype(np.int32).sum(-1)).astype(np.int32)
        planes = q8i.pack(q8, 1)
        isum = np.einsum("rgk,tgk->trg", q8.reshape(32, gpr, 32).astype(np.int64),
                         x8.reshape(4, gpr, 32).astype(np.int64))
        want = np.zeros((4, 32), np.float32)
        for g in range(gpr):  # fma in float32: exact product, one rounding
            want = (isum[:, :, g].astype(np.float32).astype(np.float64) * d[:, g:g + 1]
                    + want.astype(np.float64)).astype(np.float32)
        for nv in (1, 2, 3, 4):
            out = np.zeros(4 * 32, np.float32)
            _runner(path, nv)(planes, x8.reshape(-1).view(np.int32), xc.reshape(-1), d.reshape(-1), gpr, out)
            assert np.array_equal(out.reshape(4, 32)[:nv], want[:nv]), (path, trial, nv)


def test_a_model_decodes_the_same_logits_alone_and_in_a_batch(tmp_path) -> None:
    """The server's batched decode on a q8 model with int8 activations: every row equals the
    one-token forward of that sequence alone, bit for bit."""
    import cmf
    from cmf.convert import convert
    from cmf.runtime.batched import clone_prefix, decoder
    from server_fixtures import tiny_qwen3

    path = tmp_path / "m.cmf"
    convert(tiny_qwen3(tmp_path / "hf"), path, quant="q8")
    model = cmf.load(path, int8_activations=True)
    try:
        prompts = [[5 + i, 17, 3 + 2 * i, 9] for i in range(5)]
        caches, nxt = [], []
        for ids in prompts:
            c = model.new_cache()
            nxt.append(int(np.argmax(model.prefill(ids, c)[-1])))
            caches.append(c)
        alone = [clone_prefix(c, c.pos, 8) for c in caches]
        out = decoder(model).step(nxt, caches)
        for b in range(5):
            ref = model.forward([nxt[b]], alone[b])[-1]
            assert np.array_equal(ref, out[b])
    finally:
        model.close()


def test_prompt_blocks_group_qkv_and_gate_up(tmp_path) -> None:
    """A prompt block's q/k/v and gate/up (with the activation) run as one int8 product each
    (``blocks.int8_group``): the same values as the matrices one by one."""
    import cmf
    from cmf.convert import convert
    from server_fixtures import tiny_qwen3

    path = tmp_path / "m.cmf"
    convert(tiny_qwen3(tmp_path / "hf"), path, quant="q8")
    model = cmf.load(path, int8_activations=True)
    try:
        ids = [5, 17, 3, 9, 11, 2, 40, 7]
        grouped = model.prefill(ids, model.new_cache(), all_logits=True)
        blk = model._blocks[0]
        assert blk.mixer._qkv is not None and blk.ffn._gate_up is not None
        for b in model._blocks:
            b.mixer._qkv, b.ffn._gate_up = None, None  # the products one by one
        apart = model.prefill(ids, model.new_cache(), all_logits=True)
        np.testing.assert_allclose(grouped, apart, rtol=0, atol=1e-5 * np.abs(apart).max())
    finally:
        model.close()


def _quantize_rule(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 activations' rule as the kernels compute it: d = max|x|·f32(1/127) (NaN for a group
    holding inf or NaN), 1/d = 127/max|x| (0 where d = 0), q = rint(x·(1/d)) ties to even (0 where
    that product is NaN), xc = 128·Σ q."""
    g = X.reshape(X.shape[0], -1, 32)
    bits = g.view(np.uint32) & np.uint32(0x7FFFFFFF)
    top = bits.max(-1)
    special = top >= 0x7F800000
    topf = top.view(np.float32)
    with np.errstate(all="ignore"):
        d = np.where(special, np.float32(0), topf * np.float32(1 / 127)).astype(np.float32)
        inv = np.where(d > 0, np.float32(127) / topf, np.float32(0)).astype(np.float32)
        v = (g * inv[..., None]).astype(np.float32)
    v = np.where(np.isnan(v), np.float32(0), v)
    q = np.rint(v).astype(np.int32)
    d = np.where(special, np.float32(np.nan), d)
    return q.astype(np.int8).reshape(X.shape), (128 * q.sum(-1)).astype(np.int32), d


def test_activation_quantizer_follows_its_rule_bit_for_bit() -> None:
    """quantize_rows against the rule, over scales from 1e-30 to near-overflow, zero groups,
    ±inf, NaN and exact ties (x·(1/d) = k + ½)."""
    rng = np.random.default_rng(11)
    T, gpr = 512, 9
    X = (rng.standard_normal((T, gpr * 32)) * rng.choice([1e-30, 1e-3, 1.0, 7.0, 3e37], (T, 1))).astype(np.float32)
    m = rng.random(X.shape)
    X[m < 0.002] = np.inf
    X[(m > 0.002) & (m < 0.004)] = -np.inf
    X[(m > 0.004) & (m < 0.006)] = np.nan
    X[(m > 0.006) & (m < 0.05)] = 0
    X[rng.random(T) < 0.05] = 0
    X[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves: ties to even once scaled
    X[0, 31] = 127.0
    xq, xc, d = q8i.buffers(T, gpr)
    q8i.quantize(X, xq, d, xc)
    wq, wc, wd = _quantize_rule(X)
    assert np.array_equal(xq, wq) and np.array_equal(xc, wc)
    assert np.array_equal(d.view(np.uint32), wd.view(np.uint32))


_ROW_RUNNERS: dict = {}


def _rows_runner(path: str):  # noqa: ANN202 - a compiled function
    if path not in _ROW_RUNNERS:
        k = q8i_ir.rows_for(path)

        @numba.njit
        def run(planes, nblk, xv, xc, d, gpr, s, Y, pf):  # pragma: no cover - compiled
            k(planes, 0, nblk, xv, gpr * 8, xc, d, gpr, Y.shape[0], s, Y, pf)

        _ROW_RUNNERS[path] = run
    return _ROW_RUNNERS[path]


@pytest.mark.parametrize("path", [p for p in int_dot.PATHS if int_dot.path_supported(p)])
def test_whole_block_loop_equals_the_per_pass_kernels(path: str) -> None:
    """q8i_rows (every whole block and vector in one compiled loop, the scale and store included,
    prefetches spread over the passes) gives the per-pass kernels' bits for 1..17 vectors, and
    Int8Group products equal the per-block path (``listed_blocks``) with partial last blocks and
    an output whose rows are not contiguous (the per-block fallback)."""
    rng = np.random.default_rng(12)
    gpr, nblk = 3, 3
    q8 = rng.integers(-128, 128, (32 * nblk, gpr * 32)).astype(np.int8)
    s = (rng.random(32 * nblk) + 0.5).astype(np.float32)
    planes = q8i.pack(q8, 1)
    for T in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        X = rng.standard_normal((T, gpr * 32)).astype(np.float32)
        xq, xc, d = q8i.buffers(T, gpr)
        q8i.quantize(X, xq, d, xc)
        want = np.empty((T, 32 * nblk), np.float32)
        q8i.listed_blocks(planes, s, X, xq, xq.view(np.int32), xc, d, np.arange(nblk), want)
        for pf in (0, gpr * q8i.GROUP_BYTES):
            got = np.full((T, 32 * nblk), np.nan, np.float32)
            _rows_runner(path)(planes, nblk, xq.view(np.int32).reshape(-1), xc.reshape(-1), d.reshape(-1), gpr, s, got,
                               pf)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (path, T, pf)
    for rows, cols, T in ((100, 64, 5), (64, 96, 1), (33, 32, 3), (96, 64, 13)):
        w8 = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
        sc = (rng.random(rows) + 0.5).astype(np.float32)
        pk = q8i.pack(w8, 2)
        op = q8i.Int8Group([(pk, sc, rows)], cols)
        X = rng.standard_normal((T, cols)).astype(np.float32)
        nb = -(-rows // 32)
        xq, xc, d = q8i.buffers(T, op.gpr)
        ref = np.empty((T, nb * 32), np.float32)
        q8i.listed_blocks(pk, sc, q8i.whole_groups(X, op.gpr), xq, xq.view(np.int32), xc, d, np.arange(nb), ref)
        for nt in (1, 2):
            Y = op.run(X, np.empty((T, rows), np.float32), nt)
            assert np.array_equal(Y, ref[:, :rows]), (rows, cols, T, nt)
        wide = np.zeros((T, 2 * rows), np.float32)
        op.run(X, wide[:, ::2], 1)  # rows of Y with a stride: the per-block path
        assert np.array_equal(wide[:, ::2], ref[:, :rows])
