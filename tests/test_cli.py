"""The `cmf` command line: every verb in-process, exit codes, sanitizing, lazy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cmf
from cmf import cli
from cmf.format.growth import append
from cmf.format.writer import CmfWriter
from cmf.tools import fmt_bytes, fmt_count, fmt_ranges, sanitize
from cmf.tools.info import family_of

from _builders import arch, header, sample_masks, sample_tensors, write_sample

PARAMS = 128 * 64 + 64 + 96 * 64 + 96 * 64 + 64 * 96 + 4 * 64 + 128 * 64  # sample_tensors numel
PUB = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"  # of RFC 8032 test 1
SEED = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"


def run(capsys, *argv):
    """main(argv) in-process: (exit code, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m.cmf"
    write_sample(path)
    return path


@pytest.fixture
def fresh(tmp_path):
    path = tmp_path / "m.cmf"
    write_sample(path)
    return path


@pytest.fixture
def key(tmp_path):
    k = tmp_path / "k.key"
    k.write_text(SEED)
    return k


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


def _tensor_offset(path, name):
    with cmf.open(path) as f:
        return f.tensor(name).offset


# ------------------------------------------------------------------------------ surface


def test_help_lists_every_verb(capsys):
    code, out, err = run(capsys, "--help")
    assert code == 0 and err == ""
    for verb in ("info", "verify", "sign", "diff", "masks", "compact"):
        assert f"    {verb} " in out


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_each_verb_help_and_summary(capsys, verb):
    import importlib

    module = importlib.import_module(f"cmf.tools.{cli.VERBS[verb][0]}")
    assert module.SUMMARY == cli.VERBS[verb][1] and module.NAME == verb
    code, out, _ = run(capsys, verb, "--help")
    assert code == 0 and f"usage: cmf {verb}" in out


def test_version(capsys):
    """The version, then what the kernels are compiled for: the target numba uses and the integer
    dot form the 4-bit products take on it."""
    from cmf.kernels import int_dot
    from cmf.numba_prims import target_cpu

    code, out, _ = run(capsys, "--version")
    first, second = out.strip().splitlines()
    assert code == 0 and first == f"pycmf {cmf.__version__}"
    assert second.startswith("kernels: numba ") and f"target {target_cpu()[0]} " in second
    assert f"; integer dot {int_dot.DOT_PATH} (" in second


def test_help_imports_no_tool_and_no_numba():
    code = ("import sys; from cmf.cli import main; rc = main(['--help']); "
            "bad = [m for m in sys.modules if m.startswith(('cmf.tools.', 'numba', 'cryptography', 'tqdm'))]; "
            "print(rc, bad, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "0 []"


def test_python_m_and_console_script(model):
    r = subprocess.run([sys.executable, "-m", "cmf", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "verify" in r.stdout
    script = Path(sys.executable).with_name("cmf")
    if not script.exists():
        pytest.skip("console script not installed next to the interpreter")
    r = subprocess.run([str(script), "verify", str(model)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"{model}: OK (7 tensors")
    r = subprocess.run([str(script), "info", str(model.with_name("absent.cmf"))], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"cmf: error: {model.with_name('absent.cmf')}: no such file\n"


@pytest.mark.parametrize("argv", [[], ["bogus"], ["info"], ["--", "info", "x"], ["info", "a", "b"], ["compact", "x.cmf"],
                                  ["verify", "x.cmf", "--pubkey", "xyz"], ["info", "--nope", "x"]])
def test_usage_errors_exit_2_with_one_line(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    if argv:
        assert err.startswith("cmf: error: ") and err.count("\n") == 1


def test_unopenable_files_exit_2(capsys, tmp_path):
    for target in (tmp_path / "absent.cmf", tmp_path):
        code, out, err = run(capsys, "info", target)
        assert code == 2 and out == "" and err.startswith("cmf: error: ") and err.count("\n") == 1
    junk = tmp_path / "junk.cmf"
    junk.write_bytes(b"not a cmf file at all" * 10)
    code, _, err = run(capsys, "info", junk)
    assert code == 2 and "magic" in err.lower() and err.count("\n") == 1
    code, _, err = run(capsys, "diff", junk, junk)
    assert code == 2


def test_verbose_adds_traceback_only_then(capsys, tmp_path):
    code, _, err = run(capsys, "info", tmp_path / "absent.cmf")
    assert code == 2 and "Traceback" not in err
    for argv in (("-v", "info"), ("info", "-v"), ("--verbose", "info")):
        code, _, err = run(capsys, *argv, tmp_path / "absent.cmf")
        assert code == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("cmf: error: ")


def test_internal_error_is_one_line(capsys, monkeypatch, model):
    from cmf.tools import masks

    def boom(_):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(masks, "list_masks", boom)
    code, out, err = run(capsys, "masks", model)
    assert code == 2 and out == ""
    assert err == "cmf: error: internal error: RuntimeError: kaboom (run with -v for the traceback)\n"


# ------------------------------------------------------------------------------ info


def test_info_text(capsys, model):
    code, out, err = run(capsys, "info", model)
    assert code == 0 and err == ""
    assert f"parameters: 35.1K ({PARAMS:,}) in 7 tensors" in out
    assert "arch: qwen3  layers=2 (2 FullAttention)" in out
    assert "heads=4/2kv head_dim=16 vocab=128" in out
    lines = out.splitlines()
    assert any(line.split() == ["ffn", "q4_tiled", "1", "6.14K", "3.4", "KiB", "4.50"] for line in lines)
    assert any(line.split() == ["lm_head", "bf16", "1", "8.19K", "16.0", "KiB", "16.00"] for line in lines)
    assert any(line.split()[:2] == ["data", "4096"] for line in lines)
    assert "masks: 2 (general* (0.000), coding (0.500))" in out
    assert "signature: none" in out


def test_info_json(capsys, model):
    code, d = run_json(capsys, "info", model)
    assert code == 0
    assert d["parameters"] == PARAMS and d["skill_parameters"] == 0 and d["tensors"] == 7
    assert d["size"] == model.stat().st_size and d["runnable"] is True
    assert d["features"] == ["TENSOR_DIR", "BINARY_MASKS"]
    assert d["arch"]["num_layers"] == 2 and d["arch"]["layer_types"] == {"FullAttention": 2}
    fams = {(r["family"], r["dtype"]): (r["tensors"], r["params"], r["bytes"], r["bits_per_weight"])
            for r in d["dtypes"]}
    assert fams == {
        ("embed", "f32"): (1, 8192, 32768, 32.0),
        ("ffn", "f32"): (1, 6144, 24576, 32.0),
        ("ffn", "q8_row"): (1, 6144, 6144 + 192, 8.25),
        ("ffn", "q4_tiled"): (1, 6144, 18 * 192, 4.5),
        ("ffn", "vbit_ro"): (1, 256, 208, 6.5),
        ("norms", "f16"): (1, 64, 128, 16.0),
        ("lm_head", "bf16"): (1, 8192, 16384, 16.0),
    }
    assert [r["family"] for r in d["dtypes"]][0] == "embed"
    secs = {s["name"]: s for s in d["sections"]}
    assert set(secs) == {"header", "dir", "data", "masks", "vocab"} and secs["header"]["offset"] == 128
    assert d["masks"]["default_task"] == "general"
    assert d["masks"]["tasks"][1] == {"name": "coding", "sparsity": 0.5, "quality": 1.02}
    assert d["tokenizer"]["vocab_bytes"] > 0 and d["skills"] == [] and d["signature"] is False
    assert "pipeline" not in d


def test_info_tensors_prefix(capsys, model):
    code, out, _ = run(capsys, "info", model, "--tensors", "model.layers.0.")
    assert code == 0
    rows = out.splitlines()
    assert rows[0].split() == ["name", "dtype", "shape", "params", "size", "bpw", "hash64"]
    assert len(rows) == 5 and rows[-1] == "3 tensors, 18.4K params, 33.6 KiB"
    code, d = run_json(capsys, "info", model, "--tensors", "model.layers.0.")
    assert [t["name"] for t in d["tensors"]] == [n for n, *_ in sample_tensors() if n.startswith("model.layers.0.")]
    assert d["total"] == {"tensors": 3, "params": 3 * 6144, "bytes": 24576 + 6336 + 3456}
    t = d["tensors"][1]
    assert t["dtype"] == "q8_row" and t["shape"] == [96, 64] and len(t["hash"]) == 16
    code, d = run_json(capsys, "info", model, "--tensors")  # no prefix: everything
    assert d["total"]["tensors"] == 7 and d["total"]["params"] == PARAMS
    code, d = run_json(capsys, "info", model, "--tensors", "nothing.")
    assert d["total"] == {"tensors": 0, "params": 0, "bytes": 0}


def test_info_skills_are_counted_apart(capsys, tmp_path):
    path = tmp_path / "s.cmf"
    skill = {"id": "code", "name": "Coder", "layers": [0]}
    with CmfWriter(path, header(skills=[skill])) as w:
        for name, dtype, shape, payload in sample_tensors():
            w.add(name, dtype, shape, payload)
        w.add("skill.code.model.layers.0.mlp.up_proj.weight", "f16", (96, 64), bytes(96 * 64 * 2))
    code, d = run_json(capsys, "info", path)
    assert d["parameters"] == PARAMS and d["skill_parameters"] == 96 * 64
    assert d["skills"][0] | {} == {"id": "code", "name": "Coder", "layers": [0], "routable": False,
                                   "input_mask_task": None, "quality": None, "tensors": 1,
                                   "params": 96 * 64, "bytes": 96 * 64 * 2, "base_dir_hash": None}
    code, out, _ = run(capsys, "info", path)
    assert "(+6.14K in skill replacements)" in out
    assert any(line.split()[:3] == ["code", "Coder", "1"] for line in out.splitlines())


def _write_pipeline(path):
    h = header(arch=arch(arch_name="lumina2-image"),
               provenance={"pipeline": "lumina2", "components": ["te", "dit", "vae"]})
    with CmfWriter(path, h) as w:
        for ns, cfg in (("te", {"model_type": "gemma2", "hidden_size": 64}),
                        ("dit", {"patch_size": 2, "num_layers": 3, "axes": [1, 2]}),
                        ("vae", {"latent_channels": 16})):
            raw = json.dumps(cfg).encode()
            w.add(f"{ns}.config_json", "u8", (len(raw),), raw)
            w.add(f"{ns}.blocks.0.weight", "f16", (64, 32), np.ones((64, 32), "<f2").tobytes())
        w.add("vae.conv.bias", "f32", (8,), np.zeros(8, "<f4").tobytes())


def test_info_pipeline_container(capsys, tmp_path):
    path = tmp_path / "p.cmf"
    _write_pipeline(path)
    code, d = run_json(capsys, "info", path)
    assert code == 0
    comps = {c["namespace"]: c for c in d["pipeline"]["components"]}
    assert list(comps) == ["te", "dit", "vae"]
    assert comps["te"]["config"] == {"model_type": "gemma2", "hidden_size": 64}
    assert comps["dit"]["config"]["axes"] == [1, 2]
    assert comps["vae"]["tensors"] == 3 and comps["vae"]["params"] == 64 * 32 + 8
    assert comps["vae"]["dtypes"] == {"f16": 1, "f32": 1, "u8": 1}
    assert d["parameters"] == 3 * 64 * 32 + 8  # config blobs are bytes, not weights
    assert d["pipeline"]["provenance"] == "lumina2"
    code, out, _ = run(capsys, "info", path)
    assert "pipeline components:" in out
    assert '    config: model_type="gemma2", hidden_size=64' in out
    assert "    config: patch_size=2, num_layers=3, ... (+1 more keys)" in out


def test_info_escapes_control_characters(capsys, tmp_path):
    path = tmp_path / "evil.cmf"
    evil = "model.layers.0.\x1b[2J\x1b]0;pwned\x07\u202eevil\r\n.weight"
    h = header(arch=arch(arch_name="qwen3\x1b[31m"))
    with CmfWriter(path, h) as w:
        w.add(evil, "f32", (4,), np.zeros(4, "<f4").tobytes())
    for argv in (("info", path), ("info", path, "--tensors"), ("verify", path)):
        code, out, err = run(capsys, *argv)
        assert code == 0
        for bad in ("\x1b", "\x07", "\u202e", "\r"):
            assert bad not in out and bad not in err
    code, out, _ = run(capsys, "info", path, "--tensors")
    assert "model.layers.0.\\x1b[2J\\x1b]0;pwned\\x07\\u202eevil\\x0d\\x0a.weight" in out
    code, out, _ = run(capsys, "info", path)
    assert "arch: qwen3\\x1b[31m" in out
    code, d = run_json(capsys, "info", path, "--tensors")
    assert d["tensors"][0]["name"] == evil  # JSON keeps the name exact (escaped by JSON itself)


def test_sanitize_and_formatting_helpers():
    assert sanitize("plain.name.weight") == "plain.name.weight"
    assert sanitize("a\x00b\x7fc\x9bd") == "a\\x00b\\x7fc\\x9bd"
    assert sanitize("tab\there\u2028\u2066x") == "tab\\x09here\\u2028\\u2066x"
    assert sanitize("\u200bzero-width") == "\\u200bzero-width"
    assert sanitize("ünïcødé ok 模型") == "ünïcødé ok 模型"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(40 * 1024) == "40.0 KiB" and fmt_bytes(3 << 30) == "3.0 GiB"
    assert fmt_count(950) == "950" and fmt_count(35136) == "35.1K" and fmt_count(7_615_616_512) == "7.62B"
    assert fmt_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and fmt_ranges([]) == "-"


@pytest.mark.parametrize("name, family", [
    ("model.embed_tokens.weight", "embed"),
    ("model.layers.3.self_attn.q_proj.weight", "attention"),
    ("model.layers.3.self_attn.q_norm.weight", "norms"),
    ("model.layers.3.input_layernorm.weight", "norms"),
    ("model.norm.weight", "norms"),
    ("model.layers.3.linear_attn.in_proj_qkvz.weight", "attention"),
    ("model.layers.3.mlp.gate_proj.weight", "ffn"),
    ("model.layers.3.mlp.experts.7.down_proj.weight", "experts"),
    ("model.layers.3.mlp.shared_expert.up_proj.weight", "experts"),
    ("model.layers.3.mlp.gate.weight", "experts"),
    ("lm_head.weight", "lm_head"),
    ("skill.code.model.layers.0.mlp.up_proj.weight", "skill"),
    ("mtp.fc.weight", "other"),
])
def test_family_of(name, family):
    assert family_of(name) == family


# ------------------------------------------------------------------------------ verify


def test_verify_clean(capsys, model):
    code, out, err = run(capsys, "verify", model)
    assert code == 0 and err == ""
    assert out == f"{model}: OK (7 tensors, {fmt_bytes(model.stat().st_size)})\nsignature: none\n"
    code, d = run_json(capsys, "verify", model)
    assert code == 0 and d["ok"] is True and d["problems"] == [] and d["tensors"] == 7
    assert d["signatures"] == [{"file": str(model), "status": "absent"}]


def test_verify_tampered_tensor_exits_1(capsys, fresh):
    _flip(fresh, _tensor_offset(fresh, "model.layers.0.mlp.up_proj.weight") + 100)
    code, out, _ = run(capsys, "verify", fresh)
    assert code == 1
    assert out.startswith(f"{fresh}: FAILED, 1 problem\n")
    assert "tensor 'model.layers.0.mlp.up_proj.weight': hash64" in out


def test_verify_tampered_header_exits_1(capsys, fresh):
    data = fresh.read_bytes()
    at = data.index(b'"pycmf-tests"') + 1  # a byte inside a header string: still valid JSON
    _flip(fresh, at)
    code, d = run_json(capsys, "verify", fresh)
    assert code == 1 and any("header hash64" in p for p in d["problems"])


def test_verify_file_that_fails_to_open_is_a_finding(capsys, fresh):
    _flip(fresh, 0)  # magic
    code, out, err = run(capsys, "verify", fresh)
    assert code == 1 and "cannot open" in out and err == ""


def test_verify_missing_file_exits_2(capsys, tmp_path):
    code, out, err = run(capsys, "verify", tmp_path / "absent.cmf")
    assert code == 2 and out == "" and err.count("\n") == 1


def test_verify_with_signature(capsys, fresh, key):
    code, out, err = run(capsys, "sign", fresh, "--key", key)
    assert code == 0 and err == ""
    assert out == f"signed: {fresh}.sig\npubkey: {PUB}\n"
    code, out, _ = run(capsys, "verify", fresh)
    assert code == 0 and out.endswith(f"signature: valid (ed25519, signer {PUB})\n")
    assert run(capsys, "verify", fresh, "--pubkey", PUB.upper())[0] == 0
    code, out, _ = run(capsys, "verify", fresh, "--pubkey", "ab" * 32)
    assert code == 1 and "not by the expected key" in out
    _flip(fresh, fresh.stat().st_size - 1)  # last byte of the vocab section
    code, d = run_json(capsys, "verify", fresh)
    assert code == 1
    assert d["signatures"][0]["status"] == "invalid" and "SHA-256" in d["signatures"][0]["error"]
    assert any(p.startswith("signature: ") for p in d["problems"])


def test_verify_pinned_key_requires_a_signature(capsys, model):
    code, out, _ = run(capsys, "verify", model, "--pubkey", PUB)
    assert code == 1 and "no signature" in out


def test_verify_malformed_sig_exits_1(capsys, fresh):
    Path(f"{fresh}.sig").write_text("{not json")
    code, out, _ = run(capsys, "verify", fresh)
    assert code == 1 and "malformed signature file" in out


def test_shard_set(capsys, tmp_path, key):
    paths = write_sample(tmp_path / "s.cmf", max_shard_bytes=40000)
    assert len(paths) == 3
    code, out, _ = run(capsys, "verify", paths[1])
    assert code == 0 and out.startswith(f"{paths[1]}: OK (7 tensors") and "in 3 shards" in out
    code, out, _ = run(capsys, "sign", paths[2], "--key", key)
    assert code == 0 and out.count("signed: ") == 3
    assert all(Path(f"{p}.sig").exists() for p in paths)
    code, d = run_json(capsys, "verify", paths[0], "--pubkey", PUB)
    assert code == 0 and [s["status"] for s in d["signatures"]] == ["valid"] * 3
    _flip(paths[2], paths[2].stat().st_size - 10)
    code, d = run_json(capsys, "verify", paths[0])
    assert code == 1 and d["signatures"][2]["status"] == "invalid"
    paths[1].unlink()  # a sibling gone: shard 1 is verified alone (spec §10)
    code, out, _ = run(capsys, "verify", paths[0])
    assert code == 0 and "verified shard 1 of 3 alone: siblings absent (missing 2)" in out


def test_verify_single_shard_without_siblings(capsys, tmp_path):
    paths = write_sample(tmp_path / "s.cmf", max_shard_bytes=40000)
    with cmf.open(paths[1], shards=False) as f:
        n_alone, size = len(f), f.size
    paths[0].unlink()
    paths[2].unlink()
    code, out, _ = run(capsys, "verify", paths[1])
    assert code == 0
    assert out.splitlines()[:2] == [f"{paths[1]}: OK ({n_alone} tensors, {fmt_bytes(size)})",
                                    "verified shard 2 of 3 alone: siblings absent (missing 1, 3)"]
    code, d = run_json(capsys, "verify", paths[1])
    assert code == 0 and d["ok"] is True and d["files"] == [str(paths[1])] and d["tensors"] == n_alone
    assert d["shard_alone"] == {"no": 2, "count": 3, "missing": [1, 3]}
    with cmf.open(paths[1], shards=False) as f:
        first = next(f.tensors()).offset
    _flip(paths[1], first)
    code, d = run_json(capsys, "verify", paths[1])  # alone still checks every hash of the shard
    assert code == 1 and d["shard_alone"]["no"] == 2 and any("hash64" in p for p in d["problems"])
    with pytest.raises(cmf.errors.MissingShard, match=r"shard 2 of 3: 2 sibling\(s\) missing") as exc:
        cmf.open(paths[1])  # running still needs the whole set
    assert (exc.value.no, exc.value.count, exc.value.missing) == (2, 3, (1, 3))


def test_verify_complete_set_is_not_alone(capsys, tmp_path):
    paths = write_sample(tmp_path / "s.cmf", max_shard_bytes=40000)
    code, d = run_json(capsys, "verify", paths[2])
    assert code == 0 and d["shard_alone"] is None and d["files"] == [str(p) for p in paths]
    code, out, _ = run(capsys, "verify", paths[2])
    assert "alone" not in out


def test_sign_creates_default_key(capsys, fresh, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "sign", fresh)
    assert code == 0
    assert err == "cmf: new signing key written to cmf-signing.key; keep it private\n"
    assert (tmp_path / "cmf-signing.key").exists()
    pub = out.splitlines()[-1].split()[-1]
    code, out, err = run(capsys, "sign", fresh)
    assert code == 0 and err == "" and out.splitlines()[-1].split()[-1] == pub
    assert run(capsys, "verify", fresh, "--pubkey", pub)[0] == 0


def test_sign_bad_inputs_exit_2(capsys, tmp_path, fresh):
    bad_key = tmp_path / "bad.key"
    bad_key.write_text("xyz")
    code, _, err = run(capsys, "sign", fresh, "--key", bad_key)
    assert code == 2 and "64 hex digits" in err and err.count("\n") == 1
    code, _, err = run(capsys, "sign", tmp_path / "absent.cmf", "--key", bad_key)
    assert code == 2 and not (tmp_path / "absent.cmf.sig").exists()


# ------------------------------------------------------------------------------ diff


def test_diff_identical(capsys, model, tmp_path):
    code, out, _ = run(capsys, "diff", model, model)
    assert code == 0 and out.splitlines()[-1] == "identical"
    assert "tensors: 0 added, 0 removed, 0 changed, 7 unchanged" in out


def test_diff_differences(capsys, model, tmp_path):
    other = tmp_path / "b.cmf"
    tensors = {n: (d, s, p) for n, d, s, p in sample_tensors()}
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = ("f16", (96, 64), bytes(96 * 64 * 2))
    tensors["model.layers.1.mlp.up_proj.weight"] = ("f32", (96, 64), bytes(96 * 64 * 4))
    name, (dt, shape, payload) = "lm_head.weight", tensors["lm_head.weight"]
    tensors[name] = (dt, shape, b"\x01" + payload[1:])
    masks = sample_masks()
    masks.masks = masks.masks[:1]
    hdr = header(arch=arch(rope_theta=1e6), skills=[{"id": "math"}])
    with CmfWriter(other, hdr) as w:
        for n, (d, s, p) in tensors.items():
            w.add(n, d, s, p)
        w.set_masks(masks)
    code, d = run_json(capsys, "diff", model, other)
    assert code == 1 and d["identical"] is False
    assert d["arch"] == [{"key": "rope_theta", "change": "changed", "a": 10000.0, "b": 1e6}]
    assert d["header"] == []
    t = d["tensors"]
    assert [e["name"] for e in t["added"]] == ["model.layers.1.mlp.up_proj.weight"]
    assert [e["name"] for e in t["removed"]] == ["model.norm.weight"]
    changed = {e["name"]: e for e in t["changed"]}
    assert set(changed) == {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
    assert changed["model.layers.0.mlp.up_proj.weight"]["dtype"] == ["f32", "f16"]
    assert set(changed["lm_head.weight"]) == {"name", "hash"}
    assert t["unchanged"] == 4
    assert d["skills"] == {"added": ["math"], "removed": [], "changed": []}
    assert d["masks"] == {"added": [], "removed": ["coding"], "changed": []}
    assert d["tokenizer_changed"] is True
    code, out, _ = run(capsys, "diff", model, other)
    assert code == 1
    assert "  ~ rope_theta: 10000.0 -> 1000000.0" in out
    assert "  + model.layers.1.mlp.up_proj.weight  f32 [96, 64]" in out
    assert "  - model.norm.weight  f16 [64]" in out
    assert "  ~ model.layers.0.mlp.up_proj.weight: dtype f32 -> f16; hash " in out
    assert "skill + math" in out and "mask - coding" in out and "tokenizer: changed" in out
    assert out.splitlines()[-1] == "models differ"


def test_diff_mask_bits_changed(capsys, model, tmp_path):
    other = tmp_path / "b.cmf"
    masks = sample_masks()
    masks.masks[1].heads = ~masks.masks[1].heads
    with CmfWriter(other, header()) as w:
        for n, d, s, p in sample_tensors():
            w.add(n, d, s, p)
        w.set_masks(masks)
        w.set_vocab(b'{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}')
    code, d = run_json(capsys, "diff", model, other)
    assert code == 1 and d["masks"]["changed"] == ["coding"] and not d["tokenizer_changed"]


# ------------------------------------------------------------------------------ masks


def test_masks_text_and_json(capsys, model):
    code, out, _ = run(capsys, "masks", model)
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["id", "task", "default", "sparsity", "quality", "layers", "touched"]
    assert rows[1] == ["0", "general", "*", "0.000", "unmeasured", "-"]
    assert rows[2] == ["1", "coding", "0.500", "heldout_ppl_ratio=1.02", "0-1", "(off:", "1)"]
    assert rows[3] == ["2", "masks", "over", "2", "layers;", "default:", "general"]
    code, d = run_json(capsys, "masks", model)
    assert d["default_task"] == "general"
    general, coding = d["masks"]
    assert general["default"] is True and general["quality"] == "unmeasured" and general["layers"] == []
    assert coding["default"] is False and coding["quality"] == 1.02
    assert coding["quality_metric"] == "heldout_ppl_ratio" and coding["sparsity"] == 0.5
    assert coding["gated_off"] == [1] and coding["heads"] == [0, 1] and coding["layers"] == [0, 1]


def test_masks_none(capsys, tmp_path):
    path = tmp_path / "n.cmf"
    write_sample(path, masks=False)
    code, out, _ = run(capsys, "masks", path)
    assert code == 0 and out == "no masks\n"
    code, d = run_json(capsys, "masks", path)
    assert d == {"default_task": None, "masks": []}


# ------------------------------------------------------------------------------ compact


def test_compact_after_growth(capsys, fresh, tmp_path):
    append(fresh, [("model.norm.weight", "f16", (64,), np.ones(64, "<f2").tobytes())], replace=True)
    append(fresh, [("extra.weight", "f32", (256,), np.ones(256, "<f4").tobytes())])
    before = fresh.stat().st_size
    out_path = tmp_path / "c.cmf"
    code, d = run_json(capsys, "compact", fresh, "-o", out_path)
    assert code == 0
    after = out_path.stat().st_size
    assert d == {"input": [str(fresh)], "output": str(out_path), "before": before, "after": after,
                 "saved": before - after}
    assert after < before
    assert run(capsys, "verify", out_path)[0] == 0
    assert run(capsys, "diff", fresh, out_path)[0] == 0
    code, out, _ = run(capsys, "compact", fresh, "-o", tmp_path / "c2.cmf")
    assert code == 0 and out.startswith(f"{fresh}: {fmt_bytes(before)} -> {tmp_path / 'c2.cmf'}: ")
    assert "(saved " in out


def test_compact_joins_shards_and_refuses_to_overwrite(capsys, tmp_path):
    paths = write_sample(tmp_path / "s.cmf", max_shard_bytes=40000)
    out_path = tmp_path / "joined.cmf"
    code, out, _ = run(capsys, "compact", paths[0], "-o", out_path)
    assert code == 0 and "(+2 shards)" in out
    assert run(capsys, "diff", paths[0], out_path)[0] == 0
    code, out, err = run(capsys, "compact", out_path, "-o", out_path)
    assert code == 2 and out == "" and "overwrite the input" in err
    code, _, err = run(capsys, "compact", paths[0], "--output", paths[1])
    assert code == 2 and "overwrite" in err
    assert run(capsys, "verify", out_path)[0] == 0


def test_compact_corrupt_input_exits_2(capsys, fresh, tmp_path):
    _flip(fresh, _tensor_offset(fresh, "model.embed_tokens.weight"))
    code, out, err = run(capsys, "compact", fresh, "-o", tmp_path / "c.cmf")
    assert code == 2 and "corrupt" in err and not (tmp_path / "c.cmf").exists()
    assert os.listdir(tmp_path) == ["m.cmf"]


def test_verify_progress_bar_only_on_a_tty(capsys, monkeypatch, fresh, key):
    from cmf.tools import verify

    monkeypatch.setattr(verify, "PROGRESS_MIN_BYTES", 0)
    code, out, err = run(capsys, "verify", fresh)
    assert code == 0 and err == ""  # not a TTY: no bar even for a "large" file
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out2, err = run(capsys, "verify", fresh)
    assert code == 0 and out2 == out  # stdout carries only the product
    assert "hash64" in err and "sha256" not in err  # no .sig: no SHA-256 pass
    run(capsys, "sign", fresh, "--key", key)
    code, out, err = run(capsys, "verify", fresh)
    assert code == 0 and "signature: valid" in out and "hash64" in err and "sha256" in err
    monkeypatch.setattr(verify, "PROGRESS_MIN_BYTES", 10**9)
    code, out, err = run(capsys, "verify", fresh)
    assert code == 0 and err == ""  # a TTY but a small file: no bar
