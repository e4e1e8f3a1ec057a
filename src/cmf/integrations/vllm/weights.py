"""The weights vLLM reads from a CMF file: integrity check, skill indirection, task masks, HF names.

Nothing here imports vLLM or torch: the iterator yields (Hugging Face name, float32 numpy array)
one tensor at a time, decoded from the mmap with pycmf's codecs (quantized tensors are
dequantized), named and re-fused exactly as ``cmf export`` writes them. The vLLM loader
(:mod:`.loader`) casts each array to the serving dtype and hands it to ``model.load_weights``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from ...convert.export import OutTensor, config_for, tensor_plan, tensor_values
from ...convert.mla_layout import export_layout
from ...format.reader import CmfFile, QTensor
from .errors import IntegrityRefused, UnsupportedSelection
from .quantized import MODES, kept_arrays, plan_kept, quantization_config

log = logging.getLogger(__name__)

VERIFY_POLICIES = ("full", "signed", "off")
SKILL_PREFIX = "skill."


@dataclass(frozen=True)
class LoaderOptions:
    """What ``model_loader_extra_config`` may set for the ``cmf`` load format.

    ``verify``: ``full`` (default) checks the whole hash chain and a ``.sig`` when one lies next
    to the file; ``signed`` also requires a valid signature (``pubkey`` pins the signer); ``off``
    loads without checking (logged as a warning). ``skill``: a skill id whose tensors replace the
    backbone's. ``task``: a task mask name, or ``none`` to serve unmasked; a mask that restricts
    anything is refused (vLLM has no per-neuron gating). ``path``: the CMF file, overriding the one
    recorded in the materialised folder. ``quantized``: ``dequantize`` (floats, the default) or
    ``keep`` (q8_row and 4-bit group weights as compressed-tensors int8/int4, :mod:`.quantized`);
    None follows the folder.
    """

    verify: str = "full"
    pubkey: str | None = None
    skill: str | None = None
    task: str | None = None
    path: str | None = None
    quantized: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "LoaderOptions":
        """Parse vLLM's ``model_loader_extra_config`` (a dict, or None); unknown keys are refused."""
        extra = dict(extra or {})
        known = {"verify", "pubkey", "skill", "task", "path", "quantized"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise UnsupportedSelection(f"model_loader_extra_config: unknown key(s) {', '.join(unknown)} for the "
                                       f"cmf load format (known: {', '.join(sorted(known))})")
        opts = cls(**{k: (None if v is None else str(v)) for k, v in extra.items()})
        if opts.verify not in VERIFY_POLICIES:
            raise UnsupportedSelection(f"model_loader_extra_config.verify={opts.verify!r}: choose one of "
                                       f"{', '.join(VERIFY_POLICIES)}")
        if opts.quantized is not None and opts.quantized not in MODES:
            raise UnsupportedSelection(f"model_loader_extra_config.quantized={opts.quantized!r}: choose one of "
                                       f"{', '.join(MODES)}")
        return opts


def check_integrity(path: str | os.PathLike[str], policy: str = "full", pubkey: str | None = None) -> dict[str, Any]:
    """Run ``cmf verify``'s checks on ``path`` under ``policy``; raise IntegrityRefused on any problem.

    Returns the verify report (``{"skipped": True}`` for ``off``). The check reads every byte once
    (hash64 per tensor, SHA-256 for a signature), so it costs about one pass over the file.
    """
    if policy not in VERIFY_POLICIES:
        raise UnsupportedSelection(f"verify policy {policy!r}: choose one of {', '.join(VERIFY_POLICIES)}")
    if policy == "off":
        log.warning("%s: integrity check off (verify=off): the hash chain and signature are not checked", path)
        return {"path": str(path), "skipped": True}
    from ...tools.verify import verify_model  # lazy: pulls the image-pipeline helpers

    report = verify_model(path, pubkey)
    problems = list(report["problems"])
    if policy == "signed":
        unsigned = [s["file"] for s in report["signatures"] if s["status"] != "valid"]
        problems += [f"{Path(p).name}: no valid signature (verify=signed)" for p in unsigned
                     if not any(Path(p).name in q for q in problems)]
    if problems:
        raise IntegrityRefused(f"{path}: refused, the file fails its integrity check ({len(problems)} problem(s)): "
                               + "; ".join(problems[:5]), problems)
    signed = [s for s in report["signatures"] if s["status"] == "valid"]
    log.info("%s: hash chain OK (%d tensors)%s", path, report["tensors"],
             f", signed by {signed[0]['pubkey']}" if signed else ", no signature")
    return report


class SkillView:
    """A CmfFile as the export code sees it, with a skill's tensors in place of the backbone's.

    ``keys()`` lists only backbone names (``skill.*`` entries are never exported as tensors of
    their own); ``tensor``/``array`` of a replaced name read ``skill.{id}.{name}``.
    """

    def __init__(self, file: CmfFile, skill: str | None) -> None:
        self.file = file
        self.header = file.header
        self.skill = skill
        self.replaced: dict[str, str] = {}
        if skill is not None:
            ids = {s.id for s in file.skills}
            prefix = f"{SKILL_PREFIX}{skill}."
            self.replaced = {n[len(prefix):]: n for n in file.keys() if n.startswith(prefix)}
            if skill not in ids and not self.replaced:
                raise UnsupportedSelection(f"{file.path}: no skill {skill!r} (skills: "
                                           f"{', '.join(sorted(ids)) or 'none'})")
            missing = [n for n in self.replaced if n not in file]
            if missing:
                raise UnsupportedSelection(f"{file.path}: skill {skill!r} replaces tensors the backbone lacks: "
                                           f"{', '.join(missing[:3])}")

    def keys(self) -> list[str]:
        return [n for n in self.file.keys() if not n.startswith(SKILL_PREFIX)]

    def __contains__(self, name: object) -> bool:
        return name in self.file and not str(name).startswith(SKILL_PREFIX)

    def tensor(self, name: str) -> QTensor:
        t = self.file.tensor(self.replaced.get(name, name))
        return t

    def array(self, name: str) -> np.ndarray:
        return self.file.array(self.replaced.get(name, name))


def check_task(file: CmfFile, task: str | None, skill: str | None) -> str | None:
    """The task mask pycmf's runtime would apply (same rule as ``cmf run``); refuse one that restricts.

    vLLM's model code has no per-neuron, per-head or per-layer gates, so serving a masked file
    unmasked would silently give other tokens than ``cmf run``. Returns the mask's name when it
    restricts nothing (or None).
    """
    from ...runtime.task_masks import resolve_task, restricts

    name = resolve_task(file, task, skill)
    if name is None:
        return None
    mask = file.masks.get(name) if file.masks is not None else None
    if mask is None:
        raise UnsupportedSelection(f"{file.path}: no task mask {name!r} (masks: "
                                   f"{', '.join(m.name for m in file.masks.masks) if file.masks else 'none'})")
    if restricts(mask):
        raise UnsupportedSelection(
            f"{file.path}: task mask {name!r} applies by default and restricts neurons/heads/layers/experts, "
            "which vLLM cannot gate. Bake it into the weights first (`cmf defrag MODEL --task "
            f"{name} -o OUT.cmf`, FFN masks), or serve unmasked with model_loader_extra_config "
            "'{\"task\": \"none\"}'")
    return name


def hf_plan(file: CmfFile, skill: str | None = None) -> tuple[SkillView, list[OutTensor], Any, str]:
    """(view, the export's tensor plan, MLA layout, model_type) for ``file`` with ``skill`` active."""
    view = SkillView(file, skill)
    cfg, mt = config_for(file.header.arch.raw, file.header.provenance)
    plan = tensor_plan(view, mt)  # type: ignore[arg-type]  # duck-typed: keys/tensor/header
    return view, plan, export_layout(file.header.arch.raw, cfg), mt


def iter_hf_weights(file: CmfFile, skill: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor ``cmf export`` would write, one at a time.

    Each array is decoded when asked for and dropped by the caller, so RAM stays near one tensor
    (plus whatever vLLM keeps).
    """
    for name, arr, _ in iter_hf_tensors(file, skill):
        yield name, arr


def kept_plan(file: CmfFile, skill: str | None = None) -> dict[str, tuple[str, str]]:
    """HF weight name -> (scheme, CMF tensor) of the weights ``quantized: keep`` serves as integers."""
    view, plan, mla, _ = hf_plan(file, skill)
    return plan_kept(view, plan, mla)  # type: ignore[arg-type]


def check_kept_config(file: CmfFile, skill: str | None, have: Mapping[str, Any] | None, where: str) -> None:
    """Refuse when the layers vLLM built quantized (``have``, the folder's quantization_config) are
    not the ones ``file`` (with ``skill``) keeps: vLLM would get integers for a float layer or back."""
    want = quantization_config(kept_plan(file, skill)) or {}
    if dict(have or {}).get("config_groups") != want.get("config_groups"):
        raise UnsupportedSelection(f"{where}: the folder's quantization_config does not match the int8/int4 weights "
                                   f"of {file.path}{f' with skill {skill!r}' if skill else ''}; prepare the folder for "
                                   "this file and skill (prepare(path, quantized='keep', skill=...)) or pass the .cmf "
                                   "itself as model")


def iter_hf_tensors(file: CmfFile, skill: str | None = None,
                    quantized: str = "dequantize") -> Iterator[tuple[str, np.ndarray, bool]]:
    """(name, array, is_float_weight): as :func:`iter_hf_weights`; with ``quantized="keep"`` the kept
    weights come as their compressed-tensors tensors (int8/int32/int64, f32 scales), flagged False so
    the caller does not cast them to the serving dtype."""
    view, plan, mla, _ = hf_plan(file, skill)
    if view.replaced:
        log.info("skill %r: %d tensor(s) replace the backbone's", skill, len(view.replaced))
    kept = plan_kept(view, plan, mla) if quantized == "keep" else {}  # type: ignore[arg-type]
    if quantized == "keep":
        log.info("%s: %d of %d weights served quantized (quantized=keep)", file.path, len(kept), len(plan))
    for o in plan:
        if o.name in kept:
            for name, arr in kept_arrays(view, o.name, *kept[o.name]):  # type: ignore[arg-type]
                yield name, arr, False
        else:
            yield o.name, tensor_values(view, o, mla), True  # type: ignore[arg-type]
