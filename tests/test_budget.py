"""Target-size quantization (--target-mb / --bpw, cmf.convert.budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cmf.convert.budget import (LADDER, Candidate, above_floor, allocate, candidates, ladder_floor, plan_budget,
                                relative_loss, target_bytes)
from cmf.convert.errors import ConvertError
from cmf.format.errors import WriterError
from cmf.format.reader import open as cmf_open

from _shared_models import BASE, SHARED, base_f32  # noqa: F401 - the fixture



def ladder(loss2: float, loss4: float, loss8: float, n: int = 100) -> list[Candidate]:
    return [Candidate("q2tp", 2 * n, loss2), Candidate("q4tp", 4 * n, loss4), Candidate("q8_row", 8 * n, loss8)]


def test_allocate_spends_bytes_where_they_remove_most_loss():
    cands = {"a": ladder(1.0, 0.1, 0.01), "b": ladder(0.2, 0.15, 0.14), "c": ladder(0.5, 0.05, 0.0)}
    # the cheapest file: every matrix q2tp
    p = allocate(cands, 50, 50 + 600)
    assert p.choice == {"a": "q2tp", "b": "q2tp", "c": "q2tp"} and p.bytes == 650
    # 400 more bytes: a and c go to 4 bits (0.9 and 0.45 removed for 200 each), b stays
    p = allocate(cands, 50, 50 + 1000)
    assert p.choice == {"a": "q4tp", "b": "q2tp", "c": "q4tp"} and p.bytes == 1050
    assert p.loss == pytest.approx(0.1 + 0.2 + 0.05)
    # everything fits at 8 bits
    p = allocate(cands, 0, 10_000)
    assert set(p.choice.values()) == {"q8_row"}
    with pytest.raises(ConvertError, match="below the smallest file this model can be"):
        allocate(cands, 50, 500)


def test_allocate_takes_a_smaller_step_when_the_jump_does_not_fit():
    # q2 -> q8 removes the most loss per byte, but only q2 -> q4 fits
    cands = {"a": [Candidate("q2tp", 200, 1.0), Candidate("q4tp", 400, 0.9), Candidate("q8_row", 800, 0.0)]}
    assert allocate(cands, 0, 500).choice == {"a": "q4tp"}


def test_allocate_exchanges_small_upgrades_for_a_larger_better_one():
    # the greedy takes b (ratio 0.1), then a's jump (ratio 0.05) no longer fits and c's weak step
    # (0.02) takes the rest: loss 10. Stepping b and c back down pays for a: loss 5 + 1 = 6.
    cands = {"a": [Candidate("q2tp", 100, 10.0), Candidate("q8_row", 300, 0.0)],
             "b": [Candidate("q2tp", 100, 5.0), Candidate("q4tp", 150, 0.0)],
             "c": [Candidate("q2tp", 100, 1.0), Candidate("q4tp", 150, 0.0)]}
    p = allocate(cands, 0, 500)
    assert p.choice == {"a": "q8_row", "b": "q2tp", "c": "q2tp"}
    assert p.loss == pytest.approx(6.0) and p.bytes == 500
    # with 50 bytes more, a's jump and one of the small steps fit: the one removing more (b)
    p = allocate(cands, 0, 550)
    assert p.choice == {"a": "q8_row", "b": "q4tp", "c": "q2tp"} and p.loss == pytest.approx(1.0)
    # no exchange when the steps down would cost more than the jump removes
    cands["a"][0] = Candidate("q2tp", 100, 5.5)
    assert allocate(cands, 0, 500).choice == {"a": "q2tp", "b": "q4tp", "c": "q4tp"}


def test_budget_spends_the_padding_the_exact_layout_does_not_need():
    from cmf.convert.budget import worst_padding
    from cmf.format.spool import data_span

    # two 16 KiB payloads after a small one, packed (every payload on 64 bytes): the worst case
    # reserves 63 bytes a payload, the exact layout pads only the 100-byte norm (28 bytes)
    cands = {n: [Candidate("q2tp", 16384, 1.0), Candidate("q4tp", 20480, 0.1 if n == "a" else 0.2)] for n in "ab"}
    layout = [("norm", 100), ("a", None), ("b", None)]
    reserved = worst_padding([100, 16384, 16384])
    assert reserved == 3 * 63
    budget = 36900  # payloads alone: 32868 at q2tp, one upgrade is 4096 more
    items = [(n, None, {}) for n in "ab"]
    assert plan_budget(items, 100, budget, cache=dict(cands)).choice == {"a": "q2tp", "b": "q2tp"}
    p = plan_budget(items, 100, budget, cache=dict(cands), layout=layout, reserved=reserved)
    # the exact layout (a at 128, b right after it) leaves room for a's upgrade, not for both
    assert p.choice == {"a": "q4tp", "b": "q2tp"}
    assert data_span([100, 20480, 16384], packed=True) <= budget + reserved < data_span([100, 20480, 20480], packed=True)
    # not packed (the default writer's layout) the large payloads start on a page
    assert data_span([100, 20480, 16384]) == 4096 + 20480 + 16384
    assert worst_padding([100, 16384], packed=False) == 63 + 4095


def test_no_matrix_goes_below_the_budgets_uniform_level(monkeypatch):
    import cmf.convert.budget as budget

    # a: q2tp predicted almost free; b: sensitive. 1250 bytes fit both at q4tp (900) but not at q8 (1700)
    cands = {"a": ladder(0.11, 0.1, 0.0), "b": ladder(2.0, 0.5, 0.0)}
    rung = {r.label: k for k, r in enumerate(LADDER)}
    assert ladder_floor(cands, 100, 1250) == rung["q4tp"]  # q4tp for everyone fits, nothing above does
    assert ladder_floor(cands, 100, 700) == 0
    assert ladder_floor(cands, 0, 10_000) == len(LADDER) - 1  # q8_row for everyone
    # without the floor the knapsack leaves a at q2tp and buys b's q8; with it a stays at q4tp
    assert allocate(cands, 100, 1250).choice == {"a": "q2tp", "b": "q8_row"}
    floored = above_floor(cands, rung["q4tp"])
    assert [c.name for c in floored["a"]] == ["q4tp", "q8_row"] and cands["a"][0].name == "q2tp"  # not mutated
    assert allocate(floored, 100, 1250).choice == {"a": "q4tp", "b": "q4tp"}
    items = [(n, (lambda: np.zeros((2, 32), np.float32)), {}) for n in cands]
    # a floor at q4tp is a tight budget: the plan takes every rung
    assert plan_budget(items, 100, 1250, cache={n: list(c) for n, c in cands.items()}).choice == {
        "a": "q2tp", "b": "q8_row"}
    # a loose one (every matrix fits vbit 5) keeps the floor: a at vbit 5, not q4tp for b's q8_row
    v5 = {"a": 0.05, "b": 0.2}
    loose = {n: c[:2] + [Candidate("vbit", 600, v5[n], {"mean_bits": 5.0}, "vbit5")] + c[2:] for n, c in cands.items()}
    assert ladder_floor(loose, 100, 1300) == rung["vbit5"]
    assert plan_budget(items, 100, 1300, cache={n: list(c) for n, c in loose.items()}).choice == {
        "a": "vbit5", "b": "vbit5"}
    monkeypatch.setattr(budget, "FLOOR", False)
    assert plan_budget(items, 100, 1300, cache={n: list(c) for n, c in loose.items()}).choice == {
        "a": "q4tp", "b": "q8_row"}
    # an item off the ladder (the token table's rungs) is left as it is
    table = [Candidate("q8_row", 500, 0.01, label="q8_row"), Candidate("vbit", 530, 0.001, label="vbit8")]
    assert above_floor({"t": table}, 3)["t"] == table


def test_the_ladder_measures_every_rung_and_vbit_fills_the_gap():
    """Six rungs, each smaller and lossier than the next; the vbit rungs carry their mean bits
    to the encoder, and a budget between q2tp and q4tp or between q4tp and q8_row can end on one
    of them."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((128, 256)) * 0.02).astype(np.float32)
    c = candidates(w, None, {})
    assert [x.name for x in c] == [r.label for r in LADDER] == ["q2tp", "vbit3", "q4tp", "vbit5", "vbit6", "q8_row"]
    assert [x.options for x in c] == [{}, {"mean_bits": 3.0}, {}, {"mean_bits": 5.0}, {"mean_bits": 6.0}, {}]
    assert all(a.nbytes < b.nbytes and a.loss > b.loss for a, b in zip(c, c[1:]))
    bits = [8 * x.nbytes / w.size for x in c]
    assert 2.0 < bits[0] < 3.0 < bits[1] < 4.0 < bits[2] < 5.0 < bits[3] < 6.0 < bits[4] < 7.0 < bits[5], bits
    for k in (1, 3):
        p = allocate({"a": c}, 0, c[k].nbytes + 10)
        assert p.choice == {"a": c[k].name} and p.picked["a"].dtype == "vbit" and p.bytes == c[k].nbytes


