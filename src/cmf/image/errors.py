"""Errors of the image pipeline tools: :class:`~cmf.format.errors.CmfError` subclasses, so the
CLI reports each as one line naming the component, file or tensor involved."""

from __future__ import annotations

from ..format.errors import CmfError


class ImageError(CmfError):
    """Base class of what ``imagine-pack`` and ``imagine`` refuse."""


class UnsupportedPipeline(ImageError):
    """The folder or file is not a pipeline this version packs or runs (see docs/IMAGE.md)."""


class MissingComponent(ImageError):
    """A component (folder, config, weights, tokenizer, scheduler) is absent from the source,
    or a component's tensors or config are absent from the file."""


class ComponentMismatch(ImageError):
    """A component's config does not describe its weights (names or shapes differ)."""


class MissingDependency(ImageError):
    """Running a pipeline needs the ``image`` extra: ``pip install 'pycmf[image]'``."""
