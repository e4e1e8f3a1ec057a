"""numba's on-disk cache, keyed to all of pycmf's numba sources rather than one file.

numba stamps a cached kernel with the hash of the kernel's own source file only. A kernel
compiles in the callees it calls from other files, so after a change to a callee (a new
argument, a new layout) an unchanged caller's cached machine code still holds the old callee:
the process runs stale code and may write out of bounds (seen on 2026-12-07: a packer whose
signature changed, called from an unchanged file's cached kernel, crashed the interpreter).
Installs from a wheel and fresh clones can hit it too, since the stamp is the file's content,
not its date.

:func:`install` puts a locator in front of numba's own for functions defined in the ``cmf``
package: it finds the same cache folder numba would, and adds to the stamp a fingerprint of
every pycmf source file that uses numba and of the settings that change compiled code
(:data:`KNOBS`), so any change to one of them makes every cached kernel compile again (once).
Other packages' functions are untouched.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parent
# Settings read when a kernel module is imported that change the code it compiles (the integer
# dot's form, the ladder scales' form): without them in the stamp, setting one would load
# kernels cached under the other value and be silently ignored.
KNOBS = ("CMF_DOT_PATH", "CMF_NO_VNNI", "CMF_LADDER_SCALES")
_fingerprint: str | None = None
_installed = False


def package_fingerprint() -> str:
    """A hash of every ``.py`` file of the package that mentions numba (names and contents) and
    of the :data:`KNOBS` settings, computed once per process (~200 files, a few ms)."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        for knob in KNOBS:
            h.update(f"{knob}={os.environ.get(knob, '')}\0".encode())
        for path in sorted(_ROOT.rglob("*.py")):
            data = path.read_bytes()
            if b"numba" in data:
                h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0" + data + b"\0")
        _fingerprint = h.hexdigest()[:32]
    return _fingerprint


def _ours(py_file: str) -> bool:
    try:
        Path(py_file).resolve().relative_to(_ROOT)
    except (ValueError, OSError):
        return False
    return True


def install() -> bool:
    """Put the package-wide stamp in front of numba's cache locators (idempotent). Returns
    whether it is in place; a numba without the locator list this relies on is left as it is
    (logged), and then only the per-file stamp guards the cache."""
    global _installed
    if _installed:
        return True
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    base = getattr(caching, "_CacheLocator", None)
    classes = getattr(impl, "_locator_classes", None)
    if base is None or not isinstance(classes, list):
        log.warning("numba %s: no cache locator list found; kernels are cached per source file only",
                    getattr(__import__("numba"), "__version__", "?"))
        return False

    class PackageStampedLocator(base):
        """numba's own locator for a ``cmf`` function, with :func:`package_fingerprint` added to
        its source stamp."""

        def __init__(self, inner) -> None:  # noqa: ANN001 - a numba locator
            self._inner = inner

        def ensure_cache_path(self) -> None:
            self._inner.ensure_cache_path()

        def get_cache_path(self) -> str:
            return self._inner.get_cache_path()

        def get_source_stamp(self):  # noqa: ANN201 - any picklable value
            return (self._inner.get_source_stamp(), package_fingerprint())

        def get_disambiguator(self) -> str:
            return self._inner.get_disambiguator()

        @classmethod
        def from_function(cls, py_func, py_file):  # noqa: ANN001, ANN206
            if not _ours(py_file):
                return None
            for other in classes:
                if other is not cls:
                    inner = other.from_function(py_func, py_file)
                    if inner is not None:
                        return cls(inner)
            return None

    classes.insert(0, PackageStampedLocator)
    _installed = True
    return True


__all__ = ["install", "package_fingerprint"]