def test_target_and_loss_helpers():
    assert target_bytes(12.5, None, 0) == 12_500_000
    assert target_bytes(None, 4.0, 1_000_000) == 500_000
    for bad in ((None, None), (1.0, 4.0)):
        with pytest.raises(ConvertError, match="one of --target-mb and --bpw"):
            target_bytes(*bad, 10)
    with pytest.raises(ConvertError, match="outside 1..32"):
        target_bytes(None, 0.5, 10)
    w = np.arange(12, dtype=np.float64).reshape(3, 4)
    assert relative_loss(w, w, None) == 0.0
    assert relative_loss(w, np.zeros_like(w), np.eye(4)) == pytest.approx(1.0)


def _payload_bytes(path: Path) -> tuple[int, dict[str, int]]:
    with cmf_open(path) as f:
        counts: dict[str, int] = {}
        for t in f.tensors():
            counts[t.dtype.label] = counts.get(t.dtype.label, 0) + 1
        return sum(t.nbytes for t in f.tensors()), counts


def _gaps(path: Path) -> list[int]:
    """The zero padding before each payload after the first, in file order."""
    with cmf_open(path) as f:
        ts = sorted(f.tensors(), key=lambda t: t.offset)
        assert all(t.offset % 64 == 0 for t in ts)
        return [b.offset - a.offset - a.nbytes for a, b in zip(ts, ts[1:])]


