"""int8 activations for the 4-bit family's fused products (``kernels.prepare(int8_activations=True)``).

The kernels sum codes × int8 activations exactly in int32, so their rows must equal the decoded
matrix times the activations as ``reference.int8_activations`` rounds them (float32 summation
order aside); rows past the last whole 64-row tile stay exact. Blocks of tokens (prefill) run
the same integer loop over all their tokens on CPUs with VNNI, and stay exact without it.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import cmf.quant as q
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.kernels import _jit, prepare
from cmf.kernels.gemv import MatvecGroup
from cmf.kernels.reference import ReferenceLinear, int8_activations

from _builders import header

DTYPES = ["q4_block", "q4_tiled", "q4tp", "q2tp"]
SHAPE = (200, 320)  # three whole tiles and an 8-row tail; ten groups per row


def _close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, f"relative error {err:.2e}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(SHAPE) * np.exp2(rng.normal(0, 1, (SHAPE[0], 1))) * 0.02).astype(np.float32)
    w[7] = 0
    w[100, 64:96] = 0  # a dead group
    path = tmp_path_factory.mktemp("int8") / "m.cmf"
    with CmfWriter(path, header()) as wr:
        for name in DTYPES + ["q1t"]:
            wr.add(name, name, SHAPE, q.encode(w, name))
    f = cmf_open(path)
    yield f
    f.close()


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, SHAPE[1])).astype(np.float32)
    x[1, :32] = 0  # an all-zero group: d = 0
    x[2, 40] = 60.0  # an outlier dominating its group
    return [x[0], x, np.abs(x[:1])]


def _want(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    tiles = SHAPE[0] // 64 * 64
    xh = int8_activations(x).astype(np.float64)
    out = x.astype(np.float64) @ w.T
    out[..., :tiles] = xh @ w[:tiles].T
    return out


@pytest.mark.parametrize("name", DTYPES)
def test_matches_the_int8_oracle(model, name: str) -> None:
    t = model.tensor(name)
    op = prepare(t, int8_activations=True)
    assert op.int8
    w = ReferenceLinear(t).dense().astype(np.float64)
    for x in _inputs():
        got = op(x)
        _close(got, _want(w, x))
        exact = x.astype(np.float64) @ w.T
        _close(got, exact, 2e-2)  # the price of int8 activations, as in llama.cpp
    x = _inputs()[1]
    pick = np.array([199, 0, 7, 100, 64, 130])
    _close(op.rows(pick, x), _want(w, x)[:, pick])
    X = np.random.default_rng(9).standard_normal((40, SHAPE[1])).astype(np.float32)
    from cmf.kernels import q4

    # a block of tokens: int8 activations too where the block loop runs (VNNI), else exact
    _close(op(X), _want(w, X) if q4.EXACT_PIECES else X.astype(np.float64) @ w.T)


@pytest.mark.parametrize("name", ["q4tp", "q2tp"])
def test_parallel_and_grouped_paths_agree(model, name: str, monkeypatch) -> None:
    t = model.tensor(name)
    x = _inputs()[1][:1]
    serial = prepare(t, int8_activations=True)(x)
    monkeypatch.setattr(_jit, "PARALLEL_MIN_BYTES", 0)
    old = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        a, b = prepare(t, int8_activations=True), prepare(t, int8_activations=True)
        assert np.array_equal(a(x), serial)
        out = np.empty((1, 2 * SHAPE[0]), np.float32)
        MatvecGroup([a, b])(x, out, 2)
        # another compiled driver: LLVM may contract a multiply-add differently (an ulp or two)
        assert np.array_equal(out[:, :SHAPE[0]], out[:, SHAPE[0]:])
        _close(out[:, SHAPE[0]:], serial.astype(np.float64), 1e-6)
        MatvecGroup([a, b])(x, out, 1)
        _close(out[:, SHAPE[0]:], serial.astype(np.float64), 1e-6)
    finally:
        numba.set_num_threads(old)


def test_non_finite_input_gives_nan_rows_not_garbage(model) -> None:
    op = prepare(model.tensor("q4tp"), int8_activations=True)
    x = _inputs()[0].copy()
    x[5] = np.inf
    y = op(x)
    assert np.isnan(y[:192]).all()  # as the exact kernel: inf times a zero scale is NaN too


def test_off_by_default_and_exact(model) -> None:
    t = model.tensor("q4tp")
    op = prepare(t)
    assert not op.int8
    x = _inputs()[0]
    _close(op(x), x.astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T)


def test_model_decode_with_int8_activations(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    import hf_fixtures as H

    from cmf.cli import main
    from cmf.convert import convert
    from cmf.runtime.model import load

    path = tmp_path / "q4tp.cmf"
    convert(H.fixture("qwen3"), path, quant="q4tp")
    ids = [3 + (7 * i) % 60 for i in range(40)]
    logits = {}
    for i8 in (False, True):
        with load(path, int8_activations=i8) as m:
            assert m.int8_activations is i8
            assert any(getattr(op, "int8", False) for op in m.weights._linears.values()) is i8
            cache = m.new_cache()
            first = m.prefill(ids, cache)[-1]
            steps = [m.forward([t], cache)[-1] for t in (4, 8, 15)]
            logits[i8] = (first, np.stack(steps))
    exact = np.concatenate([logits[False][0][None], logits[False][1]])
    fast = np.concatenate([logits[True][0][None], logits[True][1]])
    assert not np.array_equal(exact, fast)
    assert float(np.abs(fast - exact).max()) <= 5e-2 * float(np.abs(exact).max())
    assert main(["run", str(path), "-p", "hello", "-n", "4", "--int8-act", "--raw"]) == 0
    assert "finish" in capsys.readouterr().err


def test_portable_dot_without_vnni_gives_the_same_sums(model, tmp_path) -> None:
    """The widening-multiply form (CPUs without AVX-512 VNNI), compiled in a fresh process."""
    import json
    import os
    import subprocess
    import sys

    t = model.tensor("q4tp")
    x = _inputs()[1]
    want = prepare(t, int8_activations=True)(x)
    code = (
        "import json, sys, numpy as np\n"
        "from cmf.format.reader import open as o\n"
        "from cmf.kernels import _ir, prepare\n"
        "from cmf.kernels import q4\n"
        "assert not _ir.HW_VNNI and q4.EXACT_PIECES == 0\n"
        "f = o(sys.argv[1]); x = np.array(json.loads(sys.argv[2]), np.float32)\n"
        "print(json.dumps([prepare(f.tensor('q4tp'), int8_activations=True)(x).tolist(),\n"
        "                  prepare(f.tensor('q4tp'))(x).tolist()]))\n")
    env = dict(os.environ, CMF_NO_VNNI="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = subprocess.run([sys.executable, "-c", code, str(model.path), json.dumps(x.tolist())], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got, exact = (np.array(v, np.float32) for v in json.loads(out.stdout))
    _close(got, want.astype(np.float64), 1e-6)
    _close(exact, x.astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T, 2e-6)  # float kernels


# -- exact mode: x in three int8 pieces ----------------------------------------------------------

def test_three_pieces_rebuild_x_to_within_3_6e7_of_its_group_max() -> None:
    from cmf.kernels import xprep

    rng = np.random.default_rng(11)
    X = (rng.standard_normal((2, 256)) * np.exp2(rng.normal(0, 3, (2, 256)))).astype(np.float32)
    X[1, :32] = 0
    X[0, 50] = -1e4  # an outlier dominating its group
    gpr = 256 // 32
    q8 = np.empty((2, gpr, 3, 4, 2, 4), np.int8)
    xd = np.empty((2, gpr), np.float32)
    xz = np.empty((2, 3 * gpr), np.float32)
    xprep.quantize_x(X, q8, xd, xz, np.float32(8))
    # back to feature order: weight P·(4w + k) + p of a group sits at [w, p, k]
    pieces = q8.transpose(0, 1, 2, 3, 5, 4).reshape(2, gpr, 3, 32).astype(np.float64)
    assert np.abs(pieces[:, :, 0]).max() <= 127 and np.abs(pieces[:, :, 1:]).max() <= 64
    rebuilt = xd[..., None].astype(np.float64) * (pieces[:, :, 0] + pieces[:, :, 1] / 128 + pieces[:, :, 2] / 128 ** 2)
    groups = X.reshape(2, gpr, 32).astype(np.float64)
    # d/2^15 for the last piece plus two float32 roundings (1/d, x·(1/d)) of up to 127·2^-24·d
    bound = np.abs(groups).max(axis=-1, keepdims=True) * 3.6e-7
    assert np.all(np.abs(rebuilt - groups) <= bound)
    np.testing.assert_array_equal(xz.reshape(2, gpr, 3), 8 * pieces.sum(axis=-1))


@pytest.mark.parametrize("name", DTYPES)
def test_exact_mode_matches_the_float_kernels_and_the_reference(model, name: str) -> None:
    from cmf.kernels import q4

    t = model.tensor(name)
    op = prepare(t)
    assert op.pieces == q4.EXACT_PIECES and not op.int8
    flt = prepare(t)
    flt.pieces = 0  # the float32 kernels (CPUs without VNNI)
    w = ReferenceLinear(t).dense().astype(np.float64)
    for x in _inputs():
        exact = x.astype(np.float64) @ w.T
        _close(op(x), exact, 2e-6)
        _close(flt(x), exact, 2e-6)
    x = _inputs()[1]
    pick = np.array([199, 0, 7, 100, 64, 130])
    _close(op.rows(pick, x), (x.astype(np.float64) @ w.T)[:, pick], 2e-6)
    assert op.use_int8_activations(False) is False and op.pieces == q4.EXACT_PIECES
    op.use_int8_activations(True)
    assert op.pieces == 1


def test_a_group_of_mixed_modes_runs_the_float_kernels(model) -> None:
    t = model.tensor("q4_tiled")
    a, b = prepare(t, int8_activations=True), prepare(t)
    x = _inputs()[1][:1]
    out = np.empty((1, 2 * SHAPE[0]), np.float32)
    MatvecGroup([a, b])(x, out, 1)
    exact = x.astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T
    _close(out[:, :SHAPE[0]], exact, 2e-6)
    _close(out[:, SHAPE[0]:], exact, 2e-6)


def test_exact_mode_non_finite_input_gives_nan_rows(model) -> None:
    op = prepare(model.tensor("q4_block"))
    x = _inputs()[0].copy()
    x[70] = np.nan
    assert np.isnan(op(x)[:192]).all()


def _q1t_file(path, seed: int, keep: float):  # noqa: ANN001, ANN202
    """A one-tensor q1t file (200 × 256: three whole tiles and an 8-row tail), opened."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((200, 256)) * 0.05).astype(np.float32)
    w[5, 7] = 3.0  # outliers for the overlay (when keep > 0)
    w[150, 200] = -2.5
    with CmfWriter(path, header()) as wr:
        wr.add("q1t", "q1t", w.shape, q.encode(w, "q1t", keep=keep))
    return cmf_open(path)


