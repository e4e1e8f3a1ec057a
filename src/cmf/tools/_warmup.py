"""Compile time apart from tokens/s: warm the kernels before a timed run, and say how long
compiling took.

The first run after an install or upgrade compiles numba's kernels (10–40 s). Folded into a
timed run it would read as "25 prompt tokens at 1.2 t/s". :func:`warm_up` first runs one decode
step on a scratch cache (about the cost of one generated token): when that compiled nothing, the
cache is warm and the timed run starts at once; when it compiled, the cache was cold and a short
generation of the real prompt compiles the rest (its prefill shapes, its decode path) before the
timing starts. Whatever still compiles inside the timed run (a shape the warm-up did not take) is
left out of its rates by ``stream_generate`` itself (``GenerationResponse.compile_seconds``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..kernels import compiling

COMPILE_NOTE = "first run after an install or upgrade; cached for next time"


def compile_clause(seconds: float) -> str:
    """``compiled kernels in 17.3 s (first run after ...; cached for next time)``."""
    return f"compiled kernels in {seconds:.1f} s ({COMPILE_NOTE})"


def drain(responses: Iterable[Any]) -> None:
    """Run a generator of responses to its end, dropping them."""
    for _ in responses:
        pass


def warm_up(model: Any, generate: Callable[[], None]) -> float:  # noqa: ANN401 - a runtime Model
    """Compile what a timed run of ``model`` will need before it starts; returns the seconds spent
    compiling (0.0 on a warm cache). ``generate`` runs a short generation of the real prompt; it is
    called only when the one-token probe compiled something (a cold cache). Call it before
    anything is counted: expert selection counts (``CMF_MOE_STATS``) are zeroed after it."""
    compiling.install()
    before = compiling.totals()
    model.forward([0], model.new_cache())  # the decode step, on a scratch cache
    if (compiling.totals() - before).kernels:
        generate()
    if model.route_stats():  # the warm-up's tokens are not the text being counted
        model.reset_route_stats()
    return (compiling.totals() - before).seconds
