"""Permission bits of every output: what ``open(path, "w")`` gives a new file, the old mode on a rewrite.

The writers create a temp file with ``tempfile.mkstemp`` (0600) and rename it into place; before
the fix a server running as another user could not read the model.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from cmf.format.atomic import current_umask, output_mode
from cmf.format.growth import append, compact
from cmf.format.reader import open as cmf_open
from cmf.format.signature import sign_file
from cmf.format.writer import CmfWriter
from cmf.tools.requant import requant

from _builders import header, write_sample


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test; restored afterwards."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _matrix_file(path) -> None:
    """A file requant can re-encode (decodable f32 matrices)."""
    rng = np.random.default_rng(0)
    with CmfWriter(path, header()) as w:
        w.add_array("model.embed_tokens.weight", rng.standard_normal((64, 64)).astype(np.float32))
        w.add_array("model.layers.0.mlp.up_proj.weight", rng.standard_normal((96, 64)).astype(np.float32))


def test_current_umask_reads_the_process_umask(umask):
    umask(0o027)
    assert current_umask() == 0o027
    assert current_umask() == 0o027  # reading it does not change it
    umask(0o077)
    assert current_umask() == 0o077


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_writer_new_file_gets_umask_mode(tmp_path, umask, mask, expected):
    umask(mask)
    path = tmp_path / "m.cmf"
    write_sample(path)
    assert mode(path) == expected
    assert output_mode(tmp_path / "absent.cmf") == expected


def test_writer_direct_mode_and_shards_get_umask_mode(tmp_path, umask):
    umask(0o022)
    direct = tmp_path / "d.cmf"
    with CmfWriter(direct, header(), expected_names=["a"]) as w:  # data written at its final offset
        w.add("a", "f32", (1024,), np.zeros(1024, "<f4"))
    assert mode(direct) == 0o644
    shards = write_sample(tmp_path / "s.cmf", max_shard_bytes=30000)
    assert len(shards) == 3 and [mode(p) for p in shards] == [0o644] * 3


def test_writer_rewrite_keeps_existing_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "m.cmf"
    path.write_bytes(b"old")
    path.chmod(0o640)
    write_sample(path)
    assert mode(path) == 0o640
    with cmf_open(path) as f:
        assert f.verify() == []
    with CmfWriter(path, header(), expected_names=["a"]) as w:
        w.add("a", "f32", (4,), np.zeros(4, "<f4"))
    assert mode(path) == 0o640


def test_convert_output_mode(tmp_path, umask):
    pytest.importorskip("transformers")
    import hf_fixtures as H
    from cmf.convert import convert

    umask(0o022)
    out = tmp_path / "llama.cmf"
    convert(H.fixture("llama"), out, quant="f32")
    assert mode(out) == 0o644
    umask(0o077)
    out2 = tmp_path / "llama2.cmf"
    convert(H.fixture("llama"), out2, quant="q8")
    assert mode(out2) == 0o600


def test_requant_output_and_in_place_modes(tmp_path, umask):
    umask(0o022)
    src = tmp_path / "in.cmf"
    _matrix_file(src)
    dst = tmp_path / "out.cmf"
    requant(src, dst, quant="q8")
    assert mode(dst) == 0o644
    dst.chmod(0o640)
    requant(src, dst, quant="q4tp")  # -o over an existing file: its mode stays
    assert mode(dst) == 0o640
    src.chmod(0o604)
    requant(src, quant="q8", in_place=True)
    assert mode(src) == 0o604


def test_compact_output_mode(tmp_path, umask):
    umask(0o077)
    src = tmp_path / "g.cmf"
    write_sample(src)
    out = compact(src, tmp_path / "c.cmf")
    assert mode(out) == 0o600
    umask(0o022)
    out.chmod(0o640)
    compact(src, out)
    assert mode(out) == 0o640


def test_signature_file_mode(tmp_path, umask):
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    model = tmp_path / "m.cmf"
    write_sample(model)
    umask(0o022)
    sig = sign_file(model, key=key)
    assert mode(sig) == 0o644
    sig.chmod(0o640)
    sign_file(model, key=key)
    assert mode(sig) == 0o640
    sig.unlink()
    umask(0o077)
    assert mode(sign_file(model, key=key)) == 0o600


def test_append_in_place_keeps_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "g.cmf"
    write_sample(path)
    path.chmod(0o640)
    append(path, [("extra", "f32", (16,), np.ones(16, "<f4"))])
    assert mode(path) == 0o640
    with cmf_open(path) as f:
        assert f.verify() == [] and "extra" in f
