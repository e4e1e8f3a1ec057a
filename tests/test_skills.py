"""Skills in the runtime (spec §9): tensor indirection, cheap switching, blends, routing.

A 4-layer f32 base and two donors: "a" differs in layers 1-2, "b" in layers 2-3. Grafting all
changed tensors must reproduce each donor's logits exactly; the backbone must stay the base.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import skill_fixtures as SF  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.format.errors import CmfError, NotRunnable  # noqa: E402
from cmf.format.growth import append  # noqa: E402
from cmf.runtime.model import UnknownSkill  # noqa: E402
from cmf.runtime.routing import (Subspace, auto_blend, fit_selection, normalize_blend, parse_blend,  # noqa: E402
                                 recon_error)
from cmf.tools._skill_graft import add_skill  # noqa: E402

IDS = [5, 17, 42, 9, 88, 21, 130, 7, 64, 300, 12, 19]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    w = tmp_path_factory.mktemp("skills")
    base = SF.build_base(w / "base")
    da = SF.build_donor(base, w / "da", (1, 2), seed=11)
    db = SF.build_donor(base, w / "db", (2, 3), seed=12)
    out = {}
    for key, src in (("base", base), ("a", da), ("b", db)):
        out[key] = w / f"{key}.cmf"
        convert(src, out[key], quant="f32")
    (w / "pa.txt").write_text("\n".join(SF.word_prompts(16, 1)))
    (w / "pb.txt").write_text("\n".join(SF.digit_prompts(16, 2)))
    out["swarm"] = w / "swarm.cmf"
    add_skill(out["base"], da, "a", tensors="all", prompts=w / "pa.txt", output=out["swarm"])
    add_skill(out["swarm"], out["b"], "b", tensors="all", prompts=w / "pb.txt", in_place=True)
    return out


def logits(path, **kw):
    with cmf.load(path, **kw) as m:
        return m.logits(IDS)


@pytest.fixture(scope="module")
def ref(files):
    return {k: logits(files[k]) for k in ("base", "a", "b")}


def test_skill_reproduces_donor_and_none_reproduces_base(files, ref):
    np.testing.assert_array_equal(logits(files["swarm"], skill="a"), ref["a"])
    np.testing.assert_array_equal(logits(files["swarm"], skill="b"), ref["b"])
    np.testing.assert_array_equal(logits(files["swarm"], skill="none"), ref["base"])
    np.testing.assert_array_equal(logits(files["swarm"]), ref["base"])


def test_two_skills_do_not_interfere_and_switching_is_exact(files, ref):
    with cmf.load(files["swarm"]) as m:
        for sid in ["a", "b", None, "b", "a", "none", "a"]:
            m.select(skill=sid)
            np.testing.assert_array_equal(m.logits(IDS), ref[sid if sid not in (None, "none") else "base"])


def test_switch_re_prepares_only_touched_layers(files):
    with cmf.load(files["swarm"]) as m:
        before = list(m._blocks)
        head = m._lm_head
        m.select(skill="a")  # layers 1-2
        assert [b is o for b, o in zip(m._blocks, before)] == [True, False, False, True]
        assert m._lm_head is head
        mid = list(m._blocks)
        m.select(skill="b")  # leaves 1-2, enters 2-3: layer 0 untouched
        assert [b is o for b, o in zip(m._blocks, mid)] == [True, False, False, False]
        again = list(m._blocks)
        m.select(skill="b")  # the same selection: nothing re-prepared
        assert all(b is o for b, o in zip(m._blocks, again))


def test_unknown_skill_and_select_keeps_selection(files):
    with pytest.raises(UnknownSkill):
        cmf.load(files["swarm"], skill="nope")
    with cmf.load(files["swarm"], skill="a") as m:
        m.select(task=None)  # skill left out: the selection stays
        assert m.skill == "a"
        with pytest.raises(UnknownSkill):
            m.select(skill="nope")
        with pytest.raises(UnknownSkill):
            m.select(blend={"nope": 1.0})
        with pytest.raises(CmfError):
            m.select(blend={"a": -1.0})
        with pytest.raises(ValueError):
            m.select(skill="a", blend={"b": 1.0})


def test_blend_weight_one_is_that_skill(files, ref):
    with cmf.load(files["swarm"]) as m:
        m.select(blend={"a": 1.0, "b": 0.0})
        assert m.skill == "a" and m.blend is None  # no tensor materialized
        np.testing.assert_array_equal(m.logits(IDS), ref["a"])
        m.select(blend="a:3")
        np.testing.assert_array_equal(m.logits(IDS), ref["a"])


def test_half_blend_equals_a_skill_holding_the_mean(files, tmp_path):
    """Σ wᵢ·Tᵢ: a blend a:1,b:1 equals a third skill whose tensors are (T_a + T_b)/2, where T is
    the skill's replacement or the backbone tensor."""
    mixed = tmp_path / "mixed.cmf"
    mixed.write_bytes(files["swarm"].read_bytes())
    with cmf.open(mixed) as f:
        names = {n.split(".", 2)[2] for n in f.keys() if n.startswith("skill.")}
        tensors = []
        for n in sorted(names):
            ta = f.array(f"skill.a.{n}") if f"skill.a.{n}" in f else f.array(n)
            tb = f.array(f"skill.b.{n}") if f"skill.b.{n}" in f else f.array(n)
            mean = np.float32(0.5) * ta + np.float32(0.5) * tb
            tensors.append((f"skill.mix.{n}", "f32", mean.shape, np.ascontiguousarray(mean, "<f4").tobytes()))
        skills = [dict(s.raw) for s in f.skills] + [{"id": "mix"}]
    append(mixed, tensors, {"skills": skills})
    with cmf.load(mixed, reference_kernels=True) as m:
        m.select(blend={"a": 1, "b": 1})
        assert m.blend == {"a": 0.5, "b": 0.5}
        blended = m.logits(IDS)
        assert m.weights.blended_bytes > 0
        m.select(skill="mix")
        np.testing.assert_allclose(blended, m.logits(IDS), rtol=1e-5, atol=1e-5)
        m.select(skill=None)
        assert m.weights.blended_bytes == 0