def test_requant_to_a_target_size_fits_and_mixes_the_ladder(base_f32, tmp_path):
    from cmf.tools.requant import requant

    q4, q8 = tmp_path / "q4.cmf", tmp_path / "q8.cmf"
    requant(base_f32, q4, quant="q4tp")
    requant(base_f32, q8, quant="q8")
    b4, b8 = _payload_bytes(q4)[0], _payload_bytes(q8)[0]
    target = (b4 + b8) / 2
    out = tmp_path / "mid.cmf"
    rep = requant(base_f32, out, quant="q4tp", target_mb=target / 1e6)
    got, counts = _payload_bytes(out)
    assert b4 < got and out.stat().st_size <= target  # the whole file fits
    # and fills it: the padding the exact layout does not need is spent (it was 3-5% of a 3 MB file)
    assert target - out.stat().st_size < 0.02 * target
    assert counts.get("q8_row", 0) + counts.get("vbit", 0) > 1  # rungs above 4 bits
    assert {e["reason"] for e in rep["entries"]} >= {"budget"}
    # packed: no payload waits for a page (the plain rewrite puts its large ones on 4096)
    assert max(_gaps(out)) < 64 and max(_gaps(q4)) >= 64
    with cmf_open(out) as f:
        assert f.verify() == []
        assert f.header.to_dict()["provenance"]["options"]["budget"]["bytes"] <= target
    # --bpw: the same machinery, in bits per weight over all tensors
    with cmf_open(base_f32) as f:
        n = sum(t.numel for t in f.tensors())
    bpw = round(8 * target / n, 2)
    out2 = tmp_path / "bpw.cmf"
    requant(base_f32, out2, quant="q4tp", bpw=bpw)
    assert b4 < _payload_bytes(out2)[0] and out2.stat().st_size <= bpw * n / 8