def test_q1t_products_run_on_crumb_tiles_with_the_overlay_added(tmp_path) -> None:
    from cmf.kernels import q4_stored

    with _q1t_file(tmp_path / "q1t.cmf", 8, 0.01) as f:
        t = f.tensor("q1t")
        op = prepare(t)
        assert op.tiled is not None and op.tiled.kind == q4_stored.KIND_Q1T and op.has_overlay
        dense = ReferenceLinear(t).dense().astype(np.float64)
        x = _inputs()[1][:, :256]
        exact = x.astype(np.float64) @ dense.T
        _close(op(x), exact, 2e-6)
        pick = np.array([199, 5, 150, 0, 64])
        _close(op.rows(pick, x), exact[:, pick], 2e-6)
        assert op.tiled.ready.all()  # packed: the base now comes from the tiles
        fast = prepare(t, int8_activations=True)
        assert fast.int8
        _close(fast(x), exact, 2e-2)


def test_q1t_without_overlay_prefills_on_the_tiles(tmp_path) -> None:
    rng = np.random.default_rng(9)
    with _q1t_file(tmp_path / "q1t0.cmf", 9, 0.0) as f:
        t = f.tensor("q1t")
        op = prepare(t)
        assert not op.has_overlay and not op.tiled.ready.any()
        X = rng.standard_normal((40, 256)).astype(np.float32)  # above fused_max_t: the batched path
        _close(op(X), X.astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T, 2e-6)
        assert op.tiled.ready.all()


