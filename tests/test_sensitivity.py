"""Measured sensitivity of the output to each matrix (cmf.calib.sensitivity) and its use in budgets."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cmf
from cmf import calib
from cmf.calib.sensitivity import TABLE_RUNGS, mean_kl, measure, measure_table, relative_loss, sample, table_names
from cmf.convert.budget import (TABLE_LADDER, Candidate, allocate, candidates, plan_budget, sensitivity_lookup,
                                table_candidates, table_item)
from cmf.convert.calibrate import sensitivity_tokens_for

from _shared_models import BASE, SHARED, base_f32  # noqa: F401 - the fixture

CALIB_TEXT = SHARED / "texts" / "man-calib.txt"
needs_text = pytest.mark.skipif(not CALIB_TEXT.exists(), reason="../shared/models/texts not present")


def test_mean_kl_is_zero_for_the_same_distribution_and_positive_otherwise():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 50)).astype(np.float32)
    lp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    assert mean_kl([lp], [logits]) == pytest.approx(0.0, abs=1e-12)
    # shifting every logit of a row leaves its distribution as it is
    assert mean_kl([lp], [logits + 3.0]) == pytest.approx(0.0, abs=1e-9)
    other = logits + 0.3 * rng.standard_normal(logits.shape).astype(np.float32)
    q = other - np.log(np.exp(other.astype(np.float64)).sum(-1, keepdims=True))
    want = float((np.exp(lp) * (lp - q)).sum(-1).mean())
    assert mean_kl([lp], [other]) == pytest.approx(want, rel=1e-9) and want > 0


def test_sample_takes_the_first_tokens_window_by_window():
    assert sample([[1, 2, 3], [4, 5, 6], [7]], 5) == [[1, 2, 3], [4, 5]]
    assert sample([[1, 2]], 10) == [[1, 2]]


def test_layer_inputs_and_logits_from_match_the_whole_forward(base_f32):
    ids = list(range(5, 45))
    with cmf.load(base_f32) as m:
        full = m.logits(ids)
        xs = m.layer_inputs(ids)
        assert len(xs) == len(m.plan.layers)
        for layer in (0, len(xs) // 2, len(xs) - 1):
            np.testing.assert_allclose(m.logits_from(layer, xs[layer]), full, rtol=1e-5, atol=1e-5)
        # a rebuilt layer is the same layer, and says which matrices it takes
        names = m.rebuild_layer(1)
        assert names and all(".layers.1." in n for n in names)
        np.testing.assert_allclose(m.logits(ids), full, rtol=1e-6, atol=1e-6)


def _probe_setup(m) -> tuple[list[int], np.ndarray, list]:  # noqa: ANN001 - a Model
    """Ids whose logits must come back unchanged, those logits, and the calibration windows."""
    ids = list(range(3, 60))
    return ids, m.logits(ids), calib.token_windows(m.tokenizer, CALIB_TEXT, 64, 2048)


def _log_probs(logits: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for b in logits:
        top = b.max(-1, keepdims=True)
        out.append(b - np.log(np.exp(b.astype(np.float64) - top).sum(-1, keepdims=True)) - top)
    return out


@needs_text
def test_measure_gives_finite_sensitivities_and_leaves_the_model_as_it_was(base_f32):
    with cmf.load(base_f32) as m:
        ids, before, wins = _probe_setup(m)
        names = [n for n in m.file.keys() if ".layers." in n and n.endswith("proj.weight")]
        picked = [n for n in names if ".layers.0." in n or ".layers.3." in n]
        s1 = measure(m, wins, picked, lambda n: None, tokens=64)
        s2 = measure(m, wins, picked, lambda n: None, tokens=64)
        assert set(s1) == set(picked)
        assert all(np.isfinite(v) and v > 0 for v in s1.values()), s1
        assert s1 == s2  # deterministic
        assert max(s1.values()) > 2 * min(s1.values())  # matrices differ: what the budget needs to know
        np.testing.assert_array_equal(m.logits(ids), before)
        assert "linear" not in vars(m.weights)
        # the KL it measured is the one a whole forward with the probed matrix gives
        from cmf import quant
        from cmf.runtime.weights import DenseLinear

        name = picked[0]
        dense = m.weights.linear(name).dense()
        probed = quant.decode(quant.encode(dense, "q4tp"), "q4tp", dense.shape)
        ref_ids = sample(wins, 64)
        base = [m.logits(x) for x in ref_ids]
        plain = m.weights.linear
        m.weights.linear = lambda n: DenseLinear(probed) if n == name else plain(n)
        m._prepare()
        got = [m.logits(x) for x in ref_ids]
        del m.weights.linear
        m._prepare()
        kl = mean_kl(_log_probs(base), got)
        assert s1[name] == pytest.approx(kl / relative_loss(dense, probed, None), rel=1e-3)


@needs_text
def test_collect_measures_every_matrix_when_asked(base_f32):
    seen: list[tuple[str, int, int]] = []
    cal = calib.collect(base_f32, CALIB_TEXT, window=128, max_tokens=1024, sensitivity_tokens=64,
                        progress=lambda *a: seen.append(a))
    assert set(cal.sensitivity) == set(cal.stats)
    # progress: the tokens run, then one step per matrix probed, each with its stage's total
    runs = [a for a in seen if a[0] == "calibrate"]
    probes = [a for a in seen if a[0] == "sensitivity"]
    assert [a[0] for a in seen] == ["calibrate"] * len(runs) + ["sensitivity"] * len(probes)
    assert sum(a[1] for a in runs) == cal.tokens and {a[2] for a in runs} == {cal.tokens}
    assert len(probes) == len(cal.sensitivity) and {a[2] for a in probes} == {len(cal.stats)}
    assert all(v > 0 for v in cal.sensitivity.values())
    assert sensitivity_lookup(cal)(next(iter(cal.stats))) == cal.sensitivity[next(iter(cal.stats))]
    # a matrix the measurement did not reach takes the median of the others
    assert sensitivity_lookup(cal)("not.a.matrix") == pytest.approx(float(np.median(list(cal.sensitivity.values()))))
    plain = calib.collect(base_f32, CALIB_TEXT, window=128, max_tokens=1024)
    assert plain.sensitivity == {} and sensitivity_lookup(plain)(next(iter(plain.stats))) is None


@needs_text
def test_measure_table_gives_each_rungs_kl_and_leaves_the_model_as_it_was(base_f32):
    from cmf import quant
    from cmf.runtime.weights import DenseLinear

    with cmf.load(base_f32) as m:
        ids, before, wins = _probe_setup(m)
        got = measure_table(m, wins, tokens=64)
        names = table_names(m)
        assert set(got) == set(names) and all(set(v) == {r[0] for r in TABLE_RUNGS} for v in got.values())
        assert all(np.isfinite(x) and x > 0 for v in got.values() for x in v.values()), got
        np.testing.assert_array_equal(m.logits(ids), before)
        # vbit at 8 bits (a scale per 32) is closer to the table than one scale per row
        assert all(v["vbit8"] < v["q8_row"] for v in got.values()), got
        # each KL is that of a whole forward with the table (and the head it is) round-tripped
        name = names[0]
        dense = m.weights.linear(name).dense()
        probed = quant.decode(quant.encode(dense, "q8_row"), "q8_row", dense.shape)
        ref_ids = sample(wins, 64)
        base = [m.logits(x) for x in ref_ids]
        with m.weights.substituted(name, DenseLinear(probed)):
            m._prepare()
            swapped = [m.logits(x) for x in ref_ids]
        m._prepare()
        np.testing.assert_array_equal(m.logits(ids), before)
        if len(names) == 1:
            assert got[name]["q8_row"] == pytest.approx(mean_kl(_log_probs(base), swapped), rel=1e-6)


def test_the_token_table_is_a_budget_item_only_with_its_measured_kl():
    losses = {"vbit5": 0.05, "vbit6": 0.02, "q8_row": 0.01, "vbit8": 0.001}

    class Cal:
        table_loss = {"model.embed_tokens.weight": losses}
        sensitivity: dict = {}

        def get(self, name):
            return None

    rng = np.random.default_rng(4)
    table = (rng.standard_normal((96, 64)) * 0.02).astype(np.float32)
    table[:, 5] = 0.4  # an outlier column: one scale per row is coarse for every other column
    name = "model.embed_tokens.weight"
    assert table_item(name, table.shape, "q8_row", Cal())
    assert not table_item(name, table.shape, "q8_row", None)  # nothing measured: stays as the policy says
    assert not table_item(name, table.shape, "f16", Cal())
    assert not table_item("model.layers.0.mlp.down_proj.weight", table.shape, "q8_row", Cal())
    cands = table_candidates(table, losses)
    assert [c.name for c in cands] == [r.label for r in TABLE_LADDER] == ["vbit5", "vbit6", "q8_row", "vbit8"]
    # equal row amplitudes: every vbit row at its mean width, an f16 scale per 32
    assert [c.nbytes for c in cands] == [96 + 2 * 96 * 2 + 96 * 64 * b // 8 for b in (5, 6)] + [
        96 * 64 + 2 * 96, 96 + 2 * 96 * 2 + 96 * 64]
    assert [c.loss for c in cands] == [0.05, 0.02, 0.01, 0.001]
    items = [(name, lambda: table, {})]
    for c in cands:
        assert plan_budget(items, 0, c.nbytes, Cal()).choice == {name: c.name}
    # a vbit 8 encoding smaller than q8_row (rows far below the mean amplitude take 6 bits) and
    # better drops q8_row; a smaller but worse one comes before it
    table[::2] *= 0.05
    small = table_candidates(table, losses)
    assert [c.name for c in small] == ["vbit5", "vbit6", "vbit8"] and small[-1].nbytes < cands[2].nbytes
    worse = table_candidates(table, dict(losses, q8_row=0.001, vbit8=0.01))
    assert [c.name for c in worse] == ["vbit5", "vbit6", "vbit8", "q8_row"]


def test_the_budget_spends_bytes_on_the_sensitive_matrix():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 128)) * 0.02).astype(np.float32)
    plain = candidates(w, None, {})
    weighted = candidates(w, None, {}, sensitivity=4.0)
    assert [c.nbytes for c in weighted] == [c.nbytes for c in plain]
    assert [c.loss for c in weighted] == pytest.approx([4 * c.loss for c in plain])

    def ladder(scale: float) -> list[Candidate]:
        return [Candidate("q2tp", 200, 1.0 * scale), Candidate("q4tp", 400, 0.1 * scale)]

    # the same relative errors: room for one upgrade goes to the matrix the output feels more
    assert allocate({"a": ladder(1.0), "b": ladder(3.0)}, 0, 600).choice == {"a": "q2tp", "b": "q4tp"}
    assert allocate({"a": ladder(3.0), "b": ladder(1.0)}, 0, 600).choice == {"a": "q4tp", "b": "q2tp"}


def test_sensitivity_tokens_default_and_refusal():
    assert sensitivity_tokens_for(None, 10.0, None) == calib.DEFAULT_SENSITIVITY_TOKENS
    assert sensitivity_tokens_for(None, None, 4.5) == calib.DEFAULT_SENSITIVITY_TOKENS
    assert sensitivity_tokens_for(None, None, None) == 0
    assert sensitivity_tokens_for(0, 10.0, None) == 0
    assert sensitivity_tokens_for(64, None, None) == 64
    with pytest.raises(calib.CalibrationError, match="--sensitivity-tokens -1 must be >= 0"):
        sensitivity_tokens_for(-1, 10.0, None)


@needs_text
def test_requant_cli_refuses_a_negative_sample(base_f32, tmp_path):
    out = tmp_path / "y.cmf"
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "requant", str(base_f32), "-o", str(out), "--quant", "q4tp",
                        "--calib", str(CALIB_TEXT), "--target-mb", "3", "--sensitivity-tokens", "-1"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--sensitivity-tokens -1 must be >= 0" in r.stderr
    assert not out.exists()


@needs_text
def test_requant_to_a_target_with_calib_measures_sensitivity_by_default(base_f32, tmp_path, monkeypatch):
    """The default flow: --calib with a target size measures every matrix (128 tokens) and the
    file still fits; --sensitivity-tokens 0 skips the measurement."""
    import cmf.calib.sensitivity as sensitivity
    from cmf.tools.requant import requant

    calls = []
    real = sensitivity.measure

    def spy(*a, **k):
        calls.append(k["tokens"])
        return real(*a, **k)

    monkeypatch.setattr(sensitivity, "measure", spy)
    with cmf.load(base_f32) as m:
        n = sum(t.numel for t in m.file.tensors())
    out = tmp_path / "six.cmf"
    requant(base_f32, out, quant="q4tp", calib=CALIB_TEXT, calib_tokens=1024, bpw=6.0)
    assert calls == [calib.DEFAULT_SENSITIVITY_TOKENS]
    assert out.stat().st_size <= 6.0 * n / 8
    with cmf.load(out) as m:
        kinds = {t.dtype.label for t in m.file.tensors() if len(t.shape) == 2}
    assert len(kinds & {"q4tp", "vbit", "q8_row", "q2tp"}) >= 2  # a mix, not one rung everywhere
    requant(base_f32, tmp_path / "off.cmf", quant="q4tp", calib=CALIB_TEXT, calib_tokens=1024, bpw=6.0,
            sensitivity_tokens=0)
    assert calls == [calib.DEFAULT_SENSITIVITY_TOKENS]
