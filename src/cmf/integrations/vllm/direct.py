"""Serve a ``.cmf`` path directly: ``LLM(model="m.cmf", load_format="cmf")``, ``--model m.cmf``.

vLLM reads ``model``'s config.json (``maybe_override_with_speculators``, then ``ModelConfig``)
inside ``EngineArgs.create_engine_config``, before any loader runs, so a bare CMF file must be
swapped for its materialised folder before that call. The plugin's ``register()`` runs earlier
(``EngineArgs.__post_init__`` and ``AsyncEngineArgs.add_cli_args`` load the general plugins), so
it wraps ``create_engine_config`` once: with ``load_format == "cmf"`` and a CMF file as ``model``,
the wrapper puts :func:`prepare`'s folder in ``model`` (and ``tokenizer`` when it was unset or the
file) and names the served model after the path as given, as vLLM does for a folder.

:func:`resolve_model` is the decision, without vLLM; :func:`install` is the vLLM side.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from ...format.constants import MAGIC
from .errors import CmfFileNotFound, NotACmfFile
from .materialize import prepare

log = logging.getLogger(__name__)

LOAD_FORMAT = "cmf"
_MARK = "__cmf_direct__"  # set on the wrapper so a second register() does not wrap twice


def is_cmf_file(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a regular file that starts with the CMF magic (any shard of a set does)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def resolve_model(model: str, tokenizer: str | None, served_model_name: str | list[str] | None,
                  extra: Mapping[str, Any] | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> tuple[str, str | None, str | list[str] | None] | None:
    """(model, tokenizer, served_model_name) to hand vLLM for ``load_format="cmf"``, or None to keep them.

    A folder (the ``prepare()`` route) or anything vLLM resolves itself is left alone (None). A
    CMF file becomes its materialised folder; ``tokenizer`` follows when it was unset or named the
    file; ``served_model_name`` defaults to ``model`` as given (what vLLM's OpenAI server also
    lists when the name is unset). ``extra`` is ``model_loader_extra_config``: options that change
    the folder's config (``quantized``) select the folder. A path that does not exist, or a file
    that is not CMF, raises (CmfFileNotFound, NotACmfFile): the cmf load format reads nothing else.
    """
    from .weights import LoaderOptions

    p = Path(os.path.expanduser(str(model)))
    if p.is_dir():
        return None
    if not p.exists():
        raise CmfFileNotFound(f"{model}: no such file; load_format='cmf' serves a local .cmf file (any shard of a "
                              "set) or a folder made by cmf.integrations.vllm.prepare()")
    if not is_cmf_file(p):
        raise NotACmfFile(f"{model}: not a CMF file (it does not start with {MAGIC!r}); load_format='cmf' serves "
                          "a .cmf file or a folder made by cmf.integrations.vllm.prepare()")
    opts = LoaderOptions.from_extra(extra)
    folder = str(prepare(p, cache_dir=cache_dir, quantized=opts.quantized, skill=opts.skill))
    if tokenizer is None or _same_path(tokenizer, p):
        tokenizer = folder
    if served_model_name is None:
        served_model_name = str(model)
    log.info("cmf: serving %s from the folder %s", model, folder)
    return folder, tokenizer, served_model_name


def _same_path(a: str, b: Path) -> bool:
    try:
        return Path(os.path.expanduser(a)).resolve() == b.resolve()
    except OSError:
        return False


def _api_ok(engine_args_cls: type) -> bool:
    """Whether EngineArgs looks as this wrapper expects (vLLM 0.32's names)."""
    import dataclasses

    if not dataclasses.is_dataclass(engine_args_cls) or not callable(getattr(engine_args_cls, "create_engine_config", None)):
        return False
    names = {f.name for f in dataclasses.fields(engine_args_cls)}
    return {"model", "tokenizer", "load_format", "served_model_name", "model_loader_extra_config"} <= names


def _wrap(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        fmt = getattr(self.load_format, "value", self.load_format)  # a str, or an enum in some versions
        if str(fmt) == LOAD_FORMAT and isinstance(self.model, (str, os.PathLike)):
            got = resolve_model(str(self.model), self.tokenizer, self.served_model_name,
                                self.model_loader_extra_config)
            if got is not None:
                self.model, self.tokenizer, self.served_model_name = got
        return create(self, *args, **kwargs)

    setattr(create_engine_config, _MARK, True)
    return create_engine_config


def install() -> bool:
    """Wrap ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` once; False (logged) if the API differs."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as exc:  # a vLLM without this module: the folder route still works
        log.warning("cmf: vLLM's EngineArgs not found (%s); pass the folder from prepare() as model", exc)
        return False
    current = EngineArgs.__dict__.get("create_engine_config")
    if getattr(current, _MARK, False):
        return True
    if current is None or not _api_ok(EngineArgs):
        log.warning("cmf: this vLLM's EngineArgs is not the one the plugin knows (vLLM 0.32); serving a .cmf "
                    "path directly is off, pass the folder from cmf.integrations.vllm.prepare() as model")
        return False
    EngineArgs.create_engine_config = _wrap(current)  # type: ignore[method-assign]
    return True
