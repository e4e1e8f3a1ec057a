"""Grafting skills into a model and taking them out again (spec §9, REFERENCE_NOTES §1.12).

``add_skill`` compares a donor checkpoint of the same architecture with the base tensor by
tensor, stores the chosen tensors that differ as ``skill.{id}.{name}`` entries at full shape,
fits the routing subspace on prompts, measures held-out quality, and either rewrites the file or
grows it in place (append-only: no existing byte moves). ``remove_skill`` and ``list_skills``
are the rest of the registry's life cycle.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..format.errors import CmfError
from ..format.atomic import check_writable
from ..format.growth import append
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from ..format.writer import CmfWriter

log = logging.getLogger(__name__)

SKILL_ID = re.compile(r"[A-Za-z0-9_-]+\Z")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
FAMILIES = {
    "ffn": re.compile(r"\.mlp\."),
    "attn": re.compile(r"\.(self_attn|linear_attn|short_conv|mixer)\."),
    "all": re.compile(r""),
}


class SkillError(CmfError):
    """A skill operation that cannot be done as asked (bad id, mismatched donor, ...)."""


def check_skill_id(skill_id: str) -> str:
    """The id if it is made of ``[A-Za-z0-9_-]`` (notes §1.12), else SkillError."""
    if not isinstance(skill_id, str) or not SKILL_ID.match(skill_id):
        raise SkillError(f"skill id {skill_id!r} must be non-empty and use only A-Z a-z 0-9 _ -")
    return skill_id


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to, or None (embeddings, final norm, head, MTP)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def parse_layers(spec: str, num_layers: int) -> set[int]:
    """``all`` | ``A-B`` | ``i,j,k`` (ranges and indices may be mixed) → layer indices."""
    spec = spec.strip()
    if spec == "all":
        return set(range(num_layers))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise SkillError(f"--layers: {part!r} is not a layer index or range (use all, A-B or i,j,k)") from None
    bad = sorted(i for i in out if not 0 <= i < num_layers)
    if bad or not out:
        raise SkillError(f"--layers {spec!r}: the model has layers 0-{num_layers - 1}")
    return out


def skill_tensor_names(f: CmfFile, skill_id: str) -> list[str]:
    """Stored names of the replacement tensors of ``skill_id``."""
    prefix = f"skill.{skill_id}."
    return [n for n in f.keys() if n.startswith(prefix)]


# ------------------------------------------------------------------------------------ donor


def _open_donor(donor: str | os.PathLike, stack: ExitStack, scratch: Path) -> CmfFile:
    """The donor as an open CMF file: a .cmf as is, a HF folder or hub id converted to f32 once
    (into ``scratch``, removed afterwards) so that names and layouts match the base's."""
    p = Path(donor)
    if p.is_file():
        return stack.enter_context(cmf_open(p))
    from ..convert import convert

    out = scratch / "donor.f32.cmf"
    log.info("converting donor %s to f32 for comparison", donor)
    convert(str(donor), out, quant="f32")
    return stack.enter_context(cmf_open(out))


def _target_dtype(name: str, shape: tuple[int, ...], base_dtype: Any, skill_quant: str | None) -> tuple[str, dict]:
    """The dtype a replacement is stored in: the base tensor's, or ``--skill-quant`` with the
    converter's fallbacks (1-D → f16, in % 32 → q8_2f, ...)."""
    if skill_quant is None:
        return base_dtype.label, {}
    from ..convert.policy import Policy

    choice = Policy.make(skill_quant).choose(name, shape)
    return choice.dtype, dict(choice.options)


def _encode(arr: np.ndarray, dtype: str, options: dict) -> bytes:
    from .. import quant

    if dtype == "f32":
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    return quant.encode(arr, dtype, **options)


