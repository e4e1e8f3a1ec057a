"""Read leases on the served files, so that a request in flight never touches a page truncated
away under the mapping (which kills the process with SIGBUS).

The per-request stat check of :mod:`.filewatch` refuses requests *after* a file changed; a
request already generating when another process cuts the file would still read past the new end.
A Linux read lease (``fcntl(F_SETLEASE, F_RDLCK)``) closes that window: a process that
truncates the file or opens it for writing is blocked by the kernel, and this process gets
SIGIO. The handler hands the break to a thread that waits for the engine to finish its current
step (:meth:`Engine.revoke`: from then on every sequence, queued job and call fails with 503
``model_file_changed``), then releases the lease, and the writer proceeds. The kernel breaks a
lease itself after ``/proc/sys/fs/lease-break-time`` (45 s by default), far above one step.

A lease needs Linux, the file's owner (or CAP_LEASE), a local filesystem and a handler
installed from the main thread; where one cannot be had the server logs it and runs with the
stat check alone (the window is then the requests in flight, as docs/SERVER.md says).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

_GUARDS: "weakref.WeakSet[LeaseGuard]" = weakref.WeakSet()
_INSTALLED: list[bool] = []


def _on_sigio(signum: int, frame: object) -> None:
    """SIGIO: some lease is being broken; each guard checks its own (no blocking here: the
    main thread may be the one whose truncate waits)."""
    for g in list(_GUARDS):
        g.poll()


class LeaseGuard:
    """Read leases on ``paths``; ``revoke()`` is called (on a helper thread) when one is broken and
    must return only once nothing touches the mapping any more; then the leases are released."""

    def __init__(self, paths: Iterable[str | os.PathLike], revoke: Callable[[], None]) -> None:
        self.paths = [Path(p) for p in paths]
        self._revoke = revoke
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self.active = False
        self.broken = False
        try:
            import fcntl

            if threading.current_thread() is not threading.main_thread():
                raise OSError("signal handlers can only be installed from the main thread")
            if not _INSTALLED:  # our handler must be in place before any lease exists
                signal.signal(signal.SIGIO, _on_sigio)
                _INSTALLED.append(True)
            for p in self.paths:
                fd = os.open(p, os.O_RDONLY)
                self._fds.append(fd)
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except (OSError, AttributeError, ValueError) as exc:
            log.info("no read lease on the model file (%s): a request in flight when the file is truncated "
                     "can still crash the server; requests after it are refused", exc)
            self._close_fds()
            return
        self.active = True
        _GUARDS.add(self)

    def poll(self) -> None:
        """From the SIGIO handler: start the release if one of our leases is being broken."""
        import fcntl

        if not self.active or self.broken:
            return
        for fd in self._fds:
            try:
                pending = fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK
            except OSError:
                pending = True
            if pending:  # during a break F_GETLEASE reports the type it is being broken to
                self.broken = True
                threading.Thread(target=self._release, name="cmf-lease-break", daemon=True).start()
                return

    def _release(self) -> None:
        log.error("%s: another process is truncating or writing the model file; stopping generation, "
                  "then releasing the file to it (restart the server to serve it again)",
                  ", ".join(str(p) for p in self.paths))
        try:
            self._revoke()  # returns once the engine's step is over and no further one will run
        finally:
            self.close()

    def _close_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # closing the descriptor releases its lease
            except OSError:
                pass
        self._fds = []

    def close(self) -> None:
        """Release the leases (the server is stopping, or a writer waits)."""
        with self._lock:
            self.active = False
            _GUARDS.discard(self)
            self._close_fds()
