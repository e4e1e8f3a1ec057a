"""Telling a caller when numba compiles one of pycmf's kernels, and for how long.

Every kernel is compiled with ``cache=True``: its first use after an install or an upgrade (or a
new specialization of it) compiles it — 10–40 s for the kernels one model uses — and later
processes load the machine code from numba's cache in milliseconds. Without a word a first run
looks hung, so the command line uses :func:`on_compile` to say why it waits; the library itself
only logs each compilation (INFO). :func:`totals` adds up the seconds spent compiling, so that
speeds can be reported without them (``stream_generate``'s rates, ``cmf run``'s stats line)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_callbacks: list[Callable[[str], None]] = []
_installed = False
_seconds = 0.0  # wall time inside outermost compilations of pycmf kernels, all threads
_kernels = 0  # pycmf kernels compiled (a kernel's callees compiled with it count too)
# Compilations nest (a kernel compiles the kernels it calls): only the outermost one is timed.
_local = threading.local()


@dataclass(frozen=True)
class CompileTotals:
    """What this process has compiled so far: pycmf kernels and the seconds they took."""

    kernels: int = 0
    seconds: float = 0.0

    def __sub__(self, other: "CompileTotals") -> "CompileTotals":
        return CompileTotals(self.kernels - other.kernels, self.seconds - other.seconds)


def kernel_name(data: Any) -> str | None:  # noqa: ANN401 - a numba event's data
    """``module.qualname`` of the pycmf function a ``numba:compile`` event is about, else None
    (a function outside the ``cmf`` package, or an event without a dispatcher)."""
    dispatcher = data.get("dispatcher") if isinstance(data, dict) else None
    fn = getattr(dispatcher, "py_func", None)
    module = getattr(fn, "__module__", None) or ""
    if fn is None or not (module == "cmf" or module.startswith("cmf.")):
        return None
    return f"{module}.{fn.__qualname__}"


def _started(name: str) -> None:
    log.info("compiling %s (not in numba's cache yet)", name)
    for callback in list(_callbacks):
        callback(name)


def _on_start(data: Any) -> None:  # noqa: ANN401 - a numba event's data
    global _kernels
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    name = kernel_name(data)
    if name is None:
        return
    with _lock:
        _kernels += 1
    if depth == 0:
        _local.t0 = time.perf_counter()
    _started(name)


def _on_end() -> None:
    global _seconds
    _local.depth = max(getattr(_local, "depth", 1) - 1, 0)
    t0 = getattr(_local, "t0", None)
    if _local.depth == 0 and t0 is not None:
        _local.t0 = None
        with _lock:
            _seconds += time.perf_counter() - t0


def install() -> None:
    """Listen to numba's compile events (once per process): :func:`totals` counts from here on."""
    global _installed
    with _lock:
        if _installed:
            return
        from numba.core import event

        class _Listener(event.Listener):
            def on_start(self, ev: Any) -> None:  # noqa: ANN401 - a numba Event
                _on_start(ev.data)

            def on_end(self, ev: Any) -> None:  # noqa: ANN401
                _on_end()

        event.register("numba:compile", _Listener())
        _installed = True


def totals() -> CompileTotals:
    """Kernels compiled and seconds spent compiling them since :func:`install` (cache loads are
    not compilations: a warm cache leaves both at zero). Subtract two readings for a span."""
    with _lock:
        return CompileTotals(_kernels, _seconds)


def on_compile(callback: Callable[[str], None]) -> None:
    """Call ``callback(name)`` each time this process starts compiling one of pycmf's kernels —
    a numba cache miss; ``name`` is the kernel's ``module.qualname``. A callback registered twice
    is called once; cache loads never call it."""
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)
    install()


__all__ = ["CompileTotals", "install", "kernel_name", "on_compile", "totals"]
