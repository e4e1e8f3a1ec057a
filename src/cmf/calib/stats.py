"""Input statistics of every matrix, collected by running a model on a calibration text.

For each 2-D matrix W used as ``y = x @ W.T`` inside the decoder layers, the sum over calibration
tokens of ``x xᵀ`` (the GPTQ Hessian, ``cols × cols``) and of ``x²`` (its diagonal: llama.cpp's
importance matrix) are accumulated. Matrices fed the same activations (q/k/v, gate/up) share one
accumulator: the runtime hands them the very same array, which is how sharing is detected, so no
architecture table is needed. Full Hessians are kept while their total stays under a memory
budget; past it, matrices get the diagonal only (logged), which the encoders use as importance.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

PENDING = 8  # distinct inputs held before the oldest is folded in (callers of one input are near)
# The ridge a tight target-size budget rounds and scores with: H + RIDGE·mean(diag H)·I. GPTQ on
# the bare Hessian (1% damping) fits the calibration text's activations; where most matrices are
# at 4 bits or below, 0.3 measured better on other text on both real models, and up to 0.7% worse
# where they are not (docs/QUANT.md, "The ridge"): plain --calib and loose budgets keep the bare one.
# A tight budget's FFN down projections take ``encoding.DOWN_RIDGE`` instead (at 4 bits and more).
RIDGE = 0.3


def with_ridge(h: np.ndarray, ridge: float) -> np.ndarray:
    """``h + ridge·mean(live diag h)·I`` as a new array (``h`` itself for a ridge of 0)."""
    if not ridge:
        return h
    d = np.diag(h)
    live = d > 0
    out = np.array(h, np.float64)
    if live.any():
        out[np.diag_indices_from(out)] += ridge * float(d[live].mean())
    return out


@dataclass(eq=False)
class InputStats:
    """Σ x² (and Σ x xᵀ when kept) over ``tokens`` calibration tokens of one input."""

    cols: int
    hessian: np.ndarray | None  # (cols, cols) f32, or None past the memory budget
    sq: np.ndarray = field(init=False)
    tokens: int = 0
    members: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sq = np.zeros(self.cols, np.float64)
        self.lock = threading.Lock()  # encoders on worker threads share the factor below
        self.factor: dict | None = None  # {ridge: [(hessian, act order, inverse Cholesky), uses]} while members remain

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("lock", None)
        state["factor"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).reshape(-1, self.cols)
        self.tokens += x.shape[0]
        self.sq += np.einsum("ti,ti->i", x, x, dtype=np.float64)
        if self.hessian is not None:
            self.hessian += x.T @ x

    def importance(self) -> np.ndarray:
        """Mean squared activation per input feature (f32, non-negative)."""
        return (self.sq / max(self.tokens, 1)).astype(np.float32)

    def mean_hessian(self) -> np.ndarray | None:
        """``Σ x xᵀ / tokens`` as f64, or None when only the diagonal was kept."""
        if self.hessian is None:
            return None
        return self.hessian.astype(np.float64) / max(self.tokens, 1)

    def robust_hessian(self, ridge: float) -> np.ndarray | None:
        """:meth:`mean_hessian` with :func:`with_ridge` (the bare Hessian for 0; see :data:`RIDGE`).
        None when only the diagonal was kept."""
        h = self.mean_hessian()
        return h if h is None else with_ridge(h, ridge)

    def copy(self) -> "InputStats":
        out = InputStats(self.cols, None if self.hessian is None else self.hessian.copy())
        out.sq, out.tokens = self.sq.copy(), self.tokens
        return out


class Collector:
    """Accumulates the inputs each recorded matrix sees (see the module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.stats: dict[str, InputStats] = {}
        # (input as the runtime handed it, a copy taken then, the names given it): identity finds
        # the sharers, the copy holds the values in case the runtime reuses the buffer meanwhile
        self._pending: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
        self._bytes = 0
        self.diagonal_only: list[str] = []

    def record(self, name: str, x: np.ndarray) -> None:
        for arr, _, names in self._pending:
            if arr is x:
                names.append(name)
                return
        self._pending.append((x, np.array(x, np.float32), [name]))
        if len(self._pending) > PENDING:
            self._fold(*self._pending.pop(0)[1:])

    def flush(self) -> None:
        """Fold in every pending input (end of a window)."""
        while self._pending:
            self._fold(*self._pending.pop(0)[1:])

    def _fold(self, x: np.ndarray, names: list[str]) -> None:
        group = set(names)
        done: set[int] = set()
        for name in names:
            st = self.stats.get(name)
            if st is None:
                continue
            if not st.members <= group:  # shared so far, not this time: the names part ways
                st = self._split(st, group)
            if id(st) not in done:
                st.add(x)
                done.add(id(st))
        fresh = [n for n in names if n not in self.stats]
        if fresh:
            st = self._new(x.shape[-1], fresh)
            st.add(x)

    def _split(self, st: InputStats, group: set[str]) -> InputStats:
        inside = st.members & group
        twin = st.copy()
        twin.members = inside
        st.members -= inside
        for n in inside:
            self.stats[n] = twin
        self._bytes += 0 if twin.hessian is None else twin.hessian.nbytes
        return twin

    def _new(self, cols: int, names: list[str]) -> InputStats:
        need = 4 * cols * cols
        hess = None
        if self._bytes + need <= self.max_bytes:
            hess = np.zeros((cols, cols), np.float32)
            self._bytes += need
        else:
            self.diagonal_only += names
        st = InputStats(cols, hess, members=set(names))
        for n in names:
            self.stats[n] = st
        return st

    @property
    def hessian_bytes(self) -> int:
        return self._bytes


class Recorder:
    """A LinearOp that records its input in a :class:`Collector`, then runs the wrapped op."""

    def __init__(self, op, name: str, collector: Collector) -> None:  # noqa: ANN001 - a LinearOp
        self.op, self.name, self.collector = op, name, collector
        self.out_features, self.in_features = op.out_features, op.in_features

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from ..runtime.ops.linear import mm

        self.collector.record(self.name, x)
        return mm(self.op, x)

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self.op.rows(rows, x)

    def __getattr__(self, attr: str):  # noqa: ANN204 - everything else is the op's
        return getattr(self.op, attr)