def test_a_group_takes_a_strided_input(model) -> None:
    t = model.tensor("q4_tiled")
    a, b = prepare(t), prepare(t)
    wide = np.zeros((1, 2 * SHAPE[1]), np.float32)
    wide[0, ::2] = _inputs()[0]
    x = wide[:, ::2]  # every other float: not one vector load per group
    out = np.empty((1, 2 * SHAPE[0]), np.float32)
    MatvecGroup([a, b])(x, out, 1)
    exact = _inputs()[0].astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T
    _close(out[0, :SHAPE[0]], exact, 2e-6)
    _close(out[0, SHAPE[0]:], exact, 2e-6)


@pytest.mark.parametrize("name", DTYPES + ["q1t"])  # q1t: its crumb tiles (no overlay here)
@pytest.mark.parametrize("int8", [False, True])
def test_batched_products_are_the_exact_decode_products_token_by_token(model, name: str, int8: bool) -> None:
    """Prefill blocks run the decode step's integer tile loop over all their tokens at once
    (``q4.block_par``): each token's row equals, bit for bit, that token's decode product in the
    same mode (three int8 pieces of x exact, one with int8 activations)."""
    from cmf.kernels import q4

    t = model.tensor(name)
    op, one = prepare(t, int8_activations=int8), prepare(t, int8_activations=int8)
    if getattr(op, "tiled", op).pieces not in q4.BLOCK_PIECES:  # (q1t: its tiles' mode)
        pytest.skip("the batched path is dequantize + sgemm on this CPU for this mode (q4.BLOCK_PIECES)")
    X = np.random.default_rng(8).standard_normal((40, SHAPE[1])).astype(np.float32)  # > fused_max_t
    X[3, :32] = 0
    X[5, 70] = -80.0
    assert X.shape[0] > op.fused_max_t
    got = op(X)
    want = np.stack([one(x) for x in X])
    assert np.array_equal(got, want)
    _close(got, X.astype(np.float64) @ ReferenceLinear(t).dense().astype(np.float64).T, 2e-2 if int8 else 2e-6)
