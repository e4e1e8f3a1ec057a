"""``imagine-pack``: a diffusers pipeline folder -> one pipeline container (spec §12).

:func:`plan` reads metadata only — ``model_index.json``, every component's config, the
safetensors headers, the tokenizer and scheduler files — and decides each tensor's file name and
dtype (:mod:`.policy`). When diffusers is importable it also builds every component from its
config with no weights (:mod:`.modules`) and refuses a config that does not describe the
weights, before a byte is written. :func:`execute` then streams one tensor at a time (read ->
encode -> :class:`~cmf.format.writer.CmfWriter`, which writes it at its final offset), so RAM
stays bounded by the largest tensor, and renames the finished file into place.

Layout: per component (recipe order) the ``{prefix}.config_json`` u8 tensor (the folder's
config.json, verbatim), then its tensors in natural name order; then ``scheduler.config_json``;
the tokenizer.json in the vocab section; the header's ``arch`` describes the text encoder
(``arch_name`` = the recipe's) and ``provenance`` names the recipe. Same folder and options ->
same bytes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..convert.config import load_config
from ..convert.errors import ConvertError
from ..convert.source import Checkpoint
from ..convert.tokenizer import read_tokenizer
from ..format.header import parse_header, serialize_header
from ..format.writer import CmfWriter
from .errors import ImageError, MissingComponent, MissingDependency, UnsupportedPipeline
from .policy import ImagePolicy, Pick
from .recipes import CONFIG_SUFFIX, KNOWN_UNSUPPORTED, Component, Recipe, by_pipeline_class, supported_text

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[Any, ...]:
    """``layers.2`` before ``layers.10``: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(name))


@dataclass
class PackItem:
    """One output tensor: a component config blob (``blob``) or a source tensor (``source``)."""

    name: str
    prefix: str
    source: str | None
    shape: tuple[int, ...]
    source_dtype: str
    pick: Pick
    source_bytes: int
    blob: bytes | None = None
    out_bytes: int = 0


@dataclass
class PackPlan:
    """Everything a pack will do, before it does it (``--dry-run`` prints :meth:`summary`)."""

    folder: Path
    recipe: Recipe
    policy: ImagePolicy
    header: dict[str, Any]
    items: list[PackItem]
    vocab: bytes
    checkpoints: dict[str, Checkpoint]
    dropped: list[str]
    validated: bool

    @property
    def source_bytes(self) -> int:
        return sum(i.source_bytes for i in self.items)

    @property
    def out_bytes(self) -> int:
        return sum(i.out_bytes for i in self.items)

    def close(self) -> None:
        for c in self.checkpoints.values():
            c.close()

    def summary(self) -> dict[str, Any]:
        """JSON-ready: recipe, policy table, per-component and per-tensor dtypes and sizes."""
        comps: dict[str, dict[str, Any]] = {}
        for i in self.items:
            c = comps.setdefault(i.prefix, {"tensors": 0, "params": 0, "bytes": 0, "dtypes": {}})
            n = 0 if i.blob is not None else int(np.prod(i.shape, dtype=np.int64))
            c["tensors"] += 1
            c["params"] += n
            c["bytes"] += i.out_bytes
            d = c["dtypes"].setdefault(i.pick.dtype, {"tensors": 0, "params": 0})
            d["tensors"] += 1
            d["params"] += n
        return {"folder": str(self.folder), "arch_name": self.recipe.arch_name, "pipeline": self.recipe.pipeline,
                "quant": self.policy.quant, "policy": self.policy.table(), "validated": self.validated,
                "components": comps, "dropped": self.dropped, "source_bytes": self.source_bytes,
                "bytes": self.out_bytes, "vocab_bytes": len(self.vocab),
                "tensors": [{"name": i.name, "shape": list(i.shape), "source_dtype": i.source_dtype,
                             "dtype": i.pick.dtype, "role": i.pick.role, "reason": i.pick.reason,
                             "bytes": i.out_bytes} for i in self.items]}


