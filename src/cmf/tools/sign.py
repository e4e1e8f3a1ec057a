"""``cmf sign``: detached Ed25519 signatures (spec §8.2, REFERENCE_NOTES §1.14).

:func:`sign_model` checks that the model opens (a CMF file, or a complete shard set), then writes
``<file>.sig`` next to every file of the set with one key. The model itself is never modified.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..format.reader import open as cmf_open
from ..format.signature import DEFAULT_KEY_NAME, load_or_create_key, public_key_hex, sign_file
from . import print_json, sanitize

NAME = "sign"
SUMMARY = "write a detached Ed25519 signature <model>.sig"


def sign_model(path: str | os.PathLike, key_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Sign every file of the model at ``path``; returns ``{"signatures", "pubkey", "key", "key_created"}``.

    The key file (default ``cmf-signing.key`` in the working directory) is created from OS
    randomness when absent.
    """
    with cmf_open(path) as f:
        paths = list(f.paths)
    key_file = Path(DEFAULT_KEY_NAME if key_path is None else key_path)
    key, created = load_or_create_key(key_file)
    sigs = [str(sign_file(p, key=key)) for p in paths]
    return {"signatures": sigs, "pubkey": public_key_hex(key), "key": str(key_file), "key_created": created}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf sign``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + " (one per file of a shard set).")
    p.add_argument("model", metavar="MODEL", help="a .cmf file (any shard of a set)")
    p.add_argument("--key", metavar="FILE", default=DEFAULT_KEY_NAME,
                   help=f"hex Ed25519 seed file, created if absent (default: {DEFAULT_KEY_NAME})")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf sign``."""
    result = sign_model(args.model, args.key)
    if result["key_created"]:
        sys.stderr.write(f"cmf: new signing key written to {sanitize(result['key'])}; keep it private\n")
    if args.json:
        print_json(result)
    else:
        for s in result["signatures"]:
            print(f"signed: {sanitize(s)}")
        print(f"pubkey: {result['pubkey']}")
    return 0
