"""Fused kernels against the reference (decode + numpy), for every dtype.

One CMF file holds every dtype at a few shapes (row counts that are not multiples of the
64-row tiles, ``in = 32·k``, zero rows, a matrix large enough for the parallel path), written
once per module and read back through the reader, so kernels see real mmap views.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import cmf.quant as q
from cmf.format.errors import BoundsError
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.kernels import _jit, prepare
from cmf.kernels.fused import prepare_fused
from cmf.kernels.reference import ReferenceLinear

from _builders import header

DTYPES = ["f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro",
          "q1", "q1s", "q1t"]
# (rows, in): tails of the 64-row tiles, a single short tile, one group wide, and a matrix over
# the parallel threshold for the 4-bit formats.
SHAPES = {"tail": (200, 96), "tile": (64, 64), "thin": (5, 32), "big": (576, 1024)}
TOL = 1e-5


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * np.exp2(rng.normal(0, 1, (rows, 1))) * 0.02).astype(np.float32)
    w[min(3, rows - 1)] = 0  # an all-zero row
    if cols >= 64:
        w[rows // 2, 32:64] = 0  # a dead group in a live row
    return w


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels") / "all.cmf"
    with CmfWriter(path, header()) as w:
        for i, (tag, shape) in enumerate(SHAPES.items()):
            m = _matrix(*shape, seed=i)
            for name in DTYPES:
                if tag == "big" and name in ("q1s", "q1t", "q2tp"):
                    m_big = m[:, :512]  # slow encoders: keep the file quick to build
                    w.add(f"{name}.{tag}", name, m_big.shape, q.encode(m_big, name, **_opts(name)))
                else:
                    w.add(f"{name}.{tag}", name, m.shape, q.encode(m, name, **_opts(name)))
        odd = _matrix(40, 50, seed=9)  # q4_block groups straddle rows: reference fallback
        w.add("q4_block.odd", "q4_block", odd.shape, q.encode(odd, "q4_block"))
    f = cmf_open(path)
    yield f
    f.close()


def _opts(name: str) -> dict:
    return {"keep": 0.02} if name in ("q1s", "q1t") else {}


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("tag", list(SHAPES))
@pytest.mark.parametrize("name", DTYPES)
def test_kernel_matches_reference(model, name: str, tag: str) -> None:
    t = model.tensor(f"{name}.{tag}")
    op = prepare(t)
    assert op is not None and type(op).__name__ != "ReferenceLinear"
    ref = ReferenceLinear(t)
    w = ref.dense().astype(np.float64)
    rows_n, cols = t.shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal(cols).astype(np.float32)
    _close(op(x), x @ w.T)
    pick = np.array([rows_n - 1, 0, 3, 3, rows_n // 2, min(64, rows_n - 1), rows_n - 1])
    for T in (1, 3, 64):
        X = rng.standard_normal((T, cols)).astype(np.float32)
        _close(op(X), X @ w.T)
        _close(op.rows(pick, X), X @ w[pick].T)
        _close(op.rows(pick, X), ref.rows(pick, X))
    _close(op.rows(pick, x), x @ w[pick].T)
    assert op.rows(np.zeros(0, np.int64), x).shape == (0,)
    assert op.rows([], X).shape == (64, 0)
    assert np.array_equal(op.dense(), ref.dense())
    assert op.out_features == rows_n and op.in_features == cols


@pytest.mark.parametrize("tag", ["tail", "big"])
@pytest.mark.parametrize("name", DTYPES)
def test_dequant_rows_are_the_codec_rows_exactly(model, name: str, tag: str) -> None:
    """Embedding lookups go through ``dequant_rows`` of a prepared op (runtime/weights.py)."""
    t = model.tensor(f"{name}.{tag}")
    op = prepare(t)
    if not hasattr(op, "dequant_rows"):
        pytest.skip(f"{name}: reference op")
    pick = np.array([t.shape[0] - 1, 0, 3, t.shape[0] // 2, 3])
    np.testing.assert_array_equal(op.dequant_rows(pick), q.decode_rows(t.numpy(), t.dtype, t.shape, pick))
    assert op.dequant_rows(np.zeros(0, np.int64)).shape == (0, t.shape[1])
    with pytest.raises(BoundsError):
        op.dequant_rows(np.array([t.shape[0]]))


@pytest.mark.parametrize("name", ["q8_row", "q4_tiled", "q4tp", "q2tp", "vbit_ro", "q1s", "f16"])
def test_serial_and_parallel_paths_agree(model, name: str, monkeypatch) -> None:
    t = model.tensor(f"{name}.tail")
    X = np.random.default_rng(2).standard_normal((2, t.shape[1])).astype(np.float32)
    serial = prepare_fused(t)(X)
    monkeypatch.setattr(_jit, "PARALLEL_MIN_BYTES", 0)
    old = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        fresh = prepare_fused(t)  # nothing packed yet: tiles are packed inside the parallel region
        _close(fresh(X), serial.astype(np.float64))
        _close(fresh.rows([5, 199, 70], X), serial[:, [5, 199, 70]].astype(np.float64))
    finally:
        numba.set_num_threads(old)


def test_rows_touch_only_their_tiles(model) -> None:
    op = prepare_fused(model.tensor("q4_tiled.big"))
    op.rows([70, 71], np.ones(op.in_features, np.float32))
    assert op.ready.tolist() == [0, 1] + [0] * (op.ntiles - 2)  # one 64-row tile packed, no others


def test_repack_is_no_larger_than_the_payload(model) -> None:
    # the ladder kinds keep each row's base as two float32 (2^lo, ratio) where the file has two
    # uint16 table indices: 4 bytes a row more than the payload, and where their scales are kept
    # decoded (ladder_scales.DECODED_SCALES: targets without mask registers) a float32 per row and group
    from cmf.kernels.ladder_scales import DECODED_SCALES

    for name, extra in (("q4_block", 0), ("q4_tiled", 0), ("q4tp", 4), ("q2tp", 4)):
        op = prepare_fused(model.tensor(f"{name}.big"))
        if extra and DECODED_SCALES:
            extra += 4 * op.in_features // 32
        repacked = op.planes.nbytes + op.sc.nbytes + op.cw.nbytes + op.lad.nbytes
        assert repacked <= op.nbytes + extra * op.out_features, name


def test_ladder_base_is_packed_with_its_tile(model) -> None:
    from cmf.kernels.tiled import _exp2_table

    op = prepare_fused(model.tensor("q4tp.big"))
    assert not op.lad.any()
    op.rows([70], np.ones(op.in_features, np.float32))  # packs tile 1 only
    table = _exp2_table()
    np.testing.assert_array_equal(op.lad[1, 0], table[op.params[64:128, 0]])
    np.testing.assert_array_equal(op.lad[1, 1], table[op.params[64:128, 1]])
    assert not op.lad[0].any() and not op.lad[2:].any()


def test_unsupported_layouts_fall_back_to_reference(model) -> None:
    t = model.tensor("q4_block.odd")
    assert prepare_fused(t) is None
    op = prepare(t)
    assert isinstance(op, ReferenceLinear)
    x = np.ones(t.shape[1], np.float32)
    _close(op(x), x @ op.dense().astype(np.float64).T)


def test_bad_inputs_raise(model) -> None:
    op = prepare(model.tensor("q8_row.tail"))
    with pytest.raises(ValueError):
        op(np.ones(7, np.float32))
    with pytest.raises(ValueError):
        op(np.ones((1, 2, 96), np.float32))
    with pytest.raises(BoundsError):
        op.rows([200], np.ones(96, np.float32))
    with pytest.raises(BoundsError):
        op.rows([-1], np.ones(96, np.float32))


def test_q1s_overlay_out_of_order_and_repeated(tmp_path) -> None:
    w = _matrix(8, 64, seed=5)
    data = bytearray(q.encode(w, "q1s", keep=0.05))
    base = 6 * w.size // 32
    count = int(np.frombuffer(bytes(data[base:base + 4]), "<u4")[0])
    ent = np.frombuffer(bytes(data[base + 4:]), np.uint8).reshape(count, 6).copy()
    ent = np.concatenate([ent[::-1], ent[:1]])  # reversed, and the first index repeated last
    ent[-1, 4:] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    bad = bytes(data[:base]) + np.array([count + 1], "<u4").tobytes() + ent.tobytes()
    path = tmp_path / "q1s.cmf"
    with CmfWriter(path, header()) as wr:
        wr.add("w", "q1s", w.shape, bad)
    with cmf_open(path) as f:
        t = f.tensor("w")
        x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
        _close(prepare(t)(x), x @ ReferenceLinear(t).dense().astype(np.float64).T)


def test_f16_conversion_is_exact_for_every_pattern() -> None:
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)

    @numba.njit
    def convert(src, out, soft):
        for i in range(src.shape[0]):
            out[i] = _jit._f16_soft(src[i]) if soft else _jit.f16_to_f32(src[i])

    for soft in (False, True):
        got = np.empty(65536, np.float32)
        convert(bits, got, soft)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), np.flatnonzero(~same)[:5]


def test_vbit_every_width(tmp_path) -> None:
    from _builders import vbit_payload

    widths = [3, 4, 5, 6, 8, 8, 6, 5, 4, 3, 4, 4]
    path = tmp_path / "vbit.cmf"
    with CmfWriter(path, header()) as wr:
        wr.add("a", "vbit", (12, 96), vbit_payload(12, 96, widths, seed=1))
        wr.add("b", "vbit_ro", (12, 96), vbit_payload(12, 96, widths, seed=2, ro=True))
    with cmf_open(path) as f:
        for name in ("a", "b"):
            t = f.tensor(name)
            w = ReferenceLinear(t).dense().astype(np.float64)
            X = np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32)
            op = prepare_fused(t)
            _close(op(X), X @ w.T)
            _close(op.rows([11, 0, 4], X[0]), X[0] @ w[[11, 0, 4]].T)


def test_huge_zeros_is_zeroed_aligned_and_gives_pages_back() -> None:
    import gc
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no madvise(MADV_HUGEPAGE) here")

    def rss_mb() -> float:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024

    small = _jit.huge_zeros((3, 5), np.uint16)
    a = _jit.huge_zeros((48 << 20,), np.uint8)
    assert small.shape == (3, 5) and small.dtype == np.uint16 and not small.any()
    assert a.ctypes.data % 64 == 0 and not a[::4096].any()
    before = rss_mb()
    a[:] = 1
    touched = rss_mb()
    del a
    gc.collect()
    assert touched - before > 40 and touched - rss_mb() > 40  # the dead array's pages went back
    assert not small.any()
    b = _jit.huge_zeros((4, 1 << 20), np.uint8)
    b[:] = 5
    row = b[2]
    del b
    gc.collect()
    assert row.sum() == 5 << 20  # a surviving view keeps its pages