@dataclass
class PackResult:
    """What a pack wrote."""

    path: Path
    tensors: int
    source_bytes: int
    bytes: int
    seconds: float
    plan: PackPlan = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "tensors": self.tensors, "source_bytes": self.source_bytes,
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


# ----------------------------------------------------------------------------------- reading


def _read_json(path: Path, what: str) -> tuple[bytes, dict[str, Any]]:
    """(raw bytes, parsed object) of a JSON file; MissingComponent when absent."""
    if not path.is_file():
        raise MissingComponent(f"{path}: missing ({what})")
    raw = path.read_bytes()
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ImageError(f"{path}: not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ImageError(f"{path}: not a JSON object")
    return raw, obj


def _recipe(folder: Path) -> tuple[Recipe, dict[str, Any]]:
    if not folder.is_dir():
        raise MissingComponent(f"{folder}: no such pipeline folder")
    _, index = _read_json(folder / "model_index.json", "the diffusers pipeline index; is this a pipeline folder?")
    cls = index.get("_class_name")
    recipe = by_pipeline_class(str(cls))
    if recipe is None:
        known = KNOWN_UNSUPPORTED.get(str(cls))
        why = f" ({known}, which spec §12's layout does not carry)" if known else ""
        raise UnsupportedPipeline(f"{folder}: {cls!r} is not a supported pipeline{why}; supported: {supported_text()}")
    return recipe, index


def _index_class(index: dict[str, Any], folder: str, accepted: tuple[str, ...], root: Path) -> str:
    entry = index.get(folder)
    if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
        raise MissingComponent(f"{root}: model_index.json has no {folder!r} component")
    if entry[1] not in accepted:
        raise UnsupportedPipeline(f"{root}/{folder}: class {entry[1]!r} is not one of {', '.join(accepted)}")
    return str(entry[1])


def _component(recipe: Recipe, comp: Component, root: Path, index: dict[str, Any], policy: ImagePolicy
               ) -> tuple[list[PackItem], list[str], dict[str, Any], Checkpoint, str]:
    cls = _index_class(index, comp.folder, comp.classes, root)
    folder = root / comp.folder
    if not folder.is_dir():
        raise MissingComponent(f"{folder}: missing (the {comp.what}, {comp.prefix}.*)")
    raw, config = _read_json(folder / "config.json", f"the {comp.what} config")
    try:
        ckpt = Checkpoint(folder)
    except ConvertError as exc:
        raise MissingComponent(f"the {comp.what} ({comp.folder}) has no readable weights: {exc}") from None
    try:
        items = [PackItem(comp.config_name, comp.prefix, None, (len(raw),), "u8", Pick("u8", "config", "config"),
                          0, raw, len(raw))]
        dropped: list[str] = []
        tensors: list[PackItem] = []
        for src in ckpt:
            name = comp.out_name(src)
            if name is None:
                dropped.append(f"{comp.folder}/{src}")
                continue
            t = ckpt.check_float(src)
            inner = name[len(comp.prefix) + 1:]
            if inner == CONFIG_SUFFIX:
                raise ImageError(f"{folder}: a weight named {src!r} would collide with {comp.config_name}")
            pick = policy.choose(recipe, comp.prefix, inner, t.shape)
            tensors.append(PackItem(name, comp.prefix, src, t.shape, t.dtype, pick, t.nbytes,
                                    out_bytes=_estimate(pick.dtype, t.shape)))
        if not tensors:
            raise MissingComponent(f"{folder}: no weights of the {comp.what} to pack")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ImageError(f"{folder}: two source tensors map to {', '.join(dup[:3])}")
        tensors.sort(key=lambda i: natural_key(i.name))
        return items + tensors, sorted(dropped), config, ckpt, cls
    except BaseException:
        ckpt.close()
        raise


def _estimate(label: str, shape: tuple[int, ...]) -> int:
    from .. import quant

    n = quant.get_codec(label).expected_nbytes(shape)
    return int(n) if n is not None else 0


def _validate(comp: Component, config: dict[str, Any], items: list[PackItem]) -> bool:
    """Config vs weights through diffusers (meta modules, no memory); False when not installed."""
    try:
        from . import modules

        modules.require()
    except MissingDependency:
        return False
    module = modules.build_empty(comp, config)
    got = {i.name: i.shape for i in items if i.blob is None}
    modules.check_shapes(comp, modules.expected_shapes(comp, module), got, f"{comp.folder}")
    return True


def _side_files(recipe: Recipe, root: Path, index: dict[str, Any], te_config: dict[str, Any]
                ) -> tuple[PackItem, bytes, Any, dict[str, str]]:
    """The scheduler config item, the tokenizer.json bytes, the tokenizer files and their classes."""
    sched_cls = _index_class(index, "scheduler", recipe.scheduler_classes, root)
    raw, sched = _read_json(root / "scheduler" / "scheduler_config.json", "the scheduler config")
    if sched.get("_class_name", sched_cls) not in recipe.scheduler_classes:
        raise UnsupportedPipeline(f"{root}/scheduler: class {sched.get('_class_name')!r} is not one of "
                                  f"{', '.join(recipe.scheduler_classes)}")
    name = f"{recipe.scheduler_prefix}.{CONFIG_SUFFIX}"
    item = PackItem(name, recipe.scheduler_prefix, None, (len(raw),), "u8", Pick("u8", "config", "config"), 0,
                    raw, len(raw))
    tok_cls = _index_class(index, "tokenizer", recipe.tokenizer_classes, root)
    tok_dir = root / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        raise MissingComponent(f"{tok_dir}/tokenizer.json: missing (the text encoder's tokenizer; a "
                               f"sentencepiece-only tokenizer must be saved with tokenizers first)")
    tok = read_tokenizer(tok_dir, te_config, te_config)
    assert tok.tokenizer_json is not None
    return item, tok.tokenizer_json, tok, {"scheduler": sched_cls, "tokenizer": tok_cls}


def _header(recipe: Recipe, root: Path, te_config: dict[str, Any], policy: ImagePolicy, tok: Any,
            classes: dict[str, str], index: dict[str, Any], items: list[PackItem]) -> dict[str, Any]:
    try:
        arch = dict(load_config(te_config).arch)
    except ConvertError as exc:
        raise ImageError(f"{root}/text_encoder/config.json: cannot describe the text encoder in the "
                         f"header's arch block: {exc}") from None
    arch["arch_name"] = recipe.arch_name  # §12: the tag says "pipeline"; the numbers are the encoder's
    sp = root / "tokenizer" / "special_tokens_map.json"
    prov: dict[str, Any] = {
        "tool": f"pycmf {__version__}", "pipeline": recipe.pipeline,
        "components": {c.prefix: c.what for c in recipe.components},
        "diffusers": {"pipeline_class": recipe.pipeline_class, "classes": classes,
                      "version": index.get("_diffusers_version")},
        "packed_from": str(root), "quant": policy.quant, "policy": policy.table(),
        "source_dtypes": sorted({i.source_dtype for i in items if i.blob is None}),
    }
    if tok.tokenizer_config is not None:
        prov["hf_tokenizer_config"] = tok.tokenizer_config
    if sp.is_file():
        prov["hf_special_tokens_map"] = _read_json(sp, "special tokens")[1]
    header: dict[str, Any] = {"format": "cmf", "version": 2, "quant_type": policy.quant_type, "arch": arch}
    if tok.bundle is not None:
        header["tokenizer_config"] = tok.bundle
    header["provenance"] = prov
    try:
        parse_header(serialize_header(header))
    except Exception as exc:  # noqa: BLE001 - ParseError or a non-JSON value from a config
        raise ImageError(f"cannot build a valid CMF header: {exc}") from None
    return header


def plan(folder: str | os.PathLike[str], quant: str = "q8", overrides: dict[str, str] | None = None) -> PackPlan:
    """Plan packing the pipeline folder ``folder``: names, dtypes, header, sizes (metadata only).

    Raises :class:`MissingComponent`, :class:`UnsupportedPipeline`, :class:`ComponentMismatch` or
    :class:`ImageError`. The plan keeps the checkpoints open: :func:`execute` it or ``close()`` it.
    """
    root = Path(os.path.expanduser(str(folder)))
    policy = ImagePolicy.make(quant, overrides)
    recipe, index = _recipe(root)
    ckpts: dict[str, Checkpoint] = {}
    try:
        items: list[PackItem] = []
        dropped: list[str] = []
        configs: dict[str, dict[str, Any]] = {}
        classes: dict[str, str] = {}
        validated = True
        for comp in recipe.components:
            its, drop, config, ckpt, cls = _component(recipe, comp, root, index, policy)
            ckpts[comp.prefix] = ckpt
            validated = _validate(comp, config, its) and validated
            items += its
            dropped += drop
            configs[comp.prefix] = config
            classes[comp.prefix] = cls
        if not validated:
            log.warning("diffusers is not installed: component configs are checked against their weights "
                        "only when the file is loaded (pip install 'pycmf[image]')")
        sched_item, vocab, tok, side = _side_files(recipe, root, index, configs[recipe.text_encoder])
        items.append(sched_item)
        classes.update(side)
        header = _header(recipe, root, configs[recipe.text_encoder], policy, tok, classes, index, items)
        return PackPlan(root, recipe, policy, header, items, vocab, ckpts, dropped, validated)
    except BaseException:
        for c in ckpts.values():
            c.close()
        raise


def _encode(plan: PackPlan, it: PackItem) -> tuple[Any, str]:
    arr = plan.checkpoints[it.prefix].read(it.source)  # type: ignore[arg-type]
    label = it.pick.dtype
    if label == "f32":
        return np.ascontiguousarray(arr, dtype="<f4"), label
    if label not in ("f16", "bf16") and not np.isfinite(arr).all():
        raise ImageError(f"{it.prefix} tensor {it.source!r} holds NaN or infinity; cannot quantize it")
    from .. import quant

    return quant.encode(arr, label), label


def execute(plan: PackPlan, out: str | os.PathLike[str], progress: Callable[[int], None] | None = None) -> PackResult:
    """Write the planned file to ``out``; ``progress(n)`` gets source bytes as they are done."""
    t0 = time.perf_counter()
    path = Path(out)
    try:
        if path.is_dir():
            raise ImageError(f"{path}: is a folder; give the output file name (e.g. {path / 'model.cmf'})")
        if not path.parent.is_dir():
            raise ImageError(f"{path.parent}: output folder does not exist")
        with CmfWriter(path, plan.header, expected_names=[i.name for i in plan.items]) as w:
            for it in plan.items:
                if it.blob is not None:
                    w.add(it.name, "u8", it.shape, it.blob)
                    continue
                payload, label = _encode(plan, it)
                entry = w.add(it.name, label, it.shape, payload)
                it.out_bytes = entry.nbytes
                del payload
                if progress is not None:
                    progress(it.source_bytes)
            w.set_vocab(plan.vocab)
    finally:
        plan.close()
    secs = time.perf_counter() - t0
    size = path.stat().st_size
    log.info("wrote %s: %d tensors, %d bytes in %.2f s", path, len(plan.items), size, secs)
    return PackResult(path, len(plan.items), plan.source_bytes, size, secs, plan)


def pack(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, quant: str = "q8", *,
         overrides: dict[str, str] | None = None, dry_run: bool = False,
         progress: Callable[[int], None] | None = None) -> PackResult | PackPlan:
    """Pack a diffusers pipeline folder into one ``.cmf`` (see the module docstring).

    ``quant``: the te/dit matrices' quant (f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp);
    ``overrides``: {role: quant} (:mod:`cmf.image.policy`). With ``dry_run`` the plan is returned
    and nothing is written.
    """
    if not dry_run and out is None:
        raise ImageError("an output path is needed (or dry_run=True)")
    p = plan(folder, quant, overrides)
    if dry_run:
        p.close()
        return p
    assert out is not None
    return execute(p, out, progress)
