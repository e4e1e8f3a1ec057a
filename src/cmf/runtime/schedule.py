"""The decoder layer's schedule, written once for every way the runtime runs a layer.

A layer is: RMSNorm, the token mixer, a residual add, RMSNorm, the FFN, a residual add — with
"sandwich" norms (after the mixer, before and after the FFN) where the plan has them (Gemma 2/3).
Blocks of tokens (``blocks.Block``), the one-token step (``step.BlockStep``) and the batched decode
step (``batched.BatchDecoder``) differ only in how each operator runs — new arrays or the
layer's buffers, row-parallel or one-token kernels, in-place or new sums — so each passes its
forms of the operators to :func:`run_layer`. ``BlockStep._plain`` is this schedule's common case
(pre-norms, no sandwich) with its calls bound and inlined, for the decode step's speed.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# norm(v, weight or None, slot) -> normalized v (weight None: v as it is or a copy), where slot
# names which of the caller's arrays may take the result: "h" (the next operator's input), "a"
# (the mixer's side), "f" (the FFN's side).
Norm = Callable[[np.ndarray, Any, str], np.ndarray]


def run_layer(block: Any, x: np.ndarray, mix: Callable[[np.ndarray], np.ndarray],
              ffn: Callable[[np.ndarray], np.ndarray], norm: Norm,
              add: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """x after one decoder layer (``block``: its norm weights and plan), with the caller's
    operators: ``mix(h)`` the token mixer's output, ``ffn(h)`` the FFN's, ``norm`` as above,
    ``add(x, y)`` the residual sum (in place or new; returned). The mixer's output is let go
    before the FFN runs (a [T, hidden] block less at the peak of a prefill)."""
    h = norm(x, block.n_in, "h")
    a = mix(h)
    del h
    if block.plan.sandwich:
        x = add(x, norm(a, block.n_post_attn, "a"))
        del a
        h = norm(x, block.n_pre_ffn, "h")
    else:
        x = add(x, a)
        del a
        h = norm(x, block.n_post_attn, "h")
    f = ffn(h)
    if block.plan.sandwich:
        f = norm(f, block.n_post_ffn, "f")
    return add(x, f)


__all__ = ["Norm", "run_layer"]