def test_blend_with_backbone_component(files, ref):
    with cmf.load(files["swarm"], blend={"a": 0.5, "none": 0.5}) as m:
        got = m.logits(IDS)
    assert not np.array_equal(got, ref["a"]) and not np.array_equal(got, ref["base"])
    assert np.abs(got - ref["base"]).max() < np.abs(ref["a"] - ref["base"]).max()


def test_routing_picks_the_right_skill_on_held_out_prompts(files):
    with cmf.load(files["swarm"]) as m:
        for p in SF.word_prompts(8, 100):
            assert m.route(p).winner == "a"
        for p in SF.digit_prompts(8, 200):
            assert m.route(p).winner == "b"


def test_skill_auto_routes_each_prompt(files):
    with cmf.load(files["swarm"], skill="auto") as m:
        assert m.auto == "skill"
        m.generate(SF.digit_prompts(1, 7)[0], max_tokens=2, raw=True)
        assert m.skill == "b" and m.last_route.winner == "b"
        m.generate(SF.word_prompts(1, 7)[0], max_tokens=2, raw=True)
        assert m.skill == "a"
        r = m.select(skill="auto", route_prompt=SF.digit_prompts(1, 8)[0])
        assert r.winner == "b" and m.skill == "b"
        m.select(skill=None)
        assert m.auto is None and m.skill is None


def test_blend_auto_takes_top_two(files):
    with cmf.load(files["swarm"], blend="auto") as m:
        r = m.route_select(SF.word_prompts(1, 9)[0])
        assert set(r.blend) == {"a", "b"} and abs(sum(r.blend.values()) - 1) < 1e-12
        assert r.blend["a"] > r.blend["b"] and m.blend == r.blend


