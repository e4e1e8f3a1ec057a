"""The CMF error hierarchy: one class per failure kind.

Every message names the file, section, offset or tensor involved. ``CmfError`` is the base of
everything the format layer raises on bad input, and is exported as ``cmf.CmfError``.
"""

from __future__ import annotations


class CmfError(Exception):
    """Base class of every CMF format error."""


class FileNotFound(CmfError, FileNotFoundError):
    """The path does not exist."""


class IoError(CmfError, OSError):
    """An operating-system error while reading or writing a CMF file."""


class InvalidMagic(CmfError):
    """The file does not start with ``CMF\\x01``."""


class UnsupportedVersion(CmfError):
    """The envelope version is not 2."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version


class UnsupportedFeature(CmfError):
    """``required_features`` has a bit this reader refuses (3, 4 or unknown)."""

    def __init__(self, message: str, bits: int = 0) -> None:
        super().__init__(message)
        self.bits = bits


class BoundsError(CmfError):
    """A section, tensor or payload lies outside the file or its section, or is misaligned."""


class ParseError(CmfError):
    """A structure (header JSON, directory, masks, sparse index) cannot be decoded."""


class UnknownDtype(ParseError):
    """A directory record names a dtype id this reader does not know."""

    def __init__(self, message: str, dtype_id: int | None = None) -> None:
        super().__init__(message)
        self.dtype_id = dtype_id


class UnsupportedDtype(CmfError):
    """A known but reserved dtype (5/6/7) or one without a decoder was asked to decode."""


class MissingTensor(CmfError, KeyError):
    """A tensor name is not in the directory."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "missing tensor"


class HashMismatch(CmfError):
    """A stored hash64 does not match the bytes it covers."""


class SignatureError(CmfError):
    """A detached signature is malformed, does not match the file, or fails to verify."""


class ShardError(CmfError):
    """A shard set is incomplete or inconsistent (missing sibling, count mismatch)."""


class MissingShard(ShardError):
    """Opening a shard set found siblings absent; ``missing`` lists their 1-based numbers."""

    def __init__(self, message: str, no: int = 0, count: int = 0, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.no, self.count, self.missing = no, count, tuple(missing)


class SkillBaseMismatch(CmfError):
    """A standalone skill file was cut against a different base (directory hash differs)."""


class WriterError(CmfError):
    """The writer was used out of order or given inconsistent input."""


class NotRunnable(CmfError):
    """The file opens for inspection but cannot be executed (e.g. a standalone SKILL_FILE, or a
    header key this runtime does not model); ``unmet`` names the keys when known."""

    def __init__(self, message: str, unmet: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.unmet = tuple(unmet)
