"""Detached Ed25519 signatures: ``<model>.sig`` next to the model (spec §8.2, REFERENCE_NOTES §1.14).

The hash chain inside a CMF file proves integrity, not authorship. A signature is a separate file,
``<model path>.sig``, so the container is never rewritten. Its bytes match the reference tool:
pretty-printed JSON (two-space indent, sorted keys, no trailing newline)::

    {
      "alg": "ed25519-sha256",
      "pubkey": "<64 hex>",
      "sha256": "<64 lowercase hex>",
      "sig": "<128 hex>"
    }

The signed message is the raw 32-byte SHA-256 digest of the whole file (pure Ed25519 over those
32 bytes: not Ed25519ph, not the hex text). The key file holds the hex of a 32-byte Ed25519 seed
(surrounding whitespace ignored); :func:`load_or_create_key` creates one from OS randomness when
the file does not exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .atomic import apply_output_mode
from .errors import IoError, SignatureError

log = logging.getLogger(__name__)

ALG = "ed25519-sha256"
DEFAULT_KEY_NAME = "cmf-signing.key"
SIG_SUFFIX = ".sig"
_CHUNK = 8 << 20  # bytes read per SHA-256 update; models are GBs, RAM stays at one chunk
_MAX_SIG_BYTES = 64 << 10  # a real .sig is ~300 bytes; refuse to parse anything huge
_HEX = {n: re.compile(rf"[0-9a-fA-F]{{{n}}}") for n in (64, 128)}

Progress = Callable[[int], None]


@dataclass(frozen=True)
class SignatureResult:
    """A signature that verified: which file, which ``.sig``, the signer and the file digest."""

    path: Path
    sig_path: Path
    pubkey: str  # 64 lowercase hex
    sha256: str  # 64 lowercase hex


def signature_path(model_path: str | os.PathLike) -> Path:
    """The detached signature's path: the model path with ``.sig`` appended (``m.cmf.sig``)."""
    p = Path(model_path)
    return p.with_name(p.name + SIG_SUFFIX)


def sha256_file(path: str | os.PathLike, progress: Progress | None = None) -> bytes:
    """Streaming SHA-256 of a whole file in fixed-size chunks; ``progress(n)`` per chunk read."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
                if progress is not None:
                    progress(n)
    except FileNotFoundError:
        raise IoError(f"{path}: no such file") from None
    except OSError as exc:
        raise IoError(f"{path}: {exc.strerror or exc}") from None
    return h.digest()


def _crypto() -> Any:
    """The Ed25519 primitives, imported on first use (keeps `import cmf` light)."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


def _key_from_hex(text: str, where: str) -> Any:
    seed = text.strip()
    if not _HEX[64].fullmatch(seed):
        raise SignatureError(f"{where}: a signing key must be 64 hex digits (a 32-byte Ed25519 seed)")
    return _crypto().Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed))


