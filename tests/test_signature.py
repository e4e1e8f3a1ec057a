"""Detached Ed25519 signatures (spec §8.2, REFERENCE_NOTES §1.14)."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cmf.format import signature as sigmod
from cmf.format.errors import CmfError, IoError, SignatureError
from cmf.format.signature import (
    ALG,
    load_or_create_key,
    public_key_hex,
    sha256_file,
    sign_file,
    signature_path,
    verify_signature,
)

from _builders import write_sample

# RFC 8032 §7.1, TEST 1: secret seed and its public key.
RFC_SEED = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"
RFC_PUB = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.cmf"
    write_sample(path)
    return path


@pytest.fixture
def rfc_key(tmp_path):
    key = tmp_path / "rfc.key"
    key.write_text(f"  {RFC_SEED.upper()}\n\n")  # whitespace trimmed, hex case-insensitive
    return key


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def test_sig_bytes_match_the_reference_layout(model, rfc_key):
    out = sign_file(model, rfc_key)
    assert out == signature_path(model) == model.with_name("m.cmf.sig")
    digest = hashlib.sha256(model.read_bytes()).digest()
    doc = json.loads(out.read_text())
    assert list(doc) == ["alg", "pubkey", "sha256", "sig"]
    assert doc["alg"] == ALG == "ed25519-sha256"
    assert doc["pubkey"] == RFC_PUB
    assert doc["sha256"] == digest.hex()
    assert len(doc["sig"]) == 128 and doc["sig"] == doc["sig"].lower()
    # serde_json::to_string_pretty: two-space indent, ": " separator, no trailing newline.
    expected = ('{\n  "alg": "ed25519-sha256",\n  "pubkey": "%s",\n  "sha256": "%s",\n  "sig": "%s"\n}'
                % (RFC_PUB, digest.hex(), doc["sig"]))
    assert out.read_text() == expected
    # The signed message is the RAW 32-byte digest (pure Ed25519), not its hex text.
    pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(RFC_PUB))
    pub.verify(bytes.fromhex(doc["sig"]), digest)
    with pytest.raises(InvalidSignature):
        pub.verify(bytes.fromhex(doc["sig"]), digest.hex().encode())
    # Ed25519 is deterministic: signing again gives the same bytes.
    before = out.read_bytes()
    sign_file(model, rfc_key)
    assert out.read_bytes() == before


def test_round_trip_and_pinned_key(model, rfc_key):
    sign_file(model, rfc_key)
    res = verify_signature(model)
    assert res is not None
    assert res.pubkey == RFC_PUB and res.sig_path == signature_path(model)
    assert res.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    assert verify_signature(model, pubkey=RFC_PUB.upper()).pubkey == RFC_PUB  # case-insensitive pin
    with pytest.raises(SignatureError, match="not by the expected key"):
        verify_signature(model, pubkey="ab" * 32)


def test_absent_signature_is_not_an_error(model):
    assert verify_signature(model) is None
    assert verify_signature(model, pubkey=RFC_PUB) is None  # the caller decides what a pin means


def test_tampered_file_fails(model, rfc_key):
    sign_file(model, rfc_key)
    _flip(model, model.stat().st_size // 2)
    with pytest.raises(SignatureError, match="SHA-256"):
        verify_signature(model)


def test_sha256_field_rewritten_to_match_still_fails(model, rfc_key):
    sig = sign_file(model, rfc_key)
    _flip(model, 5000)
    doc = json.loads(sig.read_text())
    doc["sha256"] = hashlib.sha256(model.read_bytes()).hexdigest().upper()  # compared case-insensitively
    sig.write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="INVALID"):
        verify_signature(model)


def test_other_signer_substituted_fails(model, rfc_key, tmp_path):
    sig = sign_file(model, rfc_key)
    other, _ = load_or_create_key(tmp_path / "other.key")
    doc = json.loads(sig.read_text())
    doc["pubkey"] = public_key_hex(other)  # claims another signer, keeps the RFC key's signature
    sig.write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="INVALID"):
        verify_signature(model)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "not json {", "not JSON"),
    (lambda d: "[1, 2]", "not a JSON object"),
    (lambda d: b"\xff\xfe".decode("latin-1"), "malformed"),
    (lambda d: {**d, "alg": "ed25519ph-sha512"}, "alg"),
    (lambda d: {k: v for k, v in d.items() if k != "alg"}, "alg"),
    (lambda d: {k: v for k, v in d.items() if k != "pubkey"}, "'pubkey'"),
    (lambda d: {k: v for k, v in d.items() if k != "sig"}, "'sig'"),
    (lambda d: {k: v for k, v in d.items() if k != "sha256"}, "'sha256'"),
    (lambda d: {**d, "pubkey": d["pubkey"][:-2]}, "64 hex"),
    (lambda d: {**d, "sig": d["sig"] + "00"}, "128 hex"),
    (lambda d: {**d, "sha256": "zz" * 32}, "64 hex"),
    (lambda d: {**d, "sig": 12}, "'sig'"),
    (lambda d: {**d, "sig": "00" * 64}, "INVALID"),
])
def test_malformed_sig(model, rfc_key, mutate, message):
    sig = sign_file(model, rfc_key)
    new = mutate(json.loads(sig.read_text()))
    sig.write_text(new if isinstance(new, str) else json.dumps(new), encoding="latin-1")
    with pytest.raises(SignatureError, match=message) as info:
        verify_signature(model)
    assert isinstance(info.value, CmfError)


def test_huge_sig_refused(model):
    signature_path(model).write_bytes(b" " * (sigmod._MAX_SIG_BYTES + 1))
    with pytest.raises(SignatureError, match="malformed"):
        verify_signature(model)


def test_key_created_once_with_private_mode(tmp_path, model):
    key_path = tmp_path / "new.key"
    key, created = load_or_create_key(key_path)
    assert created
    text = key_path.read_text()
    assert len(text) == 64 and int(text, 16) >= 0
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    again, created2 = load_or_create_key(key_path)
    assert not created2 and public_key_hex(again) == public_key_hex(key)
    assert key_path.read_text() == text  # never overwritten
    assert json.loads(sign_file(model, key_path).read_text())["pubkey"] == public_key_hex(key)


def test_default_key_name(tmp_path, model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sign_file(model)
    assert (tmp_path / "cmf-signing.key").exists()
    assert verify_signature(model) is not None


@pytest.mark.parametrize("content", ["", "abcd", "g" * 64, RFC_SEED + "00", RFC_SEED[:32] + " " + RFC_SEED[32:]])
def test_malformed_key_file(tmp_path, model, content):
    key = tmp_path / "bad.key"
    key.write_text(content)
    with pytest.raises(SignatureError, match="64 hex digits"):
        sign_file(model, key)
    assert not signature_path(model).exists()


def test_key_path_is_a_directory(tmp_path):
    with pytest.raises(IoError, match="directory"):
        load_or_create_key(tmp_path)


def test_sign_is_atomic_and_leaves_no_temp_files(model, rfc_key):
    sign_file(model, rfc_key)
    sign_file(model, rfc_key)
    assert sorted(p.name for p in model.parent.iterdir()) == ["m.cmf", "m.cmf.sig", "rfc.key"]


def test_sign_missing_model(tmp_path, rfc_key):
    with pytest.raises(IoError, match="no such file"):
        sign_file(tmp_path / "absent.cmf", rfc_key)
    assert not (tmp_path / "absent.cmf.sig").exists()


def test_sha256_is_chunked(model, monkeypatch):
    monkeypatch.setattr(sigmod, "_CHUNK", 4093)  # many odd-sized chunks
    seen = []
    digest = sha256_file(model, progress=seen.append)
    assert digest == hashlib.sha256(model.read_bytes()).digest()
    assert sum(seen) == model.stat().st_size and len(seen) == -(-model.stat().st_size // 4093)
    assert max(seen) == 4093


def test_unreadable_sig(model, rfc_key):
    sig = sign_file(model, rfc_key)
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    sig.chmod(0)
    try:
        with pytest.raises(SignatureError, match="cannot read"):
            verify_signature(model)
    finally:
        sig.chmod(0o644)
