"""Late-bound implementations that a lower layer calls but does not import: the tensor codecs.

``cmf.format`` stores tensors as bytes. Turning a quantized tensor into floats
(``CmfFile.array``) or floats into a dtype's bytes (``CmfWriter.add_array``) is the work of the
codecs in ``cmf.quant``, which sit above the container (they import its constants and errors).
So the container asks this module for the codec, and the package root (``cmf/__init__.py``, run
before any ``cmf.*`` module) names ``cmf.quant`` as the provider: every import of pycmf has it
wired, loaded on first use, and no package imports one above it. Standard library only: the root
imports this module at start-up (``cmf --help`` loads no numpy).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence


class Codec(Protocol):
    """What the container needs of a codec package (``cmf.quant`` is one)."""

    def decode(self, data: Any, dtype: Any, shape: Sequence[int]) -> Any: ...

    def encode(self, array: Any, dtype: Any, **options: Any) -> bytes: ...


_provider: Callable[[], Codec] | None = None
_codec: Codec | None = None


def set_codec_provider(load: Callable[[], Codec] | None) -> None:
    """Name the function that loads the codec (called once, on first use)."""
    global _provider, _codec
    _provider, _codec = load, None


def codec() -> Codec | None:
    """The codec, loaded on first use; None when no provider is set or it cannot be imported (a
    partial install): the caller then says which tensor it could not decode or encode."""
    global _codec
    if _codec is None and _provider is not None:
        try:
            _codec = _provider()
        except ImportError:
            return None
    return _codec


__all__ = ["Codec", "codec", "set_codec_provider"]
