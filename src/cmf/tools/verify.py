"""``cmf verify``: the whole integrity chain, and authenticity when a ``.sig`` is present.

:func:`verify_model` opens the model (each shard on its own, then the set), runs
``CmfFile.verify()`` (envelope header/dir hashes, section hashes, every tensor's hash64) and
checks the detached signature next to each file (spec §8.2). A shard whose siblings are absent
is verified alone (spec §10: every shard is a standalone file), and the report says so. A file
that exists but fails validation is a *finding* (problems), not a usage error: only a path that cannot be read at all
(missing, a directory, no permission) raises.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..format.errors import CmfError, FileNotFound, IoError, MissingShard, SignatureError
from ..format.reader import open as cmf_open
from ..format.signature import signature_path, verify_signature
from ..image.components import components, render_lines
from . import fmt_bytes, fmt_count, print_json, sanitize

NAME = "verify"
SUMMARY = "check the whole hash chain and the detached signature, if any"
PROGRESS_MIN_BYTES = 256 * 10**6  # draw a progress bar only for files larger than this

ProgressFactory = Callable[[str, int], Callable[[int], None]]


def verify_model(path: str | os.PathLike, pubkey: str | None = None, *,
                 progress: ProgressFactory | None = None) -> dict[str, Any]:
    """Verify ``path`` and return ``{"path", "files", "tensors", "bytes", "ok", "problems", "signatures",
    "shard_alone"}``.

    A shard whose siblings are all present is verified with its whole set. When siblings are
    missing the file is verified alone (spec §10) and ``shard_alone`` is ``{"no", "count",
    "missing"}`` (1-based shard numbers); otherwise it is None.

    ``signatures`` has one entry per file: ``status`` "valid" (with ``pubkey``), "absent" or
    "invalid" (with ``error``). With ``pubkey`` pinned, a file without a ``.sig`` is a problem.
    ``progress(label, total_bytes)`` returns a callback fed with bytes processed.
    Raises FileNotFound / IoError when ``path`` cannot be read at all.
    """
    path = Path(path)
    report: dict[str, Any] = {"path": str(path), "files": [str(path)], "tensors": 0, "bytes": 0,
                              "ok": False, "problems": [], "signatures": [], "shard_alone": None}
    problems: list[str] = report["problems"]
    try:
        try:
            f = cmf_open(path)
        except MissingShard as exc:
            # Spec §10: every shard is a standalone file, so verify works on one without its siblings.
            f = cmf_open(path, shards=False)
            report["shard_alone"] = {"no": exc.no, "count": exc.count, "missing": list(exc.missing)}
    except (FileNotFound, IoError):
        raise
    except CmfError as exc:
        problems.append(f"cannot open: {exc}")
        return report
    with f:
        report["files"] = [str(p) for p in f.paths]
        report["tensors"] = len(f)
        report["bytes"] = f.size
        if len(f.paths) > 1:  # every shard must also be a valid file on its own
            for p in f.paths:
                try:
                    cmf_open(p, shards=False).close()
                except CmfError as exc:
                    problems.append(f"shard {p.name} does not open on its own: {exc}")
        comps = components(f)
        if comps is not None:  # a pipeline container (spec §12): what the hashes cover, per component
            report["components"] = comps
        tensor_bytes = sum(t.nbytes for t in f.tensors())
        cb = progress("hash64", tensor_bytes) if progress else None
        problems += f.verify(progress=cb)
        paths = list(f.paths)
    for p in paths:
        entry: dict[str, Any] = {"file": str(p)}
        try:
            has_sig = signature_path(p).exists()
            cb = progress("sha256", p.stat().st_size) if progress and has_sig else None
            res = verify_signature(p, pubkey, progress=cb)
        except SignatureError as exc:
            entry.update(status="invalid", error=str(exc))
            problems.append(f"signature: {exc}")
        else:
            if res is None:
                entry["status"] = "absent"
                if pubkey is not None:
                    problems.append(f"{p.name}: no signature ({p.name}.sig) but --pubkey asks for one")
            else:
                entry.update(status="valid", pubkey=res.pubkey, sha256=res.sha256)
        report["signatures"].append(entry)
    report["ok"] = not problems
    return report


def render(r: dict[str, Any]) -> str:
    """Text of :func:`verify_model`'s report: a verdict line, then problems or signature lines."""
    name = sanitize(r["path"])
    n_files = len(r["files"])
    scope = f"{r['tensors']} tensors, {fmt_bytes(r['bytes'])}" + (f" in {n_files} shards" if n_files > 1 else "")
    if r["ok"]:
        lines = [f"{name}: OK ({scope})"]
    else:
        n = len(r["problems"])
        lines = [f"{name}: FAILED, {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {sanitize(p)}" for p in r["problems"]]
    if r.get("components"):
        lines.append("components:")
        lines += [sanitize(x) for x in render_lines(r["components"], fmt_count, fmt_bytes)]
    alone = r.get("shard_alone")
    if alone:
        missing = ", ".join(str(n) for n in alone["missing"])
        lines.append(f"verified shard {alone['no']} of {alone['count']} alone: siblings absent (missing {missing})")
    sigs = r["signatures"]
    valid = [s for s in sigs if s["status"] == "valid"]
    if valid and len(valid) == len(sigs):
        signers = sorted({s["pubkey"] for s in valid})
        lines.append(f"signature: valid (ed25519, signer {', '.join(signers)})")
    elif sigs and all(s["status"] == "absent" for s in sigs):
        lines.append("signature: none")
    elif len(sigs) == 1:
        lines.append(f"signature: {sigs[0]['status']}")
    elif sigs:
        for s in sigs:
            lines.append(f"signature {sanitize(Path(s['file']).name)}: {s['status']}"
                         + (f" (signer {s['pubkey']})" if s["status"] == "valid" else ""))
    return "\n".join(lines)


def _noop(n: int) -> None:
    pass


def _tqdm_progress() -> ProgressFactory | None:
    """Progress bars (tqdm, stderr) when stderr is a TTY; each pass over less than 256 MB gets none."""
    if not sys.stderr.isatty():
        return None
    bars: list[Any] = []

    def factory(label: str, total: int) -> Callable[[int], None]:
        for b in bars:
            b.close()
        if total <= PROGRESS_MIN_BYTES:
            return _noop
        from tqdm import tqdm

        bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                   file=sys.stderr, leave=False)
        bars.append(bar)

        def update(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return update

    return factory


def pubkey_arg(text: str) -> str:
    """argparse type of ``--pubkey``: 64 hex digits (an Ed25519 public key), kept as given."""
    t = text.strip()
    if len(t) != 64 or any(c not in "0123456789abcdefABCDEF" for c in t):
        raise argparse.ArgumentTypeError("must be 64 hex digits (an Ed25519 public key)")
    return t


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf verify``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Exit 1 when a problem is found.")
    p.add_argument("model", metavar="MODEL", help="a .cmf file (any shard of a set)")
    p.add_argument("--pubkey", metavar="HEX", type=pubkey_arg, help="require a signature by this Ed25519 public key (64 hex)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf verify``: 0 clean, 1 problems found."""
    report = verify_model(args.model, args.pubkey, progress=_tqdm_progress())
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0 if report["ok"] else 1
