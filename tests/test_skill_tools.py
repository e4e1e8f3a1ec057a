"""``cmf skill add|list|remove|export|apply``, ``cmf route``, ``cmf explain`` (spec §9, §9.1).

Append-only growth keeps every old byte; a crash at any write leaves the old or the new file;
compaction keeps the tensors; export → apply gives the specialist back byte for byte.
"""

from __future__ import annotations

import filecmp
import functools
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

import skill_fixtures as SF  # noqa: E402

import cmf  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.format import growth  # noqa: E402
from cmf.format.errors import SkillBaseMismatch  # noqa: E402
from cmf.tools import _skill_graft  # noqa: E402
from cmf.tools._skill_file import apply_skill, export_skill  # noqa: E402
from cmf.tools._skill_graft import SkillError, add_skill, list_skills, parse_layers, remove_skill  # noqa: E402


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = tmp_path_factory.mktemp("skilltools")
    base = SF.build_base(w / "base")
    SF.build_donor(base, w / "da", (1, 2), seed=11)
    SF.build_donor(base, w / "db", (2, 3), seed=12)
    for key in ("base", "da", "db"):
        convert(w / key, w / f"{key}.cmf", quant="f32")
    convert(base, w / "base16.cmf", quant="f16")
    (w / "pa.txt").write_text("\n".join(SF.word_prompts(12, 1)))
    (w / "pb.txt").write_text("\n".join(SF.digit_prompts(12, 2)))
    (w / "held.txt").write_text("\n\n".join(" ".join(SF.word_prompts(6, 50 + i)) for i in range(8)))
    return w


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_add_grafts_only_differing_tensors_of_chosen_layers(w, tmp_path):
    out = tmp_path / "s.cmf"
    before = (w / "base.cmf").read_bytes()
    d = add_skill(w / "base.cmf", w / "da", "rust", name="Rust", layers="all", tensors="ffn", output=out)
    assert (w / "base.cmf").read_bytes() == before  # -o leaves the base alone
    assert {r["layer"] for r in d["tensors"]} == {1, 2}
    with cmf.open(out) as f, cmf.open(w / "da.cmf") as donor:
        names = [n for n in f.keys() if n.startswith("skill.")]
        assert len(names) == 6 and all(".mlp." in n for n in names)
        for n in names:  # full shape, the base's dtype (f32): the donor's bytes exactly
            assert f.tensor(n).hash == donor.tensor(n[len("skill.rust."):]).hash
        rec = f.skills[0]
        assert rec.id == "rust" and rec.name == "Rust" and rec.layers == (1, 2) and rec.selection is None
        assert not f.verify()
    d2 = add_skill(w / "base.cmf", w / "da", "x", layers="2-3", tensors="attn", output=tmp_path / "t.cmf")
    assert {r["layer"] for r in d2["tensors"]} == {2} and all(".self_attn." in r["tensor"] for r in d2["tensors"])


def test_add_refusals(w, tmp_path):
    with pytest.raises(SkillError, match="A-Z"):
        add_skill(w / "base.cmf", w / "da", "bad id", output=tmp_path / "x.cmf")
    with pytest.raises(SkillError, match="does not differ"):
        add_skill(w / "base.cmf", w / "da", "z", layers="0,3", output=tmp_path / "x.cmf")
    with pytest.raises(SkillError, match="either"):
        add_skill(w / "base.cmf", w / "da", "z")
    with pytest.raises(SkillError):
        parse_layers("7", 4)
    assert parse_layers("0-1,3", 4) == {0, 1, 3}
    s = tmp_path / "s.cmf"
    add_skill(w / "base.cmf", w / "da", "dup", output=s)
    with pytest.raises(SkillError, match="already"):
        add_skill(s, w / "da", "dup", in_place=True)


