"""Errors of the vLLM integration: each says which file and what to do."""

from __future__ import annotations

from ...format.errors import CmfError


class VllmPluginError(CmfError):
    """Base class of everything the vLLM integration refuses."""


class IntegrityRefused(VllmPluginError):
    """The file failed its hash chain or signature check, so its weights are not loaded."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class StaleFolder(VllmPluginError):
    """The materialised folder no longer matches the CMF file it was made from."""


class UnsupportedSelection(VllmPluginError):
    """A skill, task mask or option that vLLM cannot serve from this file."""


class CmfFileNotFound(VllmPluginError, FileNotFoundError):
    """``load_format="cmf"`` was given a path that does not exist."""


class NotACmfFile(VllmPluginError, ValueError):
    """``load_format="cmf"`` was given a file that does not start with the CMF magic."""
