"""The common decoder layer of one token as one compiled call.

``BlockStep._plain`` (step.py) runs the common layer — pre-norms, attention over a cache that
keeps every entry, a gated FFN — as eight compiled calls with Python between them; run right
after a product has streamed megabytes of weights, that Python and each call's argument
conversion find their objects evicted and cost several times their warm price (~10 µs a layer,
docs/PERFORMANCE.md "One call a layer"). Where the layer has no bias, no output bias and no
task-mask scatter, and its attention runs on one thread (short caches), :func:`layer_step` makes
the same calls in the same order from compiled code: the same operator bodies (``ops/decode.py``)
and the same bound products (``kernels/bound.py``), hence the same bits. Its constants live in
one structref (:class:`LayerArgs`) built when the step binds its products.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.experimental import structref

from ..kernels.bound import run
from .ops.decode import add_into, add_norm_into, rms_norm_into, rope_append_attend

_FLAGS = {"cache": True, "nogil": True, "error_model": "numpy"}
_FIELDS = ("n_in", "n_post", "eps", "h", "a", "f", "q", "k", "v", "qn", "kn", "att_eps", "scale", "window",
           "softcap", "att", "qkv", "o", "gate_up", "down")


@structref.register
class LayerArgsType(types.StructRef):
    """The numba type of :class:`LayerArgs`."""


class LayerArgs(structref.StructRefProxy):
    """One layer's norms, buffers, attention constants and bound products (see :func:`bind_layer`)."""


structref.define_constructor(LayerArgs, LayerArgsType, list(_FIELDS))
structref.define_boxing(LayerArgsType, LayerArgs)


@numba.njit(**_FLAGS)
def _new(*fields):  # pragma: no cover - compiled
    """A LayerArgs of ``fields`` in ``_FIELDS``' order (cached: a structref's own Python
    constructor compiles anew in every process)."""
    return LayerArgs(*fields)


def bind_layer(block, h: np.ndarray, a: np.ndarray, f: np.ndarray, attn, calls: tuple) -> LayerArgs:  # noqa: ANN001
    """The structref of one layer: ``block`` (a blocks.Block with both pre-norms), its step's
    buffers ``h``/``a``/``f``, ``attn`` (its step.AttnStep) and the four bound products
    ``calls`` (``(run_bound, (bound,))`` each, from ``bound.prebind``)."""
    ta = attn.attend
    products = [args[0] for _, args in calls]
    return _new(block.n_in, block.n_post_attn, float(block.eps), h, a, f, attn.q, attn.k, attn.v, ta.qn, ta.kn,
                ta.eps, ta.scale, ta.window, ta.softcap, attn.att, *products)


@numba.njit(**_FLAGS)
def layer_step(L, x, cos, sin, K, V, n, pos, k0):  # pragma: no cover - compiled
    """x [1, hidden] through the layer in place: BlockStep._plain's calls in its order, with
    attention over cache entries [0, n] (entry n written here) on this thread."""
    rms_norm_into(x, L.n_in, L.eps, L.h)
    run(L.qkv)
    # (np.bool_: a literal True would compile the attention again beside the bool-typed callers, ~5 s)
    rope_append_attend(L.q, L.k, L.v, L.qn, L.kn, L.att_eps, cos, sin, K, V, n, pos, k0, L.scale, L.window,
                       L.softcap, L.att, np.bool_(True))
    run(L.o)
    add_norm_into(x, L.a, L.n_post, L.eps, L.h)
    run(L.gate_up)
    run(L.down)
    add_into(x, L.f)


__all__ = ["LayerArgs", "bind_layer", "layer_step"]
