"""Every layer of a decoded token in one compiled call.

Where each layer runs as one compiled call (``layer_step.py``), a token still made one such
call per layer from Python, with the Python around it — the layer's binding check, the cache
slot, the RoPE lookup, the call's argument conversion — run right after the products have
streamed megabytes of weights through the caches, which evicts that Python's own objects. On
SmolLM2-135M (30 layers) that cost ~12 µs a layer, ~8% of a decoded token (docs/PERFORMANCE.md,
"One call a token"). :class:`LayerStack` makes the same ``layer_step`` calls, in the same order
on the same arguments, from one compiled loop: the same bits.

It applies when every layer can run as one call (``BlockStep.layer_args``), all layers share a
RoPE profile and a full (not sliding) KV cache of one length, attention over it runs on one
thread, and the layers' arguments have one numba type (a typed list holds them; a file whose
layers mix dtypes has several types and keeps the per-layer calls). Anything else — or a token
that changes what is bound (thread count, task masks) in a way that breaks one of these — falls
back to the per-layer loop for that token, before anything is written. Those checks are a pass
over the layers in Python, ~170 µs a token in the step; while nothing they depend on has moved
(see :meth:`LayerStack.run`) a token skips them.
"""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import numba
import numpy as np
from numba.typed import List

from .cache import LayerKV
from .layer_step import layer_step
from .ops.decode import attends_serially
from .step import rope_at

log = logging.getLogger(__name__)


@numba.njit(cache=True, nogil=True)
def stack_step(layers, x, cos, sin, keys, values, n, pos, k0):  # pragma: no cover - compiled
    """x [1, hidden] through every layer in place: ``layer_step`` for each, cache entry ``n`` of
    each layer's ``keys``/``values`` written."""
    for i in range(len(layers)):
        layer_step(layers[i], x, cos, sin, keys[i], values[i], n, pos, k0)


@numba.njit(cache=True)
def _list_of(item):  # pragma: no cover - compiled
    out = List()
    out.append(item)
    return out


@numba.njit(cache=True)
def _append(out, item):  # pragma: no cover - compiled
    out.append(item)


def typed_list(items: list) -> List:
    """A numba typed List of ``items`` (one numba type), built by compiled functions of this
    module's cache: ``numba.typed.List(items)`` compiles the list's methods for the item type in
    every process (~0.2 s and 30–50 MB of LLVM's memory per item type, which stayed in its peak
    RSS; docs/PERFORMANCE.md, "One call a token"). One item at a time, so a specialization serves
    every layer count."""
    out = _list_of(items[0])
    for item in items[1:]:
        _append(out, item)
    return out


class _Last(NamedTuple):
    """What the last stacked token left, for :meth:`LayerStack.run`'s short way to compare."""

    cache: weakref.ref
    threads: int
    epoch: int
    n: int  # the cache entry the next token goes to
    moves: int  # LayerKV.moves then
    q: np.ndarray  # layer 0's query buffer (its shape decides serial attention)
    rope: object  # the layers' RoPE profile


class LayerStack:
    """The layers of one model as one compiled call per token (see the module docstring)."""

    def __init__(self, blocks: list) -> None:
        self.blocks = blocks
        self._args: list = []  # the LayerArgs the typed list was built from
        self._typed = None  # numba typed List of them, or None when they have no common type
        # per cache (a server may alternate between several): its layers' K arrays, typed K and V
        self._kv: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last: _Last | None = None

    def _layer_args(self, nt: int) -> list | None:
        out = []
        for b in self.blocks:
            step = b._step
            if not b.alive or b.n_exit is not None or step is None:
                return None
            args = step.layer_args(nt)
            if args is None:
                return None
            out.append(args)
        return out

    def _typed_args(self, args: list):  # noqa: ANN202 - a numba typed List or None
        if len(args) != len(self._args) or any(a is not b for a, b in zip(args, self._args)):
            self._args = args
            if len({numba.typeof(a) for a in args}) == 1:
                self._typed = typed_list(args)
            else:  # layers of different dtypes: a typed list holds one type
                log.debug("layer stack: the layers' arguments differ in type; one call a layer")
                self._typed = None
        return self._typed

    def _typed_cache(self, cache) -> tuple:  # noqa: ANN001 - a runtime.cache.Cache
        layers = cache.layers
        held = self._kv.get(cache)
        if held is None or any(kv.k is not k for kv, k in zip(layers, held[0])):
            ks = [kv.k for kv in layers]
            held = self._kv[cache] = (ks, typed_list(ks), typed_list([kv.v for kv in layers]))
        return held[1], held[2]

    def run(self, x: np.ndarray, cache, pos: int, nt: int, epoch: int = 0) -> bool:  # noqa: ANN001 - a Cache
        """Advance x [1, hidden] through every layer and the cache by one token, or return False
        having changed nothing when the stack does not apply to this token. ``epoch`` counts the
        changes to what the layers bind (``Model.step_epoch``: task masks, rebuilt layers): while
        it, the thread count and the cache stay as at the last stacked token, and no KV array
        anywhere was moved since, the layers' checks are not redone (in a decode step, run after the weight stream, they
        cost ~170 µs a token on SmolLM2-135M, against ~40 µs for the short way)."""
        layers = cache.layers
        last = self._last
        if last is not None and last.cache() is cache and last.threads == nt and last.epoch == epoch:
            first = layers[0]
            n = first.n
            # LayerKV.moves counts every K/V array replaced anywhere: unchanged, no layer's moved
            if (n == last.n and LayerKV.moves == last.moves and n < first.capacity
                    and attends_serially(last.q, n + 1, nt)):
                held = self._kv[cache]
                self._advance(x, layers, held[1], held[2], last.rope, n, pos, first.start)
                self._last = last._replace(n=n + 1)
                return True
        self._last = None
        if not self._checked_run(x, cache, pos, nt):
            return False
        attn = self.blocks[0]._step.attn
        self._last = _Last(weakref.ref(cache), nt, epoch, layers[0].n, LayerKV.moves, attn.q, attn.attend.rope)
        return True

    def _advance(self, x: np.ndarray, layers: list, keys, values, rope, n: int, pos: int,  # noqa: ANN001
                 start: int) -> None:
        """The stacked call for entry ``n`` at ``pos``, then every layer's cache advanced past it."""
        cos, sin = rope_at(rope, pos)
        stack_step(self._typed, x, cos, sin, keys, values, n, pos, start)
        for kv in layers:
            kv.n = n + 1

    def _checked_run(self, x: np.ndarray, cache, pos: int, nt: int) -> bool:  # noqa: ANN001 - a Cache
        """:meth:`run` with every condition checked."""
        layers = cache.layers
        if len(layers) != len(self.blocks):
            return False
        args = self._layer_args(nt)
        if args is None:
            return False
        if self._typed_args(args) is None:
            return False
        first = layers[0]
        if type(first) is not LayerKV:
            return False
        n, start = first.n, first.start
        attend = self.blocks[0]._step.attn
        rope = attend.attend.rope
        for b, kv in zip(self.blocks, layers):
            if (type(kv) is not LayerKV or kv.window is not None or kv.n != n or kv.start != start
                    or b._step.attn.attend.rope is not rope or b._step.attn.q.shape != attend.q.shape):
                return False
        if not attends_serially(attend.q, n + 1, nt):
            return False
        for kv in layers:
            kv.reserve(1)
        keys, values = self._typed_cache(cache)
        self._advance(x, layers, keys, values, rope, n, pos, start)
        return True


__all__ = ["LayerStack", "stack_step"]
