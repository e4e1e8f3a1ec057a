"""The folder vLLM reads its config from: ``prepare(path)`` writes it once per file.

vLLM resolves ``model`` to a Hugging Face folder (or hub id) for its config, tokenizer and chat
template before any weight is loaded, so a CMF file is served as a small folder holding exactly
what ``cmf export`` writes minus the safetensors (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja), plus ``cmf_source.json`` naming the
CMF file whose tensors the ``cmf`` load format streams. The folder lives in the pycmf cache,
keyed by the file's header hash, and is rebuilt when missing; writing it is atomic (a temporary
folder renamed into place) so engines started side by side never see half of one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...convert.export import EXPORT_DTYPES, TORCH_NAMES, config_for, write_json, write_tokenizer
from ...format.hash64 import hash64
from ...format.reader import CmfFile
from ...format.reader import open as cmf_open
from .errors import StaleFolder, UnsupportedSelection

log = logging.getLogger(__name__)

SOURCE_FILE = "cmf_source.json"
FORMAT_VERSION = 2  # bump when the folder's contents change, so older folders are rebuilt


def cache_root() -> Path:
    """``$PYCMF_VLLM_CACHE``, else ``<pycmf cache>/vllm``."""
    if os.environ.get("PYCMF_VLLM_CACHE"):
        return Path(os.environ["PYCMF_VLLM_CACHE"]).expanduser()
    from ...samples import cache_dir

    return cache_dir() / "vllm"


def file_key(f: CmfFile) -> str:
    """A hex key naming ``f``: its header hash (every shard's, for a set), 16 hex digits per shard.

    A writer that left the envelope's header hash at 0 (absent) gets hash64 of the header bytes.
    """
    keys = []
    for i in range(len(f.paths)):
        part = f._parts[i]  # noqa: SLF001 - the reader keeps per-shard envelopes here
        h = part.envelope.header_hash or hash64(f.section_bytes("header", i))
        keys.append(f"{h:016x}")
    return "-".join(keys)


def _source_record(f: CmfFile) -> dict[str, Any]:
    from ... import __version__

    return {"format": FORMAT_VERSION, "path": str(Path(f.path).resolve()), "key": file_key(f),
            "shards": [str(Path(p).resolve()) for p in f.paths], "pycmf": __version__}


def write_folder(f: CmfFile, out: Path, quantized: str = "dequantize", skill: str | None = None) -> dict[str, Any]:
    """Write the config/tokenizer files of ``f`` (as ``cmf export`` does, no weights) into ``out``.

    ``quantized="keep"`` adds the compressed-tensors ``quantization_config`` of the weights the
    loader will hand over as integers (:mod:`.quantized`), with ``skill``'s tensors in place of
    the backbone's (their dtypes decide too); the rest of config.json is the export's.
    """
    if f.is_skill_file:
        raise UnsupportedSelection(f"{f.path}: a standalone skill file is not a model; graft it onto its base "
                                   "first (`cmf skill apply`)")
    prov = f.header.provenance
    cfg, mt = config_for(f.header.arch.raw, prov)
    # The same dtype default as `cmf export`: the source checkpoint's, else f32; vLLM's --dtype overrides.
    dtype = TORCH_NAMES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), "f32")
    cfg["dtype" if "torch_dtype" not in cfg else "torch_dtype"] = EXPORT_DTYPES[dtype][2]
    kept = 0
    if quantized == "keep":
        from .quantized import quantization_config
        from .weights import kept_plan

        plan = kept_plan(f, skill)
        qc = quantization_config(plan)
        kept = len(plan)
        if qc is not None:
            cfg["quantization_config"] = qc
        else:
            log.warning("%s: quantized=keep, but no weight has a layout vLLM takes exactly; all are dequantized", f.path)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", cfg)
    write_tokenizer(out, f, prov)
    rec = _source_record(f)
    rec["model_type"] = mt
    rec["quantized"] = quantized
    rec["skill"] = skill if quantized == "keep" else None
    rec["kept"] = kept
    write_json(out / SOURCE_FILE, rec)
    return rec


def prepare(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
            quantized: str | None = None, skill: str | None = None) -> Path:
    """The materialised folder for ``path`` (a .cmf, any shard of a set), written if missing.

    Pass the folder as vLLM's ``model`` with ``load_format="cmf"``: the loader reads the weights
    from the CMF file recorded in it. Idempotent and cheap once written (opens the file, compares
    the header hash). ``quantized``: ``dequantize`` (default) or ``keep`` (int8/int4 weights stay
    integers in vLLM, :mod:`.quantized`); each mode has its own folder (``<key>-keep``, and
    ``<key>-keep-<skill>`` with a skill, whose tensors may be stored in other dtypes).
    """
    from .quantized import MODES

    quantized = quantized or "dequantize"
    if quantized not in MODES:
        raise UnsupportedSelection(f"quantized={quantized!r}: choose one of {', '.join(MODES)}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    with cmf_open(path) as f:
        key = file_key(f)
        if quantized == "keep":
            key += "-keep" + (f"-{_safe(skill)}" if skill else "")
        folder = root / key
        rec_path = folder / SOURCE_FILE
        if rec_path.is_file():
            try:
                rec = json.loads(rec_path.read_text(encoding="utf-8"))
            except ValueError:
                rec = {}
            if rec.get("format") == FORMAT_VERSION and rec.get("path") == str(Path(f.path).resolve()):
                return folder
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=root))
        try:
            write_folder(f, tmp, quantized, skill if quantized == "keep" else None)
            if folder.exists():
                # Same header, other path (a copy of the file): the newest preparation wins.
                shutil.rmtree(folder, ignore_errors=True)
            try:
                os.replace(tmp, folder)
            except OSError:
                if not (folder / SOURCE_FILE).is_file():  # a concurrent prepare() won the rename: fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s: vLLM folder %s", path, folder)
    return folder


def _safe(name: str) -> str:
    """A skill id as a folder-name part (ids are free text)."""
    return "".join(c if c.isalnum() or c in "._" else "_" for c in name)[:64] + f"-{hash64(name.encode()) & 0xFFFF:04x}"


def read_source(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``cmf_source.json`` record of a materialised folder; StaleFolder when absent or unreadable."""
    p = Path(folder) / SOURCE_FILE
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StaleFolder(f"{folder}: no {SOURCE_FILE}; make the folder with "
                          "cmf.integrations.vllm.prepare(MODEL.cmf) (or `python -m cmf.integrations.vllm "
                          "prepare MODEL.cmf`), or name the file in model_loader_extra_config 'path'") from None
    except (OSError, ValueError) as exc:
        raise StaleFolder(f"{p}: unreadable ({exc})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("path"), str):
        raise StaleFolder(f"{p}: malformed (no 'path')")
    return rec


def check_fresh(f: CmfFile, rec: dict[str, Any]) -> None:
    """Refuse a folder whose config was made from another version of the file."""
    want = rec.get("key")
    if want is not None and want != file_key(f):
        raise StaleFolder(f"{f.path}: the file changed since its vLLM folder was made (header hash {file_key(f)} "
                          f"!= {want}); run prepare() again")