def _decode(payload: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    from .. import quant

    return quant.decode(payload, dtype, shape)


class _Spool:
    """Encoded payloads parked in a scratch file until they are written (bounded memory)."""

    def __init__(self, folder: Path) -> None:
        self.fh = tempfile.TemporaryFile(dir=folder)
        self.items: list[tuple[str, str, tuple[int, ...], int, int]] = []

    def add(self, name: str, dtype: str, shape: tuple[int, ...], payload: bytes) -> None:
        off = self.fh.seek(0, os.SEEK_END)
        self.fh.write(payload)
        self.items.append((name, dtype, shape, off, len(payload)))

    def __iter__(self) -> Iterator[tuple[str, str, tuple[int, ...], bytes]]:
        for name, dtype, shape, off, n in self.items:
            self.fh.seek(off)
            yield name, dtype, shape, self.fh.read(n)

    @property
    def nbytes(self) -> int:
        return sum(i[4] for i in self.items)


def _graft(base: CmfFile, donor: CmfFile, skill_id: str, layers: set[int], family: str,
           min_delta: float, skill_quant: str | None, spool: _Spool,
           progress: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """Encode every chosen donor tensor that differs from the base into ``spool``; returns one
    report row per tensor considered."""
    pat = FAMILIES[family]
    rows = []
    for t in base.tensors():
        li = layer_of(t.name)
        if t.name.startswith("skill.") or li is None or li not in layers or not pat.search(t.name):
            continue
        if t.name not in donor:
            log.warning("donor has no tensor %s; the base's is kept", t.name)
            continue
        d = donor.tensor(t.name)
        if d.shape != t.shape:
            raise SkillError(f"tensor {t.name}: donor shape {list(d.shape)} != base shape {list(t.shape)} "
                             f"(a skill replaces tensors at full shape: same architecture needed)")
        if progress:
            progress(t.name)
        arr = donor.array(t.name)
        if not np.isfinite(arr).all():  # a broken fine-tune; no codec below f32 could store it either
            raise SkillError(f"donor tensor {t.name} holds NaN or infinity; no skill is written from it")
        # "Differs" is judged in the base's own encoding: a donor tensor that the base's dtype
        # stores as the same bytes is the same tensor, whatever the skill's dtype will be.
        as_base = _encode(arr, t.dtype.label, {})
        if as_base == bytes(t.data):
            continue
        b = base.array(t.name).astype(np.float64)
        nb = float(np.linalg.norm(b))
        diff = float(np.linalg.norm(_decode(as_base, t.dtype.label, t.shape).astype(np.float64) - b))
        delta = diff / nb if nb > 0 else float("inf")
        if delta <= min_delta:
            continue
        dtype, opts = _target_dtype(t.name, t.shape, t.dtype, skill_quant)
        payload = as_base if dtype == t.dtype.label and not opts else _encode(arr, dtype, opts)
        spool.add(f"skill.{skill_id}.{t.name}", dtype, t.shape, payload)
        rows.append({"tensor": t.name, "layer": li, "dtype": dtype, "bytes": len(payload), "delta": round(delta, 6)})
    return rows


# ------------------------------------------------------------------------------------ routing and quality


def _fit(base_path: Path, prompts: list[str], phi_layer: int | None, rank: int, metric: str,
         skill_id: str) -> dict[str, Any]:
    from ..runtime.model import load
    from ..runtime.routing import default_phi_layer, fit_selection

    with load(base_path, task="none") as model:  # φ of the plain backbone, as skill.rs fit_selection
        n = len(model.plan.layers)
        layer = default_phi_layer(n) if phi_layer is None else int(phi_layer)
        if not 0 <= layer < n:
            raise SkillError(f"--phi-layer {layer}: the model has layers 0-{n - 1}")
        tok = model.tokenizer
        phis = []
        for p in prompts:
            ids = tok.encode(p, add_special_tokens=False)[:model.ctx_size]
            if ids:
                phis.append(model.residual(ids, layer).astype(np.float64).mean(axis=0))
        if not phis:
            raise SkillError("--prompts: no non-empty prompt to fit the routing subspace on")
        return fit_selection(np.array(phis), phi_layer=layer, rank=rank, metric=metric, skill=skill_id)


def measure_quality(path: Path, skill_id: str, text_file: str | os.PathLike, tokens: int = 1024,
                    window: int = 512) -> dict[str, Any]:
    """Held-out perplexity of the backbone and of the skill overlaid, on the same windows of
    ``text_file`` (the claim-16 contract: measured, never declared)."""
    from ..runtime.model import load
    from .perplexity import encode_text, perplexity

    raw = Path(text_file).read_bytes()
    # As `cortiq skill add --quality` measures (skill.rs run_skill_add): the backbone unmasked, the
    # skill with its own input_mask_task when it has one (that is how it runs), else unmasked.
    with load(path, task="none") as model:
        ids = encode_text(model.tokenizer, raw.decode("utf-8"))
        w = max(2, min(window, model.ctx_size, len(ids)))
        chunks = max(1, min(tokens, len(ids)) // w)
        bb = perplexity(model, ids, w, chunks)
        rec = next((s for s in model.file.skills if s.id == skill_id), None)
        linked = rec.input_mask_task if rec is not None and rec.input_mask_task in model.tasks else None
        model.select(skill=skill_id, task=linked or "none")
        ov = perplexity(model, ids, w, chunks)
        masked = model.task is not None
    return {"metric": "ppl", "backbone": round(bb["ppl"], 3), "overlaid": round(ov["ppl"], 3),
            "file": Path(text_file).name, "tokens": bb["tokens"], "masked": masked,
            "dataset_sha256": hashlib.sha256(raw).hexdigest()}


# ------------------------------------------------------------------------------------ add / remove / list


def _copy_into(w: CmfWriter, f: CmfFile, skip: Callable[[str], bool] = lambda n: False) -> None:
    """Copy every tensor (bytes and hashes as stored) and the masks/index/vocab of ``f``."""
    for t in f.tensors():
        if not skip(t.name):
            w.add(t.name, t.dtype, t.shape, t.numpy(), hash=t.hash)
    if f.envelope.section("masks").present:
        idx = bytes(f.section_bytes("index")) if f.envelope.section("index").present else None
        w.set_masks(bytes(f.section_bytes("masks")), sparse_index=idx)
    if f.tokenizer_json is not None:
        w.set_vocab(f.tokenizer_json)


def add_skill(base: str | os.PathLike, donor: str | os.PathLike, skill_id: str, *, name: str | None = None,
              layers: str = "all", tensors: str = "ffn", min_delta: float = 0.0, skill_quant: str | None = None,
              prompts: str | os.PathLike | list[str] | None = None, phi_layer: int | None = None,
              rank: int = 2, metric: str = "mse", quality: str | os.PathLike | None = None,
              quality_tokens: int = 1024, output: str | os.PathLike | None = None, in_place: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Graft ``donor``'s differing tensors into ``base`` as skill ``skill_id``; returns a report.

    Exactly one of ``output`` (a new file; the base is untouched) or ``in_place`` (append-only
    growth of ``base``: existing bytes never move, a crash leaves the old file) is required.
    ``prompts`` (a file with one prompt per line, or a list) fits the routing subspace;
    ``quality`` (a text file) measures backbone vs overlaid perplexity on ``quality_tokens``
    tokens and stores it in the record (patched in by one more append: a few KB of dead bytes
    that ``cmf compact`` reclaims).
    """
    check_skill_id(skill_id)
    if tensors not in FAMILIES:
        raise SkillError(f"--tensors must be one of {', '.join(FAMILIES)}, not {tensors!r}")
    if (output is None) == (not in_place):
        raise SkillError("give either an output path (-o) or --in-place")
    base_path = Path(base)
    out_path = base_path if in_place else Path(output)  # type: ignore[arg-type]
    if not in_place and out_path.exists() and out_path.resolve() == base_path.resolve():
        raise SkillError(f"{out_path}: -o would overwrite the base; use --in-place to grow it")
    if base_path.exists() and out_path.parent.is_dir():  # missing ones: the errors below say so
        check_writable(out_path, in_place=in_place)  # a read-only target fails before the graft
    if isinstance(prompts, (str, os.PathLike)):
        prompts = [ln.strip() for ln in Path(prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
    with ExitStack() as stack:
        f = stack.enter_context(cmf_open(base_path))
        if f.is_skill_file:
            raise SkillError(f"{base_path} is a standalone skill file; apply it to its base first")
        if skill_id in [s.id for s in f.skills] or skill_tensor_names(f, skill_id):
            raise SkillError(f"{base_path} already has a skill {skill_id!r} (remove it first)")
        if in_place and len(f.paths) > 1:
            raise SkillError(f"{base_path}: --in-place needs a single file; run `cmf compact` first")
        num_layers = f.arch.num_layers
        chosen = parse_layers(layers, num_layers)
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".cmf-skill-")))
        d = _open_donor(donor, stack, scratch)
        spool = _Spool(scratch)
        stack.callback(spool.fh.close)
        rows = _graft(f, d, skill_id, chosen, tensors, float(min_delta), skill_quant, spool, progress)
        if not rows:
            raise SkillError(f"the donor does not differ from the base in the chosen tensors "
                             f"(--layers {layers} --tensors {tensors}); no skill written")
        record: dict[str, Any] = {"id": skill_id}
        if name:
            record["name"] = name
        record["layers"] = sorted({r["layer"] for r in rows})
        if prompts:
            record["selection"] = _fit(base_path, list(prompts), phi_layer, rank, metric, skill_id)
        record["provenance"] = {"donor": Path(str(donor)).name, "tensors": len(rows), "family": tensors,
                                "min_delta": float(min_delta), "skill_quant": skill_quant}
        skills = [dict(s.raw) for s in f.skills] + [record]
        header = f.header.to_dict()
        if in_place:
            f.close()
            append(base_path, iter(spool), {"skills": skills})
        else:
            header["skills"] = skills
            with CmfWriter(out_path, header) as w:
                _copy_into(w, f)
                for item in spool:
                    w.add(*item)
    if quality is not None:
        record["quality"] = measure_quality(out_path, skill_id, quality, quality_tokens)
        append(out_path, (), {"skills": skills[:-1] + [record]})
    return {"output": str(out_path), "id": skill_id, "in_place": in_place, "tensors": rows,
            "bytes": sum(r["bytes"] for r in rows), "record": record}


def remove_skill(model: str | os.PathLike, skill_id: str, output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Rewrite ``model`` (or write ``output``) without skill ``skill_id``'s tensors and record."""
    src = Path(model)
    dst = Path(output) if output is not None else src
    with cmf_open(src) as f:
        names = set(skill_tensor_names(f, skill_id))
        if skill_id not in [s.id for s in f.skills] and not names:
            raise SkillError(f"{src}: no skill {skill_id!r} (skills: {', '.join(s.id for s in f.skills) or 'none'})")
        if len(f.paths) > 1 and output is None:
            raise SkillError(f"{src} is a shard set: give -o for the rewritten single file")
        header = f.header.to_dict()
        header.pop("shard", None)
        header["skills"] = [dict(s.raw) for s in f.skills if s.id != skill_id]
        freed = sum(f.tensor(n).nbytes for n in names)
        # The writer builds a temporary file and renames it over dst: the mapping we read from
        # stays valid until it is closed, even when dst is the input itself.
        with CmfWriter(dst, header) as w:
            _copy_into(w, f, skip=names.__contains__)
    return {"output": str(dst), "id": skill_id, "tensors": len(names), "bytes": freed}


def list_skills(model: str | os.PathLike) -> list[dict[str, Any]]:
    """Per skill: id, name, replacement tensors and bytes, layers, routable, quality."""
    with cmf_open(model) as f:
        out = []
        for s in f.skills:
            names = skill_tensor_names(f, s.id)
            layers = list(s.layers) or sorted({li for n in names if (li := layer_of(n[len(f"skill.{s.id}."):]))
                                               is not None})
            out.append({"id": s.id, "name": s.name, "tensors": len(names),
                        "bytes": sum(f.tensor(n).nbytes for n in names), "layers": layers,
                        "routable": s.selection is not None, "quality": s.quality,
                        "standalone": s.base_dir_hash is not None})
        return out


__all__ = ["SkillError", "add_skill", "check_skill_id", "layer_of", "list_skills", "measure_quality",
           "parse_layers", "remove_skill", "skill_tensor_names"]
