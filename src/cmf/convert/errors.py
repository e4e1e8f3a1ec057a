"""The converter's error: a :class:`~cmf.format.errors.CmfError`, so the CLI reports it as one line."""

from __future__ import annotations

from ..format.errors import CmfError


class ConvertError(CmfError):
    """A source the converter cannot turn into a CMF file (unsupported model, missing or
    inconsistent tensors, unreadable config), or an export it cannot perform. Raised before the
    output is written; nothing is left behind under the target name."""
