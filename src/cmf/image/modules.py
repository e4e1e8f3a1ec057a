"""Component modules built from their configs with no weights, and filled from a state dict.

Needs torch, transformers and diffusers (the ``image`` extra). :func:`build_empty` constructs a
component with every *parameter* on the meta device (no memory, no initialisation work) while
buffers and plain tensor attributes — rotary tables, ``inv_freq`` — are computed for real, as
they are not in any checkpoint. :func:`expected_shapes` lists what the component's weights must
be, in file names; :func:`check_shapes` compares that with what a folder or file holds and
raises :class:`ComponentMismatch` naming the differences; :func:`fill` assigns the tensors.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Iterator, Mapping

from .errors import ComponentMismatch, ImageError, MissingDependency
from .recipes import Component

log = logging.getLogger(__name__)

_SHOW = 4  # differences named in a ComponentMismatch message


def require() -> tuple[Any, Any, Any]:
    """(torch, transformers, diffusers), or :class:`MissingDependency` saying how to get them."""
    try:
        import diffusers
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependency(f"running an image pipeline needs torch, transformers and diffusers "
                                f"({exc.name or exc} is not installed): pip install 'pycmf[image]'") from None
    return torch, transformers, diffusers


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lands on the meta device.

    Buffers are left alone: modules compute them in ``__init__`` (RoPE tables) and checkpoints
    do not carry them, so they must be real.
    """
    import torch

    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: Any) -> None:
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


class Absent:
    """Factory of stand-ins for sub-modules a file does not carry (the VAE encoder)."""

    @staticmethod
    def make(what: str) -> Any:
        import torch

        class _Absent(torch.nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                raise ImageError(f"{what} is not in this file: a pipeline container carries only what "
                                 f"text-to-image needs")

        return _Absent()


def build_empty(comp: Component, config: Mapping[str, Any]) -> Any:
    """The component's module from ``config``, parameters on meta; unpacked parts stubbed out."""
    torch, transformers, diffusers = require()
    cfg = dict(config)
    with params_on_meta():
        if comp.library == "transformers":
            mt = cfg.get("model_type")
            if mt not in comp.model_types:
                raise ComponentMismatch(f"{comp.config_name}: model_type {mt!r} is not one of "
                                        f"{', '.join(comp.model_types)} (the {comp.what})")
            cfg.pop("architectures", None)
            config_obj = transformers.AutoConfig.for_model(**cfg)
            module = transformers.AutoModel.from_config(config_obj, dtype=torch.float32)
            if type(module).__name__ != comp.build:
                raise ComponentMismatch(f"{comp.prefix}: config builds {type(module).__name__}, expected {comp.build}")
        else:
            cls_name = cfg.get("_class_name", comp.build)
            if cls_name not in comp.classes:
                raise ComponentMismatch(f"{comp.config_name}: _class_name {cls_name!r} is not one of "
                                        f"{', '.join(comp.classes)} (the {comp.what})")
            try:
                module = getattr(diffusers, comp.build).from_config(cfg)
            except (TypeError, ValueError, AssertionError) as exc:
                raise ComponentMismatch(f"{comp.config_name} does not build a {comp.build}: {exc}") from None
    module.eval()
    if comp.keep:
        for child, sub in list(module.named_children()):
            names = [n for n, _ in sub.named_parameters(prefix=child)]
            if names and not any(re.match(comp.keep, n) for n in names):
                setattr(module, child, Absent.make(f"{comp.prefix}.{child}"))
    return module


def expected_shapes(comp: Component, module: Any) -> dict[str, tuple[int, ...]]:
    """{file name: shape} of every tensor the module loads (parameters and persistent buffers)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out[f"{comp.prefix}.{name}"] = tuple(int(d) for d in t.shape)
    return out


def check_shapes(comp: Component, expected: Mapping[str, tuple[int, ...]],
                 got: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Raise :class:`ComponentMismatch` when ``got`` (names -> shapes in ``where``) is not ``expected``."""
    missing = sorted(n for n in expected if n not in got)
    extra = sorted(n for n in got if n not in expected)
    wrong = sorted(n for n in expected if n in got and tuple(got[n]) != tuple(expected[n]))
    if not (missing or extra or wrong):
        return
    parts = []
    if wrong:
        parts.append(f"{len(wrong)} shape(s) differ: " + ", ".join(
            f"{n} is {list(got[n])}, config says {list(expected[n])}" for n in wrong[:_SHOW]))
    if missing:
        parts.append(f"{len(missing)} tensor(s) the config needs are absent: " + ", ".join(missing[:_SHOW]))
    if extra:
        parts.append(f"{len(extra)} tensor(s) the config does not have: " + ", ".join(extra[:_SHOW]))
    raise ComponentMismatch(f"{where}: the {comp.what} ({comp.prefix}) config does not match its weights; "
                            + "; ".join(parts))


def fill(comp: Component, module: Any, state: dict[str, Any]) -> None:
    """Assign ``state`` ({within-component name: tensor}) to the empty module, strictly."""
    result = module.load_state_dict(state, strict=False, assign=True)
    missing = list(result.missing_keys)
    if missing or result.unexpected_keys:  # check_shapes ran first: this is a safety net
        raise ComponentMismatch(f"{comp.prefix}: weights do not fill the module (missing {missing[:_SHOW]}, "
                                f"unexpected {list(result.unexpected_keys)[:_SHOW]})")
    left = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if left:
        raise ComponentMismatch(f"{comp.prefix}: parameters left without weights: {left[:_SHOW]}")
    for p in module.parameters():
        p.requires_grad_(False)
