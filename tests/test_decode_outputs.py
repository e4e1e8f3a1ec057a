"""Recycled memory for large decode outputs (cmf.quant._outputs)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from cmf import quant
from cmf.quant import _outputs

BIG = (1024, 2048)  # 8 MB of f32: above MIN_BYTES


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    monkeypatch.delenv("CMF_DECODE_CACHE_MB", raising=False)
    _outputs.clear()
    yield
    _outputs.clear()


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_small_outputs_are_plain_numpy():
    a = _outputs.empty((16, 16))
    assert a.flags.owndata and a.shape == (16, 16) and a.dtype == np.float32


def test_block_is_reused_only_after_its_array_dies():
    a = _outputs.empty(BIG)
    first = _address(a)
    b = _outputs.empty(BIG)
    assert _address(b) != first  # a is alive: a second block
    del a
    gc.collect()
    assert _outputs.cached_bytes() >= BIG[0] * BIG[1] * 4
    c = _outputs.empty(BIG)
    assert _address(c) == first and _outputs.cached_bytes() == 0
    assert c.flags.writeable and c.flags.c_contiguous and c.shape == BIG


def test_a_surviving_view_keeps_the_block():
    a = _outputs.empty(BIG)
    a[:] = 7.0
    tail = a[-3:].T  # a view of a view
    del a
    gc.collect()
    assert _outputs.cached_bytes() == 0
    other = _outputs.empty(BIG)
    other[:] = -1.0
    assert np.all(tail == 7.0)


def test_int_shape_and_other_dtypes():
    a = _outputs.empty(BIG[0] * BIG[1], np.uint32)
    assert a.shape == (BIG[0] * BIG[1],) and a.dtype == np.uint32


def test_cache_budget_zero_disables_recycling(monkeypatch):
    monkeypatch.setenv("CMF_DECODE_CACHE_MB", "0")
    a = _outputs.empty(BIG)
    assert a.flags.owndata
    del a
    gc.collect()
    assert _outputs.cached_bytes() == 0


def test_budget_and_block_count_bound_what_waits(monkeypatch):
    monkeypatch.setenv("CMF_DECODE_CACHE_MB", "20")  # two 8 MB blocks fit, not three
    arrays = [_outputs.empty(BIG) for _ in range(3)]
    del arrays
    gc.collect()
    assert _outputs.cached_bytes() == 16 << 20
    monkeypatch.setenv("CMF_DECODE_CACHE_MB", "1024")
    arrays = [_outputs.empty(BIG) for _ in range(_outputs.CACHED_BLOCKS + 2)]
    del arrays
    gc.collect()
    assert _outputs.cached_bytes() == _outputs.CACHED_BLOCKS * (8 << 20)


def test_block_fit_wastes_at_most_half():
    big = _outputs.empty((4096, 4096))  # 64 MB
    del big
    gc.collect()
    small = _outputs.empty(BIG)  # 8 MB does not take the 64 MB block
    assert _outputs.cached_bytes() == 64 << 20
    del small


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q1", "vbit"])
def test_decoding_in_a_loop_gives_right_values_in_recycled_memory(dtype):
    rng = np.random.default_rng(3)
    mats = [rng.standard_normal(BIG).astype(np.float32) for _ in range(2)]
    blobs = [quant.encode(m, dtype) for m in mats]
    expect = [quant.decode(b, dtype, BIG).copy() for b in blobs]
    kept = quant.decode(blobs[0], dtype, BIG)
    for i in range(4):  # each iteration's result dies when the next is assigned
        out = quant.decode(blobs[i % 2], dtype, BIG)
        np.testing.assert_array_equal(out, expect[i % 2])
    np.testing.assert_array_equal(kept, expect[0])  # never overwritten by the recycling