def test_routing_uses_the_backbone_phi_whatever_is_active(files):
    p = SF.word_prompts(1, 5)[0]
    with cmf.load(files["swarm"]) as m:
        base = m.route(p).scores
        m.select(skill="a")
        assert m.route(p).scores == base
        m.select(blend={"a": 1, "b": 2})
        assert m.route(p).scores == base


def test_no_routable_skill_runs_the_backbone(files, ref, tmp_path):
    plain = tmp_path / "plain.cmf"
    plain.write_bytes(files["swarm"].read_bytes())
    with cmf.open(plain) as f:
        skills = [{k: v for k, v in s.raw.items() if k != "selection"} for s in f.skills]
    append(plain, (), {"skills": skills})
    with cmf.load(plain, skill="auto") as m:
        r = m.select(skill="auto", route_prompt="model tensor")
        assert r.winner is None and r.scores == {} and m.skill is None
        np.testing.assert_array_equal(m.logits(IDS), ref["base"])


def test_skill_file_is_refused_with_apply_hint(files, tmp_path):
    from cmf.tools._skill_file import export_skill

    out = tmp_path / "a.skill.cmf"
    export_skill(files["a"], files["base"], "a", out)
    with pytest.raises(NotRunnable, match="cmf skill apply"):
        cmf.load(out)


# ----------------------------------------------------------------------------- routing numerics


def test_fit_selection_recovers_a_subspace():
    rng = np.random.default_rng(0)
    h = 32
    basis = np.linalg.qr(rng.standard_normal((h, 2)))[0].T  # 2 orthonormal directions
    mean = rng.standard_normal(h) * 3
    phis = mean + rng.standard_normal((40, 2)) @ basis * 2
    sel = fit_selection(phis, phi_layer=1, rank=2)
    assert sel["rank"] == 2 and sel["metric"] == "mse" and sel["err_mean"] < 1e-4
    sub = Subspace.from_record("x", sel, h, 4)
    assert abs(recon_error(phis[0], sub)) < 1e-4
    off = mean + rng.standard_normal(h) * 2
    assert recon_error(off, sub) > 0.05
    # rank is capped by N-1 and 8
    assert fit_selection(phis[:3], phi_layer=0, rank=5)["rank"] == 2
    assert fit_selection(phis, phi_layer=0, rank=20)["rank"] == 8
    one = fit_selection(phis[:1], phi_layer=0)
    assert one["rank"] == 0 and one["basis"] == ""


def test_recon_error_definition_and_mse_unit():
    mean = np.array([1.0, 0.0, 0.0], np.float32)
    basis = np.array([[0.0, 1.0, 0.0]], np.float32)
    sub = Subspace("s", "mse", 0, mean, basis)
    phi = np.array([1.0, 2.0, 3.0])
    # r = (0, 2, 3); ||r||^2 = 13, projection 4 -> raw 9; / ||phi||^2 = 14
    assert recon_error(phi, sub) == pytest.approx(9 / 14)
    unit = Subspace("s", "mse_unit", 0, mean, basis)
    u = phi / np.linalg.norm(phi)
    r = u - mean
    assert recon_error(phi, unit) == pytest.approx(float(r @ r - (r[1]) ** 2))


def test_blend_helpers():
    w = auto_blend({"a": 0.1, "b": 0.5, "c": 0.9})
    assert set(w) == {"a", "b"} and w["a"] / w["b"] == pytest.approx(np.exp(0.4 / 0.4))
    assert auto_blend({}) == {}
    assert parse_blend("auto") == "auto" and parse_blend("a:1, b:3") == {"a": 1.0, "b": 3.0}
    assert normalize_blend({"a": 1, "none": 3}, ["a"]) == {"a": 0.25, None: 0.75}
    for bad in ("a", "a:x", ":1"):
        with pytest.raises(CmfError):
            parse_blend(bad)
    with pytest.raises(CmfError):
        normalize_blend({"a": -1}, ["a"])
    with pytest.raises(CmfError):
        normalize_blend({"a": 0}, ["a"])
