"""``cmf requant IN -o OUT --quant DTYPE``: re-encode the matrices of a model.

Each selected matrix is dequantized to f32 and encoded again (REFERENCE_NOTES §1.8: that is
also how q4_tiled/q4_block become q4tp, so values move slightly; ``cmf quant-report`` measures
by how much). Which matrices, and which dtype each gets, is the converter's policy
(:class:`cmf.convert.policy.Policy`): 1-D tensors, tensors under 32 elements and the
precision-critical ones it keeps f16 (MoE routers, shared-expert gates, ``g_proj``, conv1d,
GDN a/b) are not quantized — stored at f32 they become f16, as ``convert`` writes them
(``policy.kept_small``), otherwise they are kept —, a matrix whose input width is not a multiple of 32 gets q8_2f
when the quant needs whole groups, and ``q2tp`` is the profile (expert or dense FFN gate/up
q2tp, the rest q4tp). Matrices already in their target dtype, reserved dtypes and token→expert
tables are kept byte for byte; so are masks, vocab, skills and the header (``quant_type``
follows the quant when no ``--include`` narrowed the selection). vbit is water-filled per
matrix (no MoE joint budget). Every source payload's hash64 is checked before it is used.

Two ways to write:

- ``-o OUT``: a fresh file through :class:`~cmf.format.writer.CmfWriter` (streaming: one
  tensor in memory at a time; temp file + fsync + atomic rename). A shard set becomes one file.
- ``--in-place``: the reference's recode-in-place (``recode_entries_in_place``): same layout,
  same path. All new payloads are encoded first into a spool file beside the model and checked
  against their old slots; if any is larger than its slot nothing is modified and the command
  explains which tensors do not fit. Otherwise each payload overwrites its slot (the rest of
  the slot is zeroed), then the directory is rewritten with the new dtype, nbytes and hash
  (same size: names and shapes do not change), and last the envelope's directory hash (and
  the QUANT_2F feature bit) — the header, and so ``quant_type``, stay as they were, like the
  reference. The slots are patched in a copy of the file made beside it (``copy_file_range``:
  a reflink or an in-kernel copy), which is synced and renamed over the file: a disk that
  fills or an EIO at any point leaves the old file as it was and no temporary file (issue 28);
  a kill leaves the old file too, with dot-named temporary files beside it. It needs free
  space for one copy of the file (none on a reflinking filesystem); a server that has the file
  mapped keeps serving the old version, as for any rename.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import fmt_bytes, print_json, sanitize, table
from ._calib_args import add_calib_arguments, add_size_arguments, calib_progress

log = logging.getLogger(__name__)

NAME = "requant"
SUMMARY = "re-encode a model's matrices to another quant (q4t -> q4tp, q8 -> q4tp, ...), or in place"
QUANT_HELP = "target: f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp (profile), vbit, q1, q1p, q1s, q1t"


def _selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    if include and not any(fnmatch.fnmatchcase(name, g) for g in include):
        return False
    return not any(fnmatch.fnmatchcase(name, g) for g in exclude)


def target_of(policy, t, include: Sequence[str] = (), exclude: Sequence[str] = (),  # noqa: ANN001
              values: np.ndarray | None = None) -> tuple[Any, str]:
    """(Choice or None, reason) for one stored tensor: what requant does with it and why
    (``policy.stored_target`` with the ``--include``/``--exclude`` globs applied). ``values``: its
    stored array, for the f16 range check of the tensors kept out of the quantizers."""
    from ..convert.policy import stored_target

    return stored_target(policy, t, _selected(t.name, include, exclude), values)


def _policy(quant: str, names: Sequence[str], mean_bits: float | None):
    from ..convert.policy import Policy, is_expert

    return Policy.make(quant, mean_bits=mean_bits, has_experts=any(is_expert(n) for n in names))


def _checked_view(path: Path, t) -> np.ndarray:  # noqa: ANN001
    from ..format.errors import HashMismatch
    from ..format.hash64 import hash64

    view = t.numpy()
    if hash64(view) != t.hash:
        raise HashMismatch(f"{path}: tensor {t.name!r} does not match its stored hash; refusing to requant a "
                           f"corrupt file")
    return view


def _reencode(t, view: np.ndarray, choice, cal=None) -> bytes:  # noqa: ANN001
    from .. import calib, quant

    w = quant.decode(view, t.dtype, t.shape)
    if cal is not None:
        return calib.encode(w, choice.dtype, cal.get(t.name), **choice.options)
    return quant.encode(w, choice.dtype, **choice.options)


def requant(src: str | os.PathLike, dst: str | os.PathLike | None = None, *, quant: str,
            include: Sequence[str] = (), exclude: Sequence[str] = (), in_place: bool = False,
            mean_bits: float | None = None, progress: Callable[[int], None] | None = None,
            calib: Any = None, calib_tokens: int | None = None,
            calib_progress: Callable[[str, int, int], None] | None = None, target_mb: float | None = None,
            bpw: float | None = None, budget_cache: dict | None = None,
            sensitivity_tokens: int | None = None) -> dict[str, Any]:
    """Re-encode the matrices of ``src`` as ``quant`` into ``dst`` (or in place); returns a report.

    ``include``/``exclude`` are shell globs on tensor names. ``progress(n)`` is called with the
    bytes of each source tensor processed. ``calib``: a text ``src`` is run on first, for
    activation-aware encoding (cmf.calib; ``calib_progress(stage, n, total)`` reports progress, cmf.calib.Progress).
    ``target_mb`` / ``bpw``: per-matrix dtypes along the ladder (q2tp, vbit 3, q4tp, vbit 5/6, q8_row) chosen so
    the whole file fits (cmf.convert.budget; ``quant`` still decides what stays fixed;
    ``budget_cache``: a dict reused across calls on one model to measure each candidate once),
    weighing matrices by their sensitivity measured on ``sensitivity_tokens`` tokens of the
    calibration text (default 128 with a target and a text, 0 = not measured). ``calib`` may also be a
    :class:`cmf.calib.Calibration` already collected on ``src``. Raises WriterError when
    ``--in-place`` payloads do not fit, HashMismatch for a corrupt
    source, ShardError for an in-place shard set, CalibrationError for an unusable text.
    """
    from ..format.errors import CmfError, WriterError
    from ..format.writer import io_error

    if in_place == (dst is not None):
        raise WriterError("give exactly one of an output path (-o) and --in-place")
    budget = None
    if target_mb is not None or bpw is not None:
        if in_place:
            raise WriterError("--target-mb/--bpw change payload sizes: write a new file with -o, not --in-place")
        from ..convert.budget import target_bytes
        from ..format.reader import open as cmf_open

        with cmf_open(src) as f:
            total = sum(t.numel for t in f.tensors())
            own, padding = _file_overhead(f)
        budget = (target_bytes(target_mb, bpw, total) - own - padding, padding)
    cal = None
    if calib is not None and not isinstance(calib, (str, os.PathLike)):
        cal = calib  # a Calibration collected before
    elif calib is not None:
        from .. import calib as _calib
        from ..convert.calibrate import check_text, sensitivity_tokens_for

        cal = _calib.collect(src, check_text(calib), max_tokens=calib_tokens or _calib.DEFAULT_MAX_TOKENS,
                             progress=calib_progress,
                             sensitivity_tokens=sensitivity_tokens_for(sensitivity_tokens, target_mb, bpw))
    if in_place:
        try:
            return _in_place(Path(src), quant, include, exclude, mean_bits, progress, cal)
        except OSError as exc:
            if isinstance(exc, CmfError):
                raise
            raise io_error(exc, f"{src}: {{reason}} while recoding in place; the file is unchanged and no "
                                f"temporary file is left") from None
    return _rewrite(Path(src), Path(dst), quant, include, exclude, mean_bits, progress, cal, budget, budget_cache)


def _file_overhead(f) -> tuple[int, int]:  # noqa: ANN001 - a CmfFile
    """Bytes of a rewrite of ``f`` that are not tensor payloads, at most: (its own envelope,
    header, directory, masks and vocab — everything but the data section — plus one 4 KiB
    alignment step for the provenance the header gains; the worst-case alignment padding of every
    payload, packed: 63 bytes each). --target-mb / --bpw then bound the whole file, which is
    written packed (every payload on 64 bytes: budget_padding); the budget spends the padding
    the exact layout does not need."""
    from ..convert.budget import worst_padding
    from ..format.constants import DATA_ALIGN

    tensors = list(f.tensors())
    own = f.size - f.data_len + DATA_ALIGN
    return max(own, 0), worst_padding(t.nbytes for t in tensors)


def _entry(t, choice, new_nbytes: int | None, reason: str) -> dict[str, Any]:  # noqa: ANN001
    return {"name": t.name, "shape": list(t.shape), "from": t.dtype.label,
            "to": choice.dtype if choice is not None else t.dtype.label, "reason": reason,
            "bytes_before": t.nbytes, "bytes_after": t.nbytes if new_nbytes is None else new_nbytes}


def _summary(src: Path, out: Path, quant: str, entries: list[dict[str, Any]], mode: str,
             header_quant: str) -> dict[str, Any]:
    changed = [e for e in entries if e["from"] != e["to"]]
    return {"input": str(src), "output": str(out), "mode": mode, "quant": quant, "quant_type": header_quant,
            "tensors": len(entries), "changed": len(changed),
            "bytes_before": sum(e["bytes_before"] for e in entries),
            "bytes_after": sum(e["bytes_after"] for e in entries), "entries": entries}


def _rewrite(src: Path, dst: Path, quant: str, include, exclude, mean_bits, progress, cal=None,
             budget: tuple[int, int] | None = None, budget_cache: dict | None = None) -> dict[str, Any]:
    """The rewrite into a new file. ``budget``: (bytes the payloads may take, padding reserved
    beyond that) for --target-mb / --bpw, None otherwise."""
    from ..format.errors import WriterError
    from ..format.reader import open as cmf_open
    from ..format.writer import CmfWriter

    entries: list[dict[str, Any]] = []
    with cmf_open(src) as f:
        if dst.exists() and any(dst.resolve() == p.resolve() for p in f.paths):
            raise WriterError(f"{dst}: the output would overwrite the input; use --in-place or another path")
        policy = _policy(quant, f.keys(), mean_bits)
        header = f.header.to_dict()
        header.pop("shard", None)
        if cal is not None and isinstance(header.get("provenance"), dict):
            header["provenance"].setdefault("options", {})["calib"] = cal.provenance()
        moved: dict[str, Any] = {}
        if budget is not None:
            from ..convert.budget import file_budget

            bplan, moved = file_budget(f, policy, lambda n: _selected(n, include, exclude), budget[0], cal,
                                       cache=budget_cache, reserved=budget[1])
            if isinstance(header.get("provenance"), dict):
                header["provenance"].setdefault("options", {})["budget"] = bplan.summary()
        with CmfWriter(dst, header, packed=budget is not None) as w:
            for t in f.tensors():
                view = _checked_view(src, t)
                choice, reason = target_of(policy, t, include, exclude, view)
                if t.name in moved:
                    choice, reason = moved[t.name], "budget"
                    if choice.dtype == t.dtype.label:
                        choice, reason = None, "already " + t.dtype.label + " (budget)"
                if choice is None:
                    w.add(t.name, t.dtype, t.shape, view, hash=t.hash)
                    entries.append(_entry(t, None, None, reason))
                else:
                    payload = _reencode(t, view, choice, cal)
                    w.add(t.name, choice.dtype, t.shape, payload)
                    entries.append(_entry(t, choice, len(payload), reason))
                if progress is not None:
                    progress(t.nbytes)
            if f.envelope.section("masks").present:
                idx = bytes(f.section_bytes("index")) if f.envelope.section("index").present else None
                w.set_masks(bytes(f.section_bytes("masks")), sparse_index=idx)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
            qt = header.get("quant_type")
            if any(e["from"] != e["to"] for e in entries) and not include:
                qt = policy.quant_type
                w.update_header(quant_type=qt)
    return _summary(src, dst, quant, entries, "rewrite", str(qt))


def _in_place(path: Path, quant: str, include, exclude, mean_bits, progress, cal=None) -> dict[str, Any]:
    from ..format.constants import QUANT_2F_DTYPES, Feature
    from ..format.directory import RECORD_DTYPE
    from ..format.errors import ShardError, WriterError
    from ..format.hash64 import hash64
    from ..format.reader import open as cmf_open
    from ..format.writer import fsync_dir
    from ..quant import resolve_dtype

    fd, spool_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".requant", dir=path.parent)
    spool = Path(spool_name)
    try:
        entries: list[dict[str, Any]] = []
        patches: list[tuple[int, int, int, int, int, int, int]] = []  # rec, dtype, slot off, old, spool off, new, hash
        misfit: list[str] = []
        cursor = 0
        with cmf_open(path, shards=False) as f:
            if f.header.shard is not None and f.header.shard.count > 1:
                raise ShardError(f"{path}: --in-place works on a single file, not a shard of a set; use -o")
            env = f.envelope
            dir_sec = env.section("dir")
            directory = bytearray(f.section_bytes("dir"))
            policy = _policy(quant, f.keys(), mean_bits)
            for i, t in enumerate(f.tensors()):
                view = _checked_view(path, t)
                choice, reason = target_of(policy, t, include, exclude, view)
                if choice is None:
                    entries.append(_entry(t, None, None, reason))
                else:
                    payload = _reencode(t, view, choice, cal)
                    n = len(payload)
                    entries.append(_entry(t, choice, n, reason))
                    if n > t.nbytes:
                        misfit.append(f"{t.name} ({t.dtype.label} {t.nbytes} B -> {choice.dtype} {n} B)")
                    elif not misfit:
                        os.pwrite(fd, payload, cursor)
                        patches.append((i, int(resolve_dtype(choice.dtype)), t.offset, t.nbytes, cursor, n,
                                        hash64(payload)))
                        cursor += n
                if progress is not None:
                    progress(t.nbytes)
            features = env.features
            sections, header_hash, version, flags = env.sections, env.header_hash, env.version, env.flags
            old_dtypes = [int(f.tensor(n).dtype) for n in f.keys()]
        if misfit:
            more = f" and {len(misfit) - 5} more" if len(misfit) > 5 else ""
            raise WriterError(f"{path}: --in-place refused, nothing was modified: {len(misfit)} new payload(s) "
                              f"do not fit their old slot: {'; '.join(misfit[:5])}{more}. Write a new file "
                              f"with -o instead")
        records = np.frombuffer(directory, dtype=RECORD_DTYPE, count=len(old_dtypes), offset=16)
        for rec, dt, *_rest, new_n, h in patches:
            records[rec]["dtype"] = dt
            records[rec]["nbytes"] = new_n
            records[rec]["hash"] = h
            old_dtypes[rec] = dt
        if any(d in QUANT_2F_DTYPES for d in old_dtypes):
            features |= int(Feature.QUANT_2F)
        else:
            features &= ~int(Feature.QUANT_2F)
        _commit(path, fd, patches, bytes(directory), dir_sec.off, features, sections, header_hash, version, flags)
        log.debug("%s: recoded %d tensors in place", path, len(patches))
    finally:
        os.close(fd)
        spool.unlink(missing_ok=True)
    fsync_dir(path.parent)
    with cmf_open(path, shards=False) as f:
        header_quant = f.header.quant_type
    return _summary(path, path, quant, entries, "in-place", header_quant)


def _commit(path: Path, spool_fd: int, patches, directory: bytes, dir_off: int, features: int, sections,
            header_hash: int, version: int, flags: int) -> None:
    """A copy of ``path`` with the payloads in their slots, the directory and the envelope
    patched, synced and renamed over it (the old file is untouched until the rename)."""
    from ..format.envelope import Envelope
    from ..format.hash64 import hash64
    from ..format.writer import apply_output_mode, copy_range

    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        src = os.open(path, os.O_RDONLY)
        try:
            copy_range(src, fd, os.fstat(src).st_size)
        finally:
            os.close(src)
        for _rec, _dt, slot, old_n, at, new_n, _h in patches:
            data = os.pread(spool_fd, new_n, at)
            _pwrite_all(fd, data + bytes(old_n - new_n), slot)
        _pwrite_all(fd, directory, dir_off)
        env = Envelope(features=features, sections=dict(sections), header_hash=header_hash,
                       dir_hash=hash64(directory), version=version, flags=flags)
        _pwrite_all(fd, env.pack(), 0)
        apply_output_mode(fd, path)  # mkstemp made it 0600; the file keeps its mode
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)  # the commit point
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    mv = memoryview(data)
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


# -- CLI --------------------------------------------------------------------------------------------


def render(d: dict[str, Any]) -> str:
    """A table of dtype transitions and a one-line total."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for e in d["entries"]:
        key = (e["from"], e["to"], "re-encoded" if e["from"] != e["to"] else e["reason"])
        g = groups.setdefault(key, [0, 0, 0])
        g[0] += 1
        g[1] += e["bytes_before"]
        g[2] += e["bytes_after"]
    rows = [[a, b, why, n, fmt_bytes(x), fmt_bytes(y)] for (a, b, why), (n, x, y) in sorted(groups.items())]
    out = table(rows, ["from", "to", "why", "tensors", "before", "after"], right=(3, 4, 5))
    verb = "recoded in place" if d["mode"] == "in-place" else f"-> {sanitize(d['output'])}"
    return (f"{out}\n{sanitize(d['input'])} {verb}: {d['changed']} of {d['tensors']} tensors re-encoded as "
            f"{sanitize(d['quant'])}, tensors {fmt_bytes(d['bytes_before'])} -> {fmt_bytes(d['bytes_after'])}, "
            f"quant_type {sanitize(d['quant_type'])}")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf requant``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    p.add_argument("model", metavar="IN", help="a .cmf file (any shard of a set when writing with -o)")
    p.add_argument("-o", "--output", metavar="OUT", help="the file to write")
    p.add_argument("--quant", required=True, metavar="DTYPE", help=QUANT_HELP)
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only tensors whose name matches (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip tensors whose name matches (repeatable)")
    p.add_argument("--in-place", action="store_true",
                   help="recode each payload in its slot, in a copy renamed over the file (refused, with the "
                        "reason, unless all fit)")
    p.add_argument("--mean-bits", type=float, metavar="N", help="vbit budget in bits per weight (3..8, default 4.25)")
    add_calib_arguments(p)
    add_size_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf requant``."""
    if bool(args.output) == bool(args.in_place):
        sys.stderr.write("cmf: error: give -o/--output or --in-place (see 'cmf requant --help')\n")
        return 2
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="requant", file=sys.stderr, leave=False)
    try:
        with calib_progress(args) as cal_bar:
            d = requant(args.model, args.output, quant=args.quant, include=args.include, exclude=args.exclude,
                        in_place=args.in_place, mean_bits=args.mean_bits,
                        progress=bar.update if bar is not None else None, calib=args.calib,
                        calib_tokens=args.calib_tokens, calib_progress=cal_bar, target_mb=args.target_mb,
                        bpw=args.bpw, sensitivity_tokens=args.sensitivity_tokens)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(d)
    else:
        print(render(d))
    return 0
