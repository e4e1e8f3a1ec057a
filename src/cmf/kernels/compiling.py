"""Telling a caller when numba compiles one of pycmf's kernels.

Every kernel is compiled with ``cache=True``: its first use after an install or an upgrade (or a
new specialization of it) compiles it — 10–40 s for the kernels one model uses — and later
processes load the machine code from numba's cache in milliseconds. Without a word a first run
looks hung, so the command line uses :func:`on_compile` to say why it waits; the library itself
only logs each compilation (INFO)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_callbacks: list[Callable[[str], None]] = []
_installed = False


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


def on_compile(callback: Callable[[str], None]) -> None:
    """Call ``callback(name)`` each time this process starts compiling one of pycmf's kernels —
    a numba cache miss; ``name`` is the kernel's ``module.qualname``. A callback registered twice
    is called once; cache loads never call it."""
    global _installed
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)
        if _installed:
            return
        from numba.core import event

        class _Listener(event.Listener):
            def on_start(self, ev: Any) -> None:  # noqa: ANN401 - a numba Event
                name = kernel_name(ev.data)
                if name is not None:
                    _started(name)

            def on_end(self, ev: Any) -> None:  # noqa: ANN401
                pass

        event.register("numba:compile", _Listener())
        _installed = True


__all__ = ["kernel_name", "on_compile"]