def load_or_create_key(path: str | os.PathLike | None = None) -> tuple[Any, bool]:
    """Load the Ed25519 signing key at ``path`` (default ``cmf-signing.key``), creating it if absent.

    Returns ``(Ed25519PrivateKey, created)``. A new key is 32 bytes of OS randomness, written as
    64 hex digits with mode 0600; an existing file is never overwritten (exclusive create).
    Raises SignatureError for a malformed key file, IoError when it cannot be read or written.
    """
    path = Path(DEFAULT_KEY_NAME if path is None else path)
    try:
        return _key_from_hex(path.read_text(encoding="ascii", errors="replace"), str(path)), False
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise IoError(f"{path}: is a directory, not a key file") from None
    except OSError as exc:
        raise IoError(f"{path}: cannot read the signing key: {exc.strerror or exc}") from None
    seed = os.urandom(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # created concurrently: use that one
        return load_or_create_key(path)
    except OSError as exc:
        raise IoError(f"{path}: cannot create a signing key: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(seed.hex())
        fh.flush()
        os.fsync(fh.fileno())
    log.info("new signing key written to %s", path)
    return _crypto().Ed25519PrivateKey.from_private_bytes(seed), True


def public_key_hex(key: Any) -> str:
    """The 64-hex public key of an Ed25519 private key."""
    from cryptography.hazmat.primitives import serialization

    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def sign_file(model_path: str | os.PathLike, key_path: str | os.PathLike | None = None, *,
              key: Any = None, progress: Progress | None = None) -> Path:
    """Sign ``model_path`` and write ``<model_path>.sig`` atomically (temp file + rename).

    The key is ``key`` (an Ed25519PrivateKey) when given, else loaded from ``key_path`` (default
    ``cmf-signing.key``, created if absent). Returns the ``.sig`` path.
    """
    model_path = Path(model_path)
    if key is None:
        key, _ = load_or_create_key(key_path)
    digest = sha256_file(model_path, progress)
    doc = {"alg": ALG, "pubkey": public_key_hex(key), "sha256": digest.hex(), "sig": key.sign(digest).hex()}
    text = json.dumps(doc, indent=2, sort_keys=True)  # serde_json::to_string_pretty bytes
    out = signature_path(model_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        apply_output_mode(tmp, out)  # umask-based for a new .sig, kept for a re-sign
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    log.info("signed %s (signer %s)", model_path, doc["pubkey"])
    return out


def _read_sig(sig_path: Path) -> dict[str, Any] | None:
    try:
        with open(sig_path, "rb") as fh:
            raw = fh.read(_MAX_SIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SignatureError(f"{sig_path}: cannot read the signature: {exc.strerror or exc}") from None
    if len(raw) > _MAX_SIG_BYTES:
        raise SignatureError(f"{sig_path}: malformed signature file (over {_MAX_SIG_BYTES} bytes)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SignatureError(f"{sig_path}: malformed signature file (not JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise SignatureError(f"{sig_path}: malformed signature file (not a JSON object)")
    return doc


def _hex_field(doc: dict[str, Any], key: str, n: int, sig_path: Path) -> str:
    v = doc.get(key)
    if not isinstance(v, str):
        raise SignatureError(f"{sig_path}: malformed signature file (no '{key}' string)")
    if not _HEX[n].fullmatch(v):
        raise SignatureError(f"{sig_path}: malformed signature file ('{key}' must be {n} hex digits)")
    return v.lower()


def verify_signature(model_path: str | os.PathLike, pubkey: str | None = None, *,
                     progress: Progress | None = None) -> SignatureResult | None:
    """Check ``<model_path>.sig`` if it exists; None when there is no signature file.

    Order as the reference: the alg must be ``ed25519-sha256``; a pinned ``pubkey`` (hex,
    case-insensitive) must equal the signer; the file's SHA-256 is recomputed and compared with
    the recorded one; then the Ed25519 signature over the raw digest is checked. Every failure
    raises SignatureError naming the file and what did not match.
    """
    model_path = Path(model_path)
    sig_path = signature_path(model_path)
    doc = _read_sig(sig_path)
    if doc is None:
        return None
    alg = doc.get("alg")
    if alg != ALG:
        raise SignatureError(f"{sig_path}: unknown signature alg {alg!r} (expected {ALG!r})")
    signer = _hex_field(doc, "pubkey", 64, sig_path)
    if pubkey is not None and pubkey.strip().lower() != signer:
        raise SignatureError(f"{sig_path}: signed by {signer}, not by the expected key {pubkey.strip()}")
    sig = _hex_field(doc, "sig", 128, sig_path)
    claimed = _hex_field(doc, "sha256", 64, sig_path)
    digest = sha256_file(model_path, progress)
    if digest.hex() != claimed:
        raise SignatureError(f"{model_path}: SHA-256 {digest.hex()} differs from the signed {claimed}: "
                             "the file is not the one that was signed")
    from cryptography.exceptions import InvalidSignature

    try:
        _crypto().Ed25519PublicKey.from_public_bytes(bytes.fromhex(signer)).verify(bytes.fromhex(sig), digest)
    except InvalidSignature:
        raise SignatureError(f"{sig_path}: signature INVALID for signer {signer}") from None
    except ValueError as exc:  # a public key that is not a valid curve point
        raise SignatureError(f"{sig_path}: malformed public key: {exc}") from None
    return SignatureResult(path=model_path, sig_path=sig_path, pubkey=signer, sha256=digest.hex())


__all__ = ["ALG", "DEFAULT_KEY_NAME", "SignatureResult", "load_or_create_key", "public_key_hex",
           "sha256_file", "sign_file", "signature_path", "verify_signature"]
