"""Errors of the runtime's plan stage (re-exported by ``cmf.runtime.plan``)."""

from __future__ import annotations

from ..format.errors import CmfError


class PlanError(CmfError):
    """The file's tensors or header do not describe a model this runtime can execute."""
