"""Bad payloads, bad shapes and reserved dtypes raise CmfError subclasses, never anything else."""

from __future__ import annotations

import numpy as np
import pytest

import cmf.quant as q
from cmf.format.errors import BoundsError, CmfError, UnknownDtype, UnsupportedDtype

ALL = ["f32", "f16", "bf16", "q8_row", "q4_block", "q8_2f", "vbit", "vbit_ro", "q4_tiled", "q4tp", "q2tp",
       "q1", "q1s", "q1t"]
SHAPE = (4, 64)


def _payload(name: str) -> bytes:
    w = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    opts = {"q1s": {"keep": 0.05}, "q1t": {"keep": 0.05}}.get(name, {})
    return q.encode(w, name, **opts)


@pytest.mark.parametrize("name", ALL)
def test_wrong_length_is_bounds_error(name: str) -> None:
    data = _payload(name)
    for bad in (data[:-1], data + b"\0", b"", data[: len(data) // 2]):
        with pytest.raises(BoundsError):
            q.decode(bad, name, SHAPE)
        with pytest.raises(BoundsError):
            q.get_codec(name).validate(bad, SHAPE)


@pytest.mark.parametrize("name", ALL)
def test_truncations_and_bit_flips_never_escape_as_other_errors(name: str) -> None:
    data = bytearray(_payload(name))
    rng = np.random.default_rng(len(data))
    for trial in range(60):
        bad = bytearray(data)
        if trial % 3 == 0:
            bad = bad[: int(rng.integers(0, len(bad)))]
        else:
            for pos in rng.integers(0, len(bad), size=3):
                bad[pos] = int(rng.integers(0, 256))
        try:
            with np.errstate(all="ignore"):
                out = q.decode(bytes(bad), name, SHAPE)
                rows = q.decode_rows(bytes(bad), name, SHAPE, [3, 1])
            assert out.shape == SHAPE and rows.shape == (2, 64)
        except CmfError:
            pass


@pytest.mark.parametrize("width", [0, 1, 2, 7, 9, 255])
@pytest.mark.parametrize("name", ["vbit", "vbit_ro"])
def test_vbit_rejects_bad_width(name: str, width: int) -> None:
    data = bytearray(_payload(name))
    data[1] = width
    with pytest.raises(BoundsError, match="width"):
        q.decode(bytes(data), name, SHAPE)


def test_vbit_ro_offsets_must_match_and_be_monotonic() -> None:
    data = bytearray(_payload("vbit_ro"))
    off = SHAPE[0] + 2 * SHAPE[0] * SHAPE[1] // 32
    offsets = np.frombuffer(bytes(data[off:off + 4 * (SHAPE[0] + 1)]), "<u4").copy()
    for bad in ([offsets[0] + 1, *offsets[1:]], [0, offsets[2], offsets[1], *offsets[3:]]):
        patched = bytearray(data)
        patched[off:off + 4 * (SHAPE[0] + 1)] = np.array(bad, "<u4").tobytes()
        with pytest.raises(BoundsError):
            q.decode(bytes(patched), "vbit_ro", SHAPE)


def test_q1t_row_ptr_past_end_and_bad_column() -> None:
    data = bytearray(_payload("q1t"))
    base = 9 * SHAPE[0] * SHAPE[1] // 32
    ptr = np.frombuffer(bytes(data[base:base + 4 * (SHAPE[0] + 1)]), "<u4").copy()
    too_far = ptr.copy()
    too_far[-1] += 1000
    patched = bytearray(data)
    patched[base:base + 4 * (SHAPE[0] + 1)] = too_far.astype("<u4").tobytes()
    with pytest.raises(BoundsError):
        q.decode(bytes(patched), "q1t", SHAPE)
    backwards = ptr.copy()
    backwards[1], backwards[2] = backwards[2], backwards[1] - 1 if backwards[1] else 0
    if not np.all(np.diff(backwards.astype(np.int64)) >= 0):
        patched = bytearray(data)
        patched[base:base + 4 * (SHAPE[0] + 1)] = backwards.astype("<u4").tobytes()
        with pytest.raises(BoundsError):
            q.decode(bytes(patched), "q1t", SHAPE)
    ent = base + 4 * (SHAPE[0] + 1)
    patched = bytearray(data)
    patched[ent:ent + 2] = np.array([SHAPE[1]], "<u2").tobytes()
    with pytest.raises(BoundsError):
        q.decode(bytes(patched), "q1t", SHAPE)


def test_q1s_count_and_index_checked() -> None:
    data = bytearray(_payload("q1s"))
    base = 6 * SHAPE[0] * SHAPE[1] // 32
    patched = bytearray(data)
    patched[base:base + 4] = np.array([10 ** 6], "<u4").tobytes()
    with pytest.raises(BoundsError):
        q.decode(bytes(patched), "q1s", SHAPE)
    patched = bytearray(data)
    patched[base + 4:base + 8] = np.array([SHAPE[0] * SHAPE[1]], "<u4").tobytes()
    with pytest.raises(BoundsError):
        q.decode(bytes(patched), "q1s", SHAPE)


@pytest.mark.parametrize("name", ["q8_row", "q8_2f", "vbit", "vbit_ro", "q4_tiled", "q4tp", "q2tp", "q1", "q1s", "q1t"])
def test_shape_rules(name: str) -> None:
    with pytest.raises(BoundsError):
        q.encode(np.zeros(64, np.float32), name)
    with pytest.raises(BoundsError):
        q.decode(b"\0" * 64, name, (64,))
    if name not in ("q8_row", "q8_2f"):
        with pytest.raises(BoundsError, match="32"):
            q.encode(np.zeros((2, 48), np.float32), name)


def test_q1t_column_limit() -> None:
    assert q.get_codec("q1t").expected_nbytes((1, 65536)) is None
    with pytest.raises(BoundsError):
        q.decode(b"\0" * 64, "q1t", (1, 65568))


@pytest.mark.parametrize("dtype", ["mix8_4", "u8", "q4_col", 5, 6, 7])
def test_reserved_dtypes_refuse_naming_the_dtype(dtype: str | int) -> None:
    codec = q.get_codec(dtype)
    assert codec.expected_nbytes((4, 4)) is None
    with pytest.raises(UnsupportedDtype, match=codec.name):
        q.decode(b"\0" * 16, dtype, (4, 4))
    with pytest.raises(UnsupportedDtype, match=codec.name):
        q.decode_rows(b"\0" * 16, dtype, (4, 4), [0])
    with pytest.raises(UnsupportedDtype):
        q.encode(np.zeros((4, 4), np.float32), dtype)


def test_names_ids_and_unknown_dtypes() -> None:
    assert q.get_codec("q4tp").id == 15 and q.get_codec(16).name == "q2tp"
    assert q.get_codec("Q8_ROW") is q.get_codec(3) is q.get_codec("q8")
    assert q.get_codec("q4t").name == "q4_tiled"
    for bad in ("q3", "", 17, -1, 255, None):
        with pytest.raises(UnknownDtype):
            q.get_codec(bad)  # type: ignore[arg-type]


def test_bad_rows_and_non_finite_input() -> None:
    data = _payload("q8_row")
    for rows in ([4], [-1], [0.5], [True]):
        with pytest.raises(BoundsError):
            q.decode_rows(data, "q8_row", SHAPE, rows)
    w = np.ones(SHAPE, np.float32)
    w[0, 0] = np.nan
    with pytest.raises(ValueError):
        q.encode(w, "q4tp")
    assert q.decode(q.encode(w, "f32"), "f32", SHAPE)[0, 0] != q.decode(q.encode(w, "f32"), "f32", SHAPE)[0, 0]
