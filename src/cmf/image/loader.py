"""A pipeline container -> a ready diffusers pipeline, from the file alone.

Each component is built from its ``{prefix}.config_json`` with empty (meta) parameters
(:mod:`.modules`), its tensors are decoded from the file one at a time to torch tensors of the
requested dtype, checked against what the config needs (names and shapes) and assigned — no
other copy of the model is written anywhere. The tokenizer comes from the vocab section (its
settings from ``provenance.hf_tokenizer_config``), the scheduler from ``scheduler.config_json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .errors import ImageError, MissingComponent, UnsupportedPipeline
from .modules import build_empty, check_shapes, expected_shapes, fill, require
from .recipes import CONFIG_SUFFIX, Component, Recipe, by_arch, supported_text

log = logging.getLogger(__name__)

DTYPES = ("f32", "bf16", "f16")
# Tokenizer settings that describe where a tokenizer was loaded from, not how it behaves.
_TOKENIZER_SKIP = frozenset({"tokenizer_class", "backend", "is_local", "local_files_only", "name_or_path",
                             "auto_map", "added_tokens_decoder", "chat_template", "tokenizer_file"})


@dataclass
class Loaded:
    """A loaded pipeline and where it came from (``header_hash``/``dir_hash`` pin the file)."""

    pipeline: Any
    path: Path
    arch_name: str
    header_hash: str
    dir_hash: str
    dtype: str
    seconds: float

    def identity(self) -> dict[str, str]:
        """What a generated image records about its model."""
        return {"cmf_file": self.path.name, "cmf_arch": self.arch_name, "cmf_header_hash": self.header_hash,
                "cmf_dir_hash": self.dir_hash}


def recipe_of(f: CmfFile) -> Recipe:
    """The recipe of an open file; :class:`UnsupportedPipeline` for anything else."""
    name = f.arch.arch_name
    recipe = by_arch(name)
    if recipe is None:
        raise UnsupportedPipeline(f"{f.path}: arch {name!r} is not a pipeline this version runs "
                                  f"(supported: {supported_text()})")
    return recipe


def config_of(f: CmfFile, name: str) -> dict[str, Any]:
    """The JSON object of u8 tensor ``name``; MissingComponent / ImageError when absent or broken."""
    if name not in f:
        raise MissingComponent(f"{f.path}: no {name} tensor (the component's config)")
    try:
        obj = json.loads(bytes(f.tensor(name).data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ImageError(f"{f.path}: {name} is not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ImageError(f"{f.path}: {name} is not a JSON object")
    return obj


def _torch_dtype(torch: Any, dtype: str) -> Any:
    if dtype not in DTYPES:
        raise ImageError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]


def _component(f: CmfFile, comp: Component, dtype: Any) -> Any:
    import torch

    module = build_empty(comp, config_of(f, comp.config_name))
    lead = f"{comp.prefix}."
    names = [n for n in f.keys() if n.startswith(lead) and n != comp.config_name]
    if not names:
        raise MissingComponent(f"{f.path}: no {comp.prefix}.* tensors (the {comp.what})")
    got = {n: tuple(f.tensor(n).shape) for n in names}
    check_shapes(comp, expected_shapes(comp, module), got, str(f.path))
    floats = {n for n, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}
    state: dict[str, Any] = {}
    for n in names:
        inner = n[len(lead):]
        arr = f.array(n)  # decoded to f32, whatever the stored dtype
        t = torch.from_numpy(arr)
        state[inner] = t.to(dtype) if inner in floats and dtype != torch.float32 else t
        del arr
    fill(comp, module, state)
    return module


def _tokenizer(f: CmfFile, recipe: Recipe) -> Any:
    from tokenizers import Tokenizer
    import transformers

    raw = f.tokenizer_json
    if raw is None:
        raise MissingComponent(f"{f.path}: no vocab section (the text encoder's tokenizer)")
    prov = f.header.provenance if isinstance(f.header.provenance, dict) else {}
    cfg = prov.get("hf_tokenizer_config") if isinstance(prov.get("hf_tokenizer_config"), dict) else {}
    name = cfg.get("tokenizer_class") or recipe.default_tokenizer
    if name not in recipe.tokenizer_classes:
        raise UnsupportedPipeline(f"{f.path}: tokenizer class {name!r} is not one of "
                                  f"{', '.join(recipe.tokenizer_classes)}")
    kwargs = {k: v for k, v in cfg.items() if k not in _TOKENIZER_SKIP}
    specials = prov.get("hf_special_tokens_map")
    if isinstance(specials, dict):
        for k, v in specials.items():
            kwargs.setdefault(k, v)
    try:
        obj = Tokenizer.from_str(bytes(raw).decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types
        raise ImageError(f"{f.path}: the vocab section is not a tokenizer.json ({exc})") from None
    return getattr(transformers, name)(tokenizer_object=obj, **kwargs)


def _scheduler(f: CmfFile, recipe: Recipe) -> Any:
    import diffusers

    name = f"{recipe.scheduler_prefix}.{CONFIG_SUFFIX}"
    if name not in f:
        # A file from the reference packer carries no scheduler config: use the class defaults.
        log.warning("%s: no %s; using %s defaults", f.path, name, recipe.scheduler_classes[0])
        return getattr(diffusers, recipe.scheduler_classes[0])()
    cfg = config_of(f, name)
    cls = cfg.get("_class_name", recipe.scheduler_classes[0])
    if cls not in recipe.scheduler_classes:
        raise UnsupportedPipeline(f"{f.path}: scheduler class {cls!r} is not one of "
                                  f"{', '.join(recipe.scheduler_classes)}")
    return getattr(diffusers, cls).from_config(cfg)


def load_pipeline(path: str | os.PathLike[str], *, dtype: str = "f32", verify: bool = False,
                  device: str = "cpu") -> Loaded:
    """Open ``path`` and build its diffusers pipeline (see the module docstring).

    ``dtype``: the compute dtype of the weights (f32 reproduces diffusers' own f32 run; bf16 /
    f16 halve the memory). ``verify``: check every hash first (spec §1.2) and refuse a damaged file.
    ``device``: where the modules go once built (a torch device string; decoding is on the CPU).
    """
    torch, _, diffusers = require()
    t0 = time.perf_counter()
    tdtype = _torch_dtype(torch, dtype)
    with cmf_open(Path(path)) as f:
        recipe = recipe_of(f)
        if verify:
            problems = f.verify()
            if problems:
                raise ImageError(f"{f.path}: verify found {len(problems)} problem(s): {'; '.join(problems[:3])}")
        parts = {c.folder: _component(f, c, tdtype) for c in recipe.components}
        parts["tokenizer"] = _tokenizer(f, recipe)
        parts["scheduler"] = _scheduler(f, recipe)
        env = f.envelope
        pipe = getattr(diffusers, recipe.pipeline_class)(**parts)
        loaded = Loaded(pipe, f.path, recipe.arch_name, f"{env.header_hash:016x}", f"{env.dir_hash:016x}", dtype,
                        time.perf_counter() - t0)
    if device != "cpu":
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # callers draw their own (cmf imagine: tqdm on a TTY)
    log.info("%s: pipeline %s loaded in %.2f s", path, recipe.pipeline_class, loaded.seconds)
    return loaded


def load(path: str | os.PathLike[str], *, dtype: str = "f32", verify: bool = False, device: str = "cpu") -> Any:
    """The ready diffusers pipeline of a pipeline container (``cmf.image.load``)."""
    return load_pipeline(path, dtype=dtype, verify=verify, device=device).pipeline