def test_min_delta_and_skill_quant(w, tmp_path):
    d = add_skill(w / "base.cmf", w / "da.cmf", "q", tensors="all", skill_quant="q8", output=tmp_path / "q.cmf")
    dtypes = {r["tensor"]: r["dtype"] for r in d["tensors"]}
    assert dtypes["model.layers.1.mlp.up_proj.weight"] == "q8_row"
    assert dtypes["model.layers.1.input_layernorm.weight"] == "f16"  # 1-D: the converter's rule
    deltas = sorted(r["delta"] for r in d["tensors"])
    cut = deltas[len(deltas) // 2]
    d2 = add_skill(w / "base.cmf", w / "da.cmf", "q", tensors="all", min_delta=cut, output=tmp_path / "q2.cmf")
    assert 0 < len(d2["tensors"]) < len(d["tensors"]) and min(r["delta"] for r in d2["tensors"]) > cut


def test_in_place_is_append_only_and_compacts(w, tmp_path):
    path = tmp_path / "m.cmf"
    shutil.copy(w / "base.cmf", path)
    old = path.read_bytes()
    d = add_skill(path, w / "da", "rust", tensors="all", prompts=w / "pa.txt", in_place=True)
    new = path.read_bytes()
    assert len(new) > len(old)
    assert new[128:len(old)] == old[128:]  # every byte after the envelope is where it was
    with cmf.open(path) as f, cmf.open(w / "base.cmf") as b:
        assert not f.verify()
        for t in b.tensors():  # backbone tensors: same offsets, same bytes
            assert f.tensor(t.name).offset == t.offset and f.tensor(t.name).hash == t.hash
        assert f.skills[0].selection["rank"] == 2 and len(d["tensors"]) == 22
    assert main(["compact", str(path), "-o", str(tmp_path / "c.cmf")]) == 0
    with cmf.open(path) as f, cmf.open(tmp_path / "c.cmf") as c:
        assert [(t.name, t.hash) for t in f.tensors()] == [(t.name, t.hash) for t in c.tensors()]
        assert c.header.skills == f.header.skills and not c.verify()
    assert (tmp_path / "c.cmf").stat().st_size < path.stat().st_size


class Crash(Exception):
    pass


class CrashingOps(growth.FileOps):
    """FileOps that die at the ``after``-th write or fsync (a data write is torn first)."""

    def __init__(self, fd: int, after: int) -> None:
        super().__init__(fd)
        self.left = after

    def _tick(self) -> None:
        if self.left == 0:
            raise Crash()
        self.left -= 1

    def pwrite(self, data, offset):
        self._tick()
        # Tear this write in half, then die; the 128-byte envelope write is one sector and
        # atomic on real storage (growth.py's durability model), so it lands whole or not at all.
        if len(data) > 1 and self.left == 0 and offset != 0:
            super().pwrite(memoryview(data)[:len(data) // 2], offset)
            raise Crash()
        super().pwrite(data, offset)

    def fsync(self):
        self._tick()
        super().fsync()


def test_crash_at_every_step_leaves_old_or_new_file(w, tmp_path, monkeypatch):
    ref = tmp_path / "ref.cmf"
    shutil.copy(w / "base.cmf", ref)
    add_skill(ref, w / "da", "rust", in_place=True)
    with cmf.open(ref) as f:
        new_tensors = {t.name: t.hash for t in f.tensors()}
    with cmf.open(w / "base.cmf") as f:
        old_tensors = {t.name: t.hash for t in f.tensors()}
    seen = set()
    for after in range(40):
        path = tmp_path / f"c{after}.cmf"
        shutil.copy(w / "base.cmf", path)
        ops = functools.partial(CrashingOps, after=after)
        monkeypatch.setattr(_skill_graft, "append", functools.partial(growth.append, ops_factory=ops))
        try:
            add_skill(path, w / "da", "rust", in_place=True)
            crashed = False
        except Crash:
            crashed = True
        with cmf.open(path) as f:
            got = {t.name: t.hash for t in f.tensors()}
            assert not f.verify()
            assert got in (old_tensors, new_tensors)
            seen.add("new" if got == new_tensors else "old")
        if not crashed:
            break
    assert seen == {"old", "new"}


def test_quality_is_measured_and_listed(w, tmp_path, capsys):
    out = tmp_path / "q.cmf"
    d = add_skill(w / "base.cmf", w / "da", "rust", quality=w / "held.txt", quality_tokens=64, output=out)
    q = d["record"]["quality"]
    assert q["metric"] == "ppl" and q["file"] == "held.txt" and q["tokens"] > 0 and q["masked"] is False
    assert q["backbone"] != q["overlaid"] and len(q["dataset_sha256"]) == 64
    with cmf.open(out) as f:
        assert f.skills[0].quality == q and not f.verify()
    rows = list_skills(out)
    assert rows[0]["tensors"] == 6 and rows[0]["layers"] == [1, 2] and rows[0]["routable"] is False
    code, text, _ = cli(capsys, "skill", "list", out)
    assert code == 0 and "rust" in text and "ppl" in text and "1-2" in text


def test_remove_rewrites_without_the_skill(w, tmp_path):
    path = tmp_path / "m.cmf"
    add_skill(w / "base.cmf", w / "da", "a", output=path)
    add_skill(path, w / "db", "b", in_place=True)
    d = remove_skill(path, "a")
    assert d["tensors"] == 6
    with cmf.open(path) as f:
        assert [s.id for s in f.skills] == ["b"] and not any(n.startswith("skill.a.") for n in f.keys())
        assert not f.verify()
    remove_skill(path, "b", tmp_path / "bare.cmf")
    with cmf.open(tmp_path / "bare.cmf") as f, cmf.open(w / "base.cmf") as b:
        assert [(t.name, t.hash) for t in f.tensors()] == [(t.name, t.hash) for t in b.tensors()]
    with pytest.raises(SkillError):
        remove_skill(path, "a")


def test_export_apply_round_trip_is_byte_identical(w, tmp_path):
    sk = tmp_path / "rust.skill.cmf"
    d = export_skill(w / "da.cmf", w / "base.cmf", "rust", sk)
    assert d["tensors"] == 22 and d["layers"] == [1, 2]
    assert sk.stat().st_size < (w / "da.cmf").stat().st_size / 2
    with cmf.open(sk) as f, cmf.open(w / "base.cmf") as b:
        assert f.is_skill_file and f.tokenizer_json is None
        rec = f.skills[0]
        assert rec.base_dir_hash == f"{b.envelope.dir_hash:016x}" and rec.base_arch == b.arch.arch_name
        assert rec.provenance["tensors"] == 22 and rec.provenance["cut_from"] == "da.cmf"
    out = tmp_path / "out.cmf"
    apply_skill(w / "base.cmf", sk, out)
    assert filecmp.cmp(out, w / "da.cmf", shallow=False)


def test_apply_refuses_a_wrong_base_unless_forced(w, tmp_path, capsys):
    sk = tmp_path / "rust.skill.cmf"
    export_skill(w / "da.cmf", w / "base.cmf", "rust", sk)
    with pytest.raises(SkillBaseMismatch, match="--force"):
        apply_skill(w / "base16.cmf", sk, tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()
    code, _, err = cli(capsys, "skill", "apply", w / "base16.cmf", sk, "-o", tmp_path / "x.cmf")
    assert code == 2 and "directory hash" in err
    code, out, err = cli(capsys, "skill", "apply", w / "base16.cmf", sk, "-o", tmp_path / "x.cmf", "--force")
    assert code == 0 and "out of spec" in err and "applied skill rust" in out
    with cmf.open(tmp_path / "x.cmf") as f:
        assert not f.is_skill_file and not f.verify()
        assert f.tensor("model.layers.1.mlp.up_proj.weight").dtype.label == "f32"  # the skill's
        assert f.tensor("model.layers.0.mlp.up_proj.weight").dtype.label == "f16"  # the base's


def test_apply_foreign_record_keeps_it_without_the_key(w, tmp_path):
    """A skill file without pycmf's ``provenance.registry``: skills = [record − base_dir_hash]."""
    sk = tmp_path / "s.cmf"
    export_skill(w / "da.cmf", w / "base.cmf", "rust", sk)
    with cmf.open(sk) as f:
        rec = dict(f.skills[0].raw)
    rec["provenance"] = {"cut_from": "elsewhere", "tensors": 22}
    growth.append(sk, (), {"skills": [rec]})
    apply_skill(w / "base.cmf", sk, tmp_path / "o.cmf")
    with cmf.open(tmp_path / "o.cmf") as f:
        assert len(f.skills) == 1 and f.skills[0].base_dir_hash is None and f.skills[0].id == "rust"


def test_cli_add_route_explain_run(w, tmp_path, capsys):
    m = tmp_path / "m.cmf"
    code, out, _ = cli(capsys, "skill", "add", w / "base.cmf", "--from", w / "da", "--id", "words", "--tensors", "all",
                       "--prompts", w / "pa.txt", "-o", m)
    assert code == 0 and "skill words" in out and "routing: metric mse" in out
    code, out, _ = cli(capsys, "skill", "add", m, "--from", w / "db.cmf", "--id", "digits", "--tensors", "all",
                       "--prompts", w / "pb.txt", "--in-place", "--json")
    assert code == 0 and json.loads(out)["in_place"] is True
    code, out, _ = cli(capsys, "route", m, "-p", SF.digit_prompts(1, 99)[0], "--json")
    d = json.loads(out)
    assert code == 0 and d["winner"] == "digits" and list(d["scores"]) == ["digits", "words"]
    assert set(d["blend_auto"]) == {"digits", "words"}
    code, out, _ = cli(capsys, "route", m, "-p", SF.word_prompts(1, 99)[0])
    assert code == 0 and "winner: words" in out
    code, out, _ = cli(capsys, "explain", m, "-p", "model tensor weight", "--top", "3", "--json")
    d = json.loads(out)
    assert [c["skill"] for c in d["candidates"]] == [None, d["winner"], ({"words", "digits"} - {d["winner"]}).pop()]
    assert all(len(c["top"]) == 3 and 0 < c["confidence"] <= 1 for c in d["candidates"])
    code, out, _ = cli(capsys, "explain", m, "-p", "model tensor weight")
    assert code == 0 and "backbone" in out and "confidence" in out
    code, out, _ = cli(capsys, "run", m, "-p", "12, 7; 903 +", "--raw", "--skill", "auto", "-n", "2", "--json")
    assert code == 0 and json.loads(out)["generated_tokens"] == 2
    code, _, err = cli(capsys, "run", m, "-p", "x", "--skill", "words", "--blend", "auto", "-n", "1")
    assert code == 2 and "not both" in err
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(SF.digit_prompts(40, 5)))
    code, out, _ = cli(capsys, "ppl", m, "-f", text, "--window", "32", "--skill", "auto", "--json")
    res = json.loads(out)
    assert code == 0 and sum(res["routes"].values()) == res["windows"] and res["routes"]["digits"] > res["windows"] / 2
    code, out, _ = cli(capsys, "ppl", m, "-f", text, "--window", "32", "--blend", "digits:1,words:1")
    assert code == 0 and "Final estimate" in out
    code, out, _ = cli(capsys, "skill", "list", m, "--json")
    assert [r["id"] for r in json.loads(out)] == ["words", "digits"]
    code, out, _ = cli(capsys, "skill", "remove", m, "--id", "words")
    assert code == 0 and "removed skill words" in out


def test_route_on_a_file_without_skills(w, capsys):
    code, out, _ = cli(capsys, "route", w / "base.cmf", "-p", "hello")
    assert code == 0 and "no routable skill" in out


def test_residual_matches_hidden_path(w):
    """φ's residual stream is the decoder's own: after the last layer, its final norm gives hidden()."""
    from cmf.runtime.ops.norm import rms_norm_prepared

    with cmf.load(w / "base.cmf") as m:
        ids = [5, 6, 7, 8, 9]
        r = m.residual(ids, len(m.plan.layers) - 1)
        h = m.hidden(ids, m.new_cache())
        np.testing.assert_allclose(rms_norm_prepared(r, m._final_norm, m.plan.eps), h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_in_place_fault_leaves_the_base_and_no_temp_files(w, tmp_path, monkeypatch, fault):
    from _faults import Faults, snapshot
    from cmf.format.errors import IoError

    path = tmp_path / "b.cmf"
    shutil.copy(w / "base.cmf", path)
    before = snapshot(tmp_path)
    grafted = []
    real = _skill_graft._graft
    monkeypatch.setattr(_skill_graft, "_graft", lambda *a, **k: grafted.append(1) or real(*a, **k))
    Faults(monkeypatch, tmp_path, budget=1000 if fault == "disk_full" else None, readonly=fault == "read_only")
    with pytest.raises(IoError, match="no space left|Read-only file system"):
        add_skill(path, w / "da", "rust", in_place=True)
    monkeypatch.undo()
    if fault == "read_only":
        assert grafted == []  # fails before the donor is converted or any tensor grafted
    assert snapshot(tmp_path) == before and [p.name for p in tmp_path.iterdir()] == ["b.cmf"]
    with cmf.open(path) as f:
        assert not f.verify() and not f.skills