def test_target_size_refusals(base_f32, tmp_path):
    from cmf.tools.requant import requant

    with pytest.raises(WriterError, match="not --in-place"):
        requant(base_f32, quant="q4tp", in_place=True, target_mb=1.0)
    with pytest.raises(ConvertError, match="below the smallest file"):
        requant(base_f32, tmp_path / "x.cmf", quant="q4tp", target_mb=0.1)
    assert not (tmp_path / "x.cmf").exists()
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "requant", str(base_f32), "-o", str(tmp_path / "y.cmf"),
                        "--quant", "q4tp", "--target-mb", "3", "--bpw", "4"], capture_output=True, text=True)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_convert_to_a_target_size_fits_the_whole_file(base_f32, tmp_path):
    """``convert --target-mb``: the dtypes are chosen from the source before anything is written,
    and the whole output (header, directory, vocab, padding) fits."""
    from cmf.cli import main as cli
    from cmf.convert import convert

    q4, q8 = tmp_path / "q4.cmf", tmp_path / "q8.cmf"
    convert(BASE, q4, "q4tp")
    convert(BASE, q8, "q8")
    target = (q4.stat().st_size + q8.stat().st_size) / 2
    out = tmp_path / "mid.cmf"
    assert cli(["convert", "-m", str(BASE), "-o", str(out), "--quant", "q4tp", "--target-mb", str(target / 1e6)]) == 0
    got, counts = _payload_bytes(out)
    assert q4.stat().st_size < out.stat().st_size <= target
    assert target - out.stat().st_size < 0.02 * target
    assert counts.get("q8_row", 0) + counts.get("vbit", 0) > 1  # rungs above 4 bits
    assert max(_gaps(out)) < 64 and max(_gaps(q4)) >= 64  # packed, unlike the plain conversion
    with cmf_open(out) as f:
        assert f.verify() == []
        budget = f.header.to_dict()["provenance"]["options"]["budget"]
        assert budget["bytes"] <= target and set(budget["matrices"]) <= {r.label for r in LADDER}
        assert len(budget["matrices"]) >= 2  # a mix of rungs, not one dtype everywhere
    # --bpw through the API
    out2 = tmp_path / "bpw.cmf"
    with cmf_open(base_f32) as f:
        n = sum(t.numel for t in f.tensors())
    convert(BASE, out2, "q4tp", bpw=5.0)
    assert out2.stat().st_size <= 5.0 * n / 8


def test_convert_target_size_refusals(tmp_path):
    from cmf.convert import convert

    if not (BASE / "model.safetensors").exists():
        pytest.skip("../shared/models/base not present")
    with pytest.raises(ConvertError, match="below the smallest file"):
        convert(BASE, tmp_path / "x.cmf", "q4tp", target_mb=0.1)
    with pytest.raises(ConvertError, match="cannot be combined with --shard-max-gb"):
        convert(BASE, tmp_path / "y.cmf", "q4tp", target_mb=3.0, shard_max_gb=0.001)
    with pytest.raises(ConvertError, match="must be positive"):
        convert(BASE, tmp_path / "z.cmf", "q4tp", target_mb=-1.0)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp files left
    r = subprocess.run([sys.executable, "-m", "cmf.cli", "import-gguf", str(tmp_path / "missing.gguf"), "-o",
                        str(tmp_path / "g.cmf"), "--bpw", "0.5"], capture_output=True, text=True)
    assert r.returncode != 0 and "--bpw 0.5 is outside 1..32" in r.stderr and "Traceback" not in r.stderr


def test_the_tables_rungs_below_8_bits_are_for_tight_budgets_only():
    """Above a q4tp floor the table stays at 8 bits (q8_row or vbit 8); a budget whose floor is at
    q4tp or lower may also take it to vbit 5 or 6 for its matrices (docs/QUANT.md)."""
    from cmf.convert.budget import _table_at_8_bits, _tight

    table = [Candidate("vbit", 300, 0.05, {"mean_bits": 5.0}, "vbit5"),
             Candidate("vbit", 360, 0.02, {"mean_bits": 6.0}, "vbit6"),
             Candidate("q8_row", 480, 0.01, label="q8_row"), Candidate("vbit", 500, 0.001, {"mean_bits": 8.0}, "vbit8")]
    cands = {"a": ladder(0.5, 0.1, 0.0), "t": table}
    assert _tight(cands, 0, 880) and not _tight(cands, 0, 1300)
    eight = _table_at_8_bits(cands)
    assert [c.name for c in eight["t"]] == ["q8_row", "vbit8"] and eight["a"] == cands["a"]
    # the loose budget's plan: a at q8_row and the table at 8 bits, not the table at vbit 6 for the matrix
    items = [(n, (lambda: np.zeros((2, 32), np.float32)), {}) for n in cands]
    assert plan_budget(items, 0, 1300, cache={n: list(c) for n, c in cands.items()}).choice == {"a": "q8_row", "t": "vbit8"}
    assert plan_budget(items, 0, 880, cache={n: list(c) for n, c in cands.items()}).choice == {"a": "q4tp", "t": "q8_row"}
