"""Text-to-image pipeline containers (spec §12): pack a diffusers folder, run the file.

``cmf.image.pack(folder, out, quant)`` writes one ``.cmf`` from a diffusers pipeline folder;
``cmf.image.load(path)`` returns the ready diffusers pipeline built from that file alone;
``cmf.image.generate(pipe, prompt, ...)`` makes an image. Importing this package is cheap:
torch and diffusers (the ``image`` extra) load only when a pipeline is built or run.
See docs/IMAGE.md.
"""

from __future__ import annotations

from typing import Any

from .errors import ComponentMismatch, ImageError, MissingComponent, MissingDependency, UnsupportedPipeline
from .recipes import RECIPES

__all__ = ["ComponentMismatch", "ImageError", "MissingComponent", "MissingDependency", "RECIPES",
           "UnsupportedPipeline", "generate", "load", "pack", "save_png"]


def pack(*args: Any, **kwargs: Any) -> Any:
    """:func:`cmf.image.packer.pack`."""
    from .packer import pack as _pack

    return _pack(*args, **kwargs)


def load(path: Any, **kwargs: Any) -> Any:
    """:func:`cmf.image.loader.load`: the diffusers pipeline of a pipeline container."""
    from .loader import load as _load

    return _load(path, **kwargs)


def generate(pipe: Any, prompt: str, **kwargs: Any) -> Any:
    """:func:`cmf.image.txt2img.generate`."""
    from .txt2img import generate as _generate

    return _generate(pipe, prompt, **kwargs)


def save_png(result: Any, path: Any, metadata: Any = None) -> Any:
    """:func:`cmf.image.txt2img.save_png`."""
    from .txt2img import save_png as _save

    return _save(result, path, metadata)
