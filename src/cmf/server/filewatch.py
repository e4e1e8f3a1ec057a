"""The served model file, watched: a file truncated or rewritten in place under the server's
mapping is refused with 503 instead of crashing the process with SIGBUS on the next request.

The weights are read from a shared read-only mmap. Three things can happen to the file:

- **replaced** (a new inode renamed over the path — what every cmf writer does): the mapping
  keeps the old inode alive, so the server keeps serving the version it loaded, safely; it logs
  this once and ``/health`` says ``file: replaced`` (restart to serve the new one);
- **truncated** (same inode, smaller): touching a page past the new end raises SIGBUS, which
  kills the process. Every request that runs the model is refused with 503
  ``model_file_changed``, and ``/health`` answers 503 so that a supervisor restarts the server;
- **modified in place** (same inode, new size or mtime: an in-place append or recode): the
  mapped bytes may now mix two versions, so it is refused the same way.

One ``os.stat`` per path and request (~2 µs). A request already running when the file is cut is
protected by the read lease of :mod:`.lease` where one can be had (``revoked`` then reports
that the engine stopped for a writer); without it the window is the requests in flight.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .errors import RequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Stamp:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> "_Stamp | None":
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatch:
    """Stat stamps of the served files, taken at start; :meth:`state` compares them with now."""

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self.paths = [Path(p) for p in paths]
        self.stamps = {p: _Stamp.of(p) for p in self.paths}
        self._reported: set[tuple[Path, str]] = set()
        self.revoked: Callable[[], bool] = lambda: False  # the engine stopped for a writer (lease.py)

    def _state_of(self, path: Path) -> str:
        then, now = self.stamps[path], _Stamp.of(path)
        if then is None or now == then:
            return "ok"
        if now is None or (now.dev, now.ino) != (then.dev, then.ino):
            return "replaced"  # the mapping holds the old inode: still safe to serve
        if now.size < then.size:
            return "truncated"
        return "modified"

    def state(self) -> str:
        """``ok``, ``replaced``, or the worst of ``modified`` / ``truncated`` over the files."""
        worst = "ok"
        rank = {"ok": 0, "replaced": 1, "modified": 2, "truncated": 3}
        for p in self.paths:
            s = self._state_of(p)
            if s != "ok" and (p, s) not in self._reported:
                self._reported.add((p, s))
                level = logging.WARNING if s == "replaced" else logging.ERROR
                log.log(level, "%s: the model file was %s while served%s", p, s,
                        "; serving the version loaded at start (restart to load the new one)" if s == "replaced"
                        else "; refusing requests (restart the server)")
            if rank[s] > rank[worst]:
                worst = s
        if rank[worst] < rank["modified"] and self.revoked():
            worst = "modified"  # opened for writing by another process: its bytes may change any time
        return worst

    @staticmethod
    def error(state: str) -> RequestError:
        """The 503 ``model_file_changed`` for a file ``state`` (truncated or modified)."""
        return RequestError(503, f"the model file was {state} while this server had it mapped; the server "
                                 f"must be restarted to serve it", code="model_file_changed")

    def check(self) -> None:
        """Raise a 503 ``model_file_changed`` when the mapped bytes can no longer be trusted."""
        s = self.state()
        if s in ("truncated", "modified"):
            raise self.error(s)
