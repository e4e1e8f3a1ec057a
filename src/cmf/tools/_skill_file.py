"""Standalone skill files (spec §9.1, REFERENCE_NOTES §1.12): ``export`` cuts a specialist into
the tensors that differ from its base, bound to the base's exact bytes by the directory hash;
``apply`` overlays such a file on a copy of the base and writes the complete model again.

Byte equivalence: the skill file keeps the specialist's header (only ``skills`` differs) and its
mask catalog, and pycmf records the specialist's own registry under ``provenance.registry``
(an object holding the specialist's ``skills`` value, empty when it had no such key). ``apply``
restores it, takes the base's tensors in the base's directory
order with the skill's replacing same-named ones and the base's vocab, so the result is the
specialist byte for byte when the specialist was a model of the base's layout. A skill file from
another tool (no ``registry``) gets the reference behaviour: ``skills`` = its record without
``base_dir_hash``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..format.errors import SkillBaseMismatch
from ..format.reader import open as cmf_open
from ..format.writer import CmfWriter
from ._skill_graft import SkillError, check_skill_id, layer_of

log = logging.getLogger(__name__)


def dir_hash_hex(f) -> str:
    """The 16-hex ``hash64`` of a file's directory bytes, as the envelope stores it."""
    return f"{int(f.envelope.dir_hash):016x}"


def export_skill(specialist: str | os.PathLike, base: str | os.PathLike, skill_id: str,
                 output: str | os.PathLike) -> dict[str, Any]:
    """Write the standalone skill file of ``specialist`` against ``base``; returns a report.

    Keeps every tensor whose name+hash64 (and dtype/shape) differ from the base, under its
    original name, plus the specialist's masks (and sparse index); no vocab. One registry record:
    ``id``, ``layers``, ``base_dir_hash``, ``base_arch``, ``task``, ``provenance`` → SKILL_FILE.
    """
    check_skill_id(skill_id)
    with cmf_open(specialist) as s, cmf_open(base) as b:
        for f in (s, b):
            if f.is_skill_file:
                raise SkillError(f"{f.path} is already a standalone skill file")
        keep = []
        for t in s.tensors():
            if t.name in b:
                o = b.tensor(t.name)
                if o.hash == t.hash and o.dtype == t.dtype and o.shape == t.shape and o.nbytes == t.nbytes:
                    continue
            keep.append(t)
        if not keep:
            raise SkillError(f"{s.path} has the same tensors as {b.path}: nothing to export")
        header = s.header.to_dict()
        record: dict[str, Any] = {"id": skill_id,
                                  "layers": sorted({li for t in keep if (li := layer_of(t.name)) is not None}),
                                  "base_dir_hash": dir_hash_hex(b), "base_arch": b.arch.arch_name}
        if s.masks is not None and s.masks.default_task:
            record["task"] = s.masks.default_task
        # The specialist's own registry, restored by apply (byte equivalence).
        registry = {"skills": header["skills"]} if "skills" in header else {}
        record["provenance"] = {"cut_from": s.path.name, "tensors": len(keep), "registry": registry}
        header["skills"] = [record]
        with CmfWriter(output, header) as w:
            for t in keep:
                w.add(t.name, t.dtype, t.shape, t.numpy(), hash=t.hash)
            if s.envelope.section("masks").present:
                idx = bytes(s.section_bytes("index")) if s.envelope.section("index").present else None
                w.set_masks(bytes(s.section_bytes("masks")), sparse_index=idx)
        return {"output": str(output), "id": skill_id, "tensors": len(keep),
                "bytes": sum(t.nbytes for t in keep), "base_dir_hash": record["base_dir_hash"],
                "layers": record["layers"], "size": Path(output).stat().st_size}


def apply_skill(base: str | os.PathLike, skill: str | os.PathLike, output: str | os.PathLike, *,
                force: bool = False) -> dict[str, Any]:
    """Overlay standalone skill file ``skill`` on ``base`` and write the complete model ``output``.

    Refuses (SkillBaseMismatch) when the base's directory hash is not the record's
    ``base_dir_hash``, unless ``force`` — then the result is out of spec, and a warning says so.
    """
    with cmf_open(base) as b, cmf_open(skill) as k:
        if b.is_skill_file:
            raise SkillError(f"{b.path} is a standalone skill file, not a base model")
        recs = [s for s in k.skills if s.base_dir_hash is not None]
        if not k.is_skill_file or len(recs) != 1:
            raise SkillError(f"{k.path} is not a standalone skill file (SKILL_FILE with one record "
                             f"carrying base_dir_hash)")
        rec = recs[0]
        have = dir_hash_hex(b)
        forced = False
        if rec.base_dir_hash.lower() != have:
            if not force:
                raise SkillBaseMismatch(f"{k.path}: skill {rec.id!r} was cut against a base with directory "
                                        f"hash {rec.base_dir_hash}, but {b.path} has {have} "
                                        f"(--force applies it anyway; the result is out of spec)")
            log.warning("%s: base directory hash %s != the skill's key %s; applying anyway: the result "
                        "is out of spec", b.path, have, rec.base_dir_hash)
            forced = True
        for t in k.tensors():
            if t.name not in b:
                log.warning("%s: tensor %s is not in the base; dropped", k.path, t.name)
            elif b.tensor(t.name).shape != t.shape:
                raise SkillError(f"{k.path}: tensor {t.name} has shape {list(t.shape)}, the base's is "
                                 f"{list(b.tensor(t.name).shape)}")
        header = k.header.to_dict()
        raw = dict(rec.raw)
        prov = raw.get("provenance")
        registry = prov.get("registry") if isinstance(prov, dict) else None
        if isinstance(registry, dict):
            if "skills" in registry:
                header["skills"] = registry["skills"]
            else:
                header.pop("skills", None)
        else:
            raw.pop("base_dir_hash", None)
            header["skills"] = [raw]
        replaced = 0
        with CmfWriter(output, header) as w:
            for t in b.tensors():
                src = k.tensor(t.name) if t.name in k else t
                replaced += src is not t
                w.add(src.name, src.dtype, src.shape, src.numpy(), hash=src.hash)
            if k.envelope.section("masks").present:
                idx = bytes(k.section_bytes("index")) if k.envelope.section("index").present else None
                w.set_masks(bytes(k.section_bytes("masks")), sparse_index=idx)
            if b.tokenizer_json is not None:
                w.set_vocab(b.tokenizer_json)
    return {"output": str(output), "id": rec.id, "replaced": replaced, "forced": forced,
            "size": Path(output).stat().st_size}


__all__ = ["apply_skill", "dir_hash_hex", "export_skill"]
