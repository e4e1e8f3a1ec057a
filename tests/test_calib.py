"""Calibration (cmf.calib, --calib): statistics from a real run, GPTQ rounding, bytes, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cmf
import cmf.quant as q
from cmf import calib
from cmf.calib import feedback
from cmf.calib.encoding import element_scales
from cmf.calib.stats import InputStats
from cmf.format.constants import GROUP
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter

from _builders import header
from _shared_models import BASE, SHARED, base_f32  # noqa: F401 - the fixture

CALIB_TEXT = SHARED / "texts" / "man-calib.txt"
needs_shared = pytest.mark.skipif(not (BASE / "model.safetensors").exists() or not CALIB_TEXT.exists(),
                                  reason="../shared/models (base model and texts) not present")

FEEDBACK_DTYPES = ["q4_block", "q4_tiled", "q4tp", "q2tp", "q8_row", "vbit", "vbit_ro"]


def loud_inputs(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight matrix and calibration inputs with a few loud, correlated input channels."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x = rng.standard_normal((2048, cols)).astype(np.float32)
    loud = rng.choice(cols, 6, replace=False)
    x[:, loud] *= 12
    x[:, 1] = x[:, 0] * 0.9 + 0.1 * x[:, 1]  # correlated pair: what only the full Hessian sees
    return w, x


def stats_of(x: np.ndarray) -> InputStats:
    st = InputStats(x.shape[1], np.zeros((x.shape[1],) * 2, np.float32), members={"w"})
    st.add(x)
    return st


def out_err(w: np.ndarray, data: bytes, dtype: str, x: np.ndarray) -> float:
    got = q.decode(data, dtype, w.shape)
    return float(np.square(x @ (got - w).T.astype(np.float64)).sum())


@pytest.mark.parametrize("dtype", FEEDBACK_DTYPES)
def test_calibrated_encoding_cuts_output_error_with_valid_bytes(dtype, tmp_path):
    w, x = loud_inputs(48, 256, 1)
    st = stats_of(x)
    plain = q.encode(w, dtype)
    imp_only = q.encode(w, dtype, importance=st.importance()) if dtype != "q8_row" else plain
    got = calib.encode(w, dtype, st)
    q.get_codec(dtype).validate(got, w.shape)
    assert len(got) == len(plain)
    e_plain, e_imp, e_cal = (out_err(w, d, dtype, x) for d in (plain, imp_only, got))
    # (8 bits leave little to feed back: the gain is smaller there)
    assert e_cal < (0.95 if dtype == "q8_row" else 0.8) * e_plain, (e_cal, e_plain)
    assert e_cal < e_imp or dtype == "q8_row" and e_cal < e_plain
    # the scales are the importance-weighted encoder's, only the levels moved
    np.testing.assert_array_equal(element_scales(got, q.resolve_dtype(dtype), w.shape),
                                  element_scales(imp_only, q.resolve_dtype(dtype), w.shape))
    # the strict reader opens it and decodes the same values as the codec
    path = tmp_path / "m.cmf"
    with CmfWriter(path, header()) as wr:
        wr.add("w", q.resolve_dtype(dtype), w.shape, got)
    with cmf_open(path) as f:
        assert f.verify() == []
        np.testing.assert_array_equal(f.array("w"), q.decode(got, dtype, w.shape))


def test_gptq_levels_are_levels_of_the_dtype():
    w, x = loud_inputs(16, 128, 2)
    st = stats_of(x)
    s = np.full(w.shape, 0.01, np.float32)
    s[3, :32] = 0  # a zero-scale group gets level 0
    for kind, allowed in (("q4", np.arange(-8, 8)), ("q8", np.arange(-128, 128)),
                          ("q2", np.array([-1.5, -0.5, 0.5, 1.5]))):
        lv = feedback.gptq_levels(w, s, st.mean_hessian(), kind)
        assert np.isin(lv[s != 0], allowed).all()
        assert (lv[s == 0] == 0).all()
    # vbit: integers within each row's own range -L .. L+1
    lo = -np.array([3, 7, 15, 31] * 4, np.float64)
    lv = feedback.gptq_levels(w * 50, s, st.mean_hessian(), "int", bounds=(lo, -lo + 1))
    assert (lv == np.rint(lv)).all()
    assert ((lv >= lo[:, None]) & (lv <= -lo[:, None] + 1)).all()
    assert (lv == lo[:, None]).any() and (lv == -lo[:, None] + 1).any()  # both ends reached (clipped)
    with pytest.raises(ValueError, match="needs bounds"):
        feedback.gptq_levels(w, s, st.mean_hessian(), "int")


def test_plain_rounding_when_the_hessian_is_identity():
    # with H = I, error feedback has nothing to spread: GPTQ is round-to-nearest
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 64))
    s = np.full(w.shape, 0.3)
    lv = feedback.gptq_levels(w, s, np.eye(64), "q4", act_order=False)
    np.testing.assert_array_equal(lv, feedback.round_levels(w, s, "q4"))


def test_inverse_cholesky_factors_the_damped_inverse():
    # U upper with Uᵀ U = (H + λI)⁻¹, λ = 1% of mean diag H, on a badly conditioned Hessian of odd size
    rng = np.random.default_rng(3)
    x = rng.standard_normal((400, 203))
    x[:, :4] *= 40.0
    x[:, 9] = x[:, 10]
    h = x.T @ x / 400
    u = feedback.inverse_cholesky(h)
    assert u.shape == (203, 203) and u.flags.c_contiguous
    np.testing.assert_array_equal(u, np.triu(u))
    assert (np.diag(u) > 0).all()
    inv = np.linalg.inv(h + 0.01 * np.diag(h).mean() * np.eye(203))
    np.testing.assert_allclose(u.T @ u, inv, rtol=0, atol=1e-10 * np.abs(inv).max())


def test_inverse_cholesky_damps_more_or_gives_up():
    # a zero-variance input is made inert; an indefinite matrix is retried with more damping
    h = np.diag([4.0, 0.0, 1.0])
    u = feedback.inverse_cholesky(h)
    lam = 0.01 * 2.5
    np.testing.assert_allclose(u.T @ u, np.diag([1 / (4 + lam), 1 / (1 + lam), 1 / (1 + lam)]), rtol=1e-12)
    indefinite = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues -1, 3: λ = 0.01, 0.1, 1 fail, 10 holds
    u = feedback.inverse_cholesky(indefinite)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(indefinite + 10 * np.eye(2)), rtol=1e-12)
    assert feedback.inverse_cholesky(np.array([[1.0, 20.0], [20.0, 1.0]])) is None  # -19 + 10 < 0


def test_q2tp_zero_rung_groups_keep_their_canonical_bytes():
    w, x = loud_inputs(8, 128, 4)
    w[2, 64:96] = 0  # a dead group: rung 0
    got = calib.encode(w, "q2tp", stats_of(x))
    planes, _, _ = q.get_codec("q2tp").split(got, w.shape)
    assert (planes[2, 2] == 0xAA).all()
    assert (q.decode(got, "q2tp", w.shape)[2, 64:96] == 0).all()


def test_q1t_and_vbit_take_the_importance():
    w, x = loud_inputs(32, 256, 5)
    st = stats_of(x)
    # q1t: the overlay and scales follow |W|·RMS(x): output error below the plain encoding's
    assert out_err(w, calib.encode(w, "q1t", st), "q1t", x) < out_err(w, q.encode(w, "q1t"), "q1t", x)
    # vbit: a uniform importance changes nothing; a skewed one changes the scales, not the widths
    np.testing.assert_array_equal(np.frombuffer(q.encode(w, "vbit", importance=np.ones(256)), np.uint8),
                                  np.frombuffer(q.encode(w, "vbit"), np.uint8))
    imp = np.ones(256, np.float32)
    imp[::5] = 50.0  # a few inputs of every group matter most
    plain, weighted = q.encode(w, "vbit"), q.encode(w, "vbit", importance=imp)
    assert plain[:32] == weighted[:32] and plain != weighted
    cols_err = [np.square(q.decode(d, "vbit", w.shape) - w).sum(axis=0) for d in (plain, weighted)]
    assert (cols_err[1] * imp).sum() < (cols_err[0] * imp).sum()
    with pytest.raises(ValueError, match="importance has 3 values"):
        q.encode(w, "vbit", importance=np.ones(3))
    with pytest.raises(ValueError, match="needs encoder='mse'"):
        q.encode(w, "vbit", importance=imp, encoder="reference")


def test_without_statistics_encoding_is_plain():
    w, _ = loud_inputs(8, 64, 6)
    for dtype in ("q4tp", "q8_row", "f16"):
        assert calib.encode(w, dtype, None) == q.encode(w, dtype)


# -- statistics from a real model run -------------------------------------------------------------

@needs_shared
def test_collected_statistics_are_the_inputs_the_matrices_see(base_f32):
    cal = calib.collect(base_f32, CALIB_TEXT, window=256, max_tokens=2048)
    assert cal.tokens == 2048 and cal.windows == 8 and cal.window == 256
    st = cal.get("model.layers.0.self_attn.q_proj.weight")
    # q/k/v are handed the same normed hidden state, gate/up the same: one accumulator each
    assert st is cal.get("model.layers.0.self_attn.k_proj.weight") is cal.get("model.layers.0.self_attn.v_proj.weight")
    assert cal.get("model.layers.0.mlp.gate_proj.weight") is cal.get("model.layers.0.mlp.up_proj.weight")
    assert cal.get("model.layers.0.mlp.down_proj.weight") is not cal.get("model.layers.0.mlp.up_proj.weight")
    assert cal.get("model.embed_tokens.weight") is None  # the token table is a lookup
    assert st.tokens == 2048
    # layer 0's attention input recomputed from the file: RMSNorm(embedding) · weight
    with cmf.load(base_f32) as m:
        ids = calib.token_windows(m.tokenizer, CALIB_TEXT, 256, 2048)
        f = m.file
        emb = f.array("model.embed_tokens.weight")
        g = f.array("model.layers.0.input_layernorm.weight").astype(np.float64)
        eps = m.plan.eps
    x = emb[np.concatenate(ids)].astype(np.float64)
    h = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * g
    np.testing.assert_allclose(st.sq, (h * h).sum(axis=0), rtol=2e-4)
    np.testing.assert_allclose(st.hessian, h.T @ h, rtol=2e-3, atol=2e-3 * np.abs(h.T @ h).max())


@needs_shared
def test_short_missing_and_binary_texts_are_refused(base_f32, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A few words only.\n\nNot enough to calibrate on.\n")
    with pytest.raises(calib.CalibrationError, match=r"short.txt: \d+ tokens; calibration needs a text of at least 1024"):
        calib.collect(base_f32, short)
    with pytest.raises(calib.CalibrationError, match="calibration text not found"):
        calib.collect(base_f32, tmp_path / "absent.txt")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"text\n" * 100 + b"\xff\xfe\x00bad")
    with pytest.raises(calib.CalibrationError, match="not UTF-8 text"):
        calib.collect(base_f32, binary)
    with pytest.raises(calib.CalibrationError, match="below the minimum of 1024"):
        calib.collect(base_f32, CALIB_TEXT, max_tokens=100)


@needs_shared
def test_requant_cli_with_a_short_text_fails_and_writes_nothing(base_f32, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    out = tmp_path / "out.cmf"
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "requant", str(base_f32), "-o", str(out), "--quant", "q4tp",
                        "--calib", str(short)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "calibration needs a text of at least 1024" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [short]


@needs_shared
def test_requant_with_calib_lowers_perplexity_on_other_text(base_f32, tmp_path):
    from cmf.tools.perplexity import encode_text, perplexity
    from cmf.tools.requant import requant

    plain, cal = tmp_path / "plain.cmf", tmp_path / "cal.cmf"
    requant(base_f32, plain, quant="q2tp")
    rep = requant(base_f32, cal, quant="q2tp", calib=CALIB_TEXT, calib_tokens=4096)
    assert rep["changed"] == len([e for e in rep["entries"] if e["to"] != e["from"]]) > 0
    held = (SHARED / "texts" / "py-heldout.txt").read_text()[:60000]
    ppl = {}
    for name, path in (("f32", base_f32), ("plain", plain), ("cal", cal)):
        with cmf.load(path) as m:
            ppl[name] = perplexity(m, encode_text(m.tokenizer, held), 257, chunks=12)["ppl"]
    assert ppl["cal"] < ppl["plain"], ppl
    with cmf_open(cal) as f:
        assert f.verify() == []
        prov = f.header.to_dict()["provenance"]["options"]["calib"]
    assert prov["calib_text"] == "man-calib.txt" and prov["calib_tokens"] == 4096


@needs_shared
def test_convert_with_calib_end_to_end(tmp_path):
    from cmf.convert import convert

    out = tmp_path / "q4tp.cmf"
    res = convert(BASE, out, "q4tp", calib=CALIB_TEXT, calib_tokens=2048)
    assert [p.name for p in res.paths] == ["q4tp.cmf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4tp.cmf"]  # the f16 calibration copy is gone
    with cmf_open(out) as f:
        assert f.verify() == []
        assert f.header.to_dict()["provenance"]["options"]["calib"]["calib_matrices"] > 0
    with cmf.load(out) as m:
        assert m.generate("The", max_tokens=4, temperature=0)


@needs_shared
def test_quant_report_eval_and_calib(base_f32, tmp_path):
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "quant-report", str(base_f32), "--quant", "q8_row,q2tp",
                        "--eval", str(SHARED / "texts" / "py-heldout.txt"), "--calib", str(CALIB_TEXT),
                        "--calib-tokens", "2048", "--chunks", "2", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json

    ev = json.loads(r.stdout)["eval"]
    rows = {x["dtype"]: x for x in ev["rows"]}
    src = ev["source_ppl"]
    assert ev["windows"] == 2 and ev["calib"]["calib_tokens"] == 2048
    assert abs(rows["q8_row"]["ppl"] / src - 1) < 0.02
    assert rows["q2tp"]["ppl"] > rows["q8_row"]["ppl"] and rows["q2tp"]["ppl_calib"] < rows["q2tp"]["ppl"]
    assert rows["q2tp"]["mb"] < rows["q8_row"]["mb"]
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "quant-report", str(base_f32), "--calib", str(CALIB_TEXT)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--calib needs --eval" in r.stderr


def test_a_ridged_hessian_trades_fit_for_other_text():
    """H + ridge·mean(diag H)·I (stats.RIDGE, used by tight target-size budgets): bare GPTQ moves
    rounding error into inputs that were quiet in the calibration text, and a text where they
    are not pays for it. ``calib.encode(..., ridge=r)`` rounds against it."""
    from cmf.calib import stats as calib_stats
    from cmf.convert.budget import candidates

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 128)) * 0.02).astype(np.float32)
    x = rng.standard_normal((4096, 128)).astype(np.float32)
    quiet = rng.choice(128, 32, replace=False)
    x[:, quiet] *= 0.1  # inputs the calibration text hardly excites
    st = stats_of(x)
    h = st.mean_hessian()
    assert np.array_equal(st.robust_hessian(0.0), h) and calib_stats.RIDGE > 0
    r = st.robust_hessian(calib_stats.RIDGE)
    assert np.allclose(r - h, calib_stats.RIDGE * np.diag(h).mean() * np.eye(128))
    other = rng.standard_normal((4096, 128)).astype(np.float32)  # another text: every input alike
    bare, ridged = (calib.encode(w, "q4tp", st, ridge=k) for k in (0.0, calib_stats.RIDGE))
    assert bare == calib.encode(w, "q4tp", st)  # no ridge unless asked
    assert out_err(w, bare, "q4tp", x) < out_err(w, ridged, "q4tp", x)  # in sample the bare Hessian fits best ...
    assert out_err(w, ridged, "q4tp", other) < 0.9 * out_err(w, bare, "q4tp", other)  # ... and elsewhere it costs
    # a budget's ridged candidates carry the ridge, so the file is written with the bytes it scored
    cs = candidates(w, st, {}, 1.0, ridge=calib_stats.RIDGE)
    assert all(c.options.get("ridge") == calib_stats.RIDGE for c in cs)
    assert cs[2].name == "q4tp" and cs[2].nbytes == len(ridged)
    assert all("ridge" not in c.options for c in candidates(w, None, {}, None, ridge=calib_stats.RIDGE))


def test_ffn_down_projections_round_against_a_larger_ridge():
    """Where a caller rounds against a ridged Hessian (a tight target-size budget), FFN down
    projections (dense and expert, told by the names sharing the input) take at least
    ``DOWN_RIDGE`` at 4 bits and more — the same bytes as asking for that ridge — and the ridge
    asked for below 4 bits (q2tp, vbit at a mean under 4) and for every other matrix; without a
    ridge (plain --calib, loose budgets) nothing changes."""
    from cmf.calib import stats as calib_stats
    from cmf.calib.encoding import DOWN_RIDGE, role_ridge

    w, x = loud_inputs(64, 256, 3)
    plain_st = stats_of(x)
    r = calib_stats.RIDGE
    assert DOWN_RIDGE > r > 0
    for name in ("model.layers.3.mlp.down_proj.weight", "model.layers.0.mlp.experts.7.down_proj.weight"):
        down = stats_of(x)
        down.members = {name}
        assert role_ridge(down, q.resolve_dtype("q4tp"), {}) == DOWN_RIDGE
        for dtype, opts in (("q4tp", {}), ("q8_row", {}), ("vbit", {"mean_bits": 5.0})):
            got = calib.encode(w, dtype, down, ridge=r, **opts)
            assert got == calib.encode(w, dtype, plain_st, ridge=DOWN_RIDGE, **opts), (name, dtype)
            assert got != calib.encode(w, dtype, plain_st, ridge=r, **opts), (name, dtype)
            assert calib.encode(w, dtype, down, **opts) == calib.encode(w, dtype, plain_st, **opts), (name, dtype)
        for dtype, opts in (("q2tp", {}), ("vbit", {"mean_bits": 3.0})):
            assert calib.encode(w, dtype, down, ridge=r, **opts) == calib.encode(w, dtype, plain_st, ridge=r, **opts)
        assert calib.encode(w, "q4tp", down, ridge=3.0) == calib.encode(w, "q4tp", plain_st, ridge=3.0)
    for other in ("model.layers.3.mlp.up_proj.weight", "model.layers.3.self_attn.o_proj.weight", "w"):
        st = stats_of(x)
        st.members = {other, "model.layers.3.mlp.gate_proj.weight"}
        assert role_ridge(st, q.resolve_dtype("q4tp"), {}) == 0.0
        assert calib.encode(w, "q4tp", st, ridge=r) == calib.encode(w, "q4tp", plain_st, ridge=r)
