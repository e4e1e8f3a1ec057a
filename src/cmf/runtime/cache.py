"""Per-layer sequence state: KV caches (sliding-window layers keep only the keys their window can
still see) and the conv + recurrent state of linear-attention layers, with speculative rollback."""

from __future__ import annotations

import numpy as np

from .ops.kv_values import storage_dtype, to_f32, to_storage


class LayerKV:
    """Keys/values of one attention layer: [n, kv_heads, head_dim] arrays that grow by doubling.

    ``window`` (sliding layers) bounds what is kept: after each append, keys older than
    ``window - 1`` positions before the newest are dropped (the next query cannot see them).
    """

    # Replacements of any LayerKV's arrays so far (the batched step keeps addresses while this
    # stays: runtime/ops/batch_attend.StepCaches).
    moves = 0

    def __init__(self, kv_heads: int, head_dim: int, window: int | None = None, v_dim: int | None = None,
                 dtype: str = "f32") -> None:
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window
        self.v_dim = v_dim or head_dim
        self.dtype = dtype  # "f32", or "f16": entries stored as f16 bits (runtime/ops/kv_values.py)
        store = storage_dtype(dtype)
        cap = 64
        self.k = np.empty((cap, kv_heads, head_dim), store)
        self.v = np.empty((cap, kv_heads, self.v_dim), store)
        self.n = 0  # valid entries
        self.start = 0  # absolute position of entry 0

    # The arrays' addresses, kept as they are replaced: the batched step passes every sequence's
    # cache to one compiled call by address (runtime/ops/batch_attend.py), and reading
    # ``ndarray.ctypes.data`` there cost ~1 µs an array, 16 sequences × 2 × 30 layers a step
    # (``capacity``: the entries the arrays hold, kept the same way).
    @property
    def k(self) -> np.ndarray:
        return self._k

    @k.setter
    def k(self, a: np.ndarray) -> None:
        self._k, self.k_addr, self.capacity = a, a.ctypes.data, a.shape[0]
        LayerKV.moves += 1

    @property
    def v(self) -> np.ndarray:
        return self._v

    @v.setter
    def v(self, a: np.ndarray) -> None:
        self._v, self.v_addr = a, a.ctypes.data
        LayerKV.moves += 1

    @property
    def end(self) -> int:
        """Absolute position after the last cached key."""
        return self.start + self.n

    def reserve(self, t: int) -> int:
        """Make room for ``t`` more entries (the arrays grow by doubling); returns the index the
        first of them goes to. The caller writes ``k[i]``/``v[i]`` and then advances ``n``."""
        if self.n + t > self.k.shape[0]:
            cap = max(self.k.shape[0] * 2, self.n + t)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.empty((cap,) + old.shape[1:], old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        return self.n

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Add T new keys/values; returns (keys, values, position of keys[0]) for attention, as
        float32 whatever the cache stores (an f16 cache's entries are read back after rounding,
        as the token step reads them)."""
        t = k.shape[0]
        self.reserve(t)
        self.k[self.n:self.n + t] = to_storage(k, self.k.dtype.type)
        self.v[self.n:self.n + t] = to_storage(v, self.v.dtype.type)
        self.n += t
        keys, vals, first = to_f32(self.k[: self.n]), to_f32(self.v[: self.n]), self.start
        if self.window is not None and self.n > self.window:
            # Trim for the NEXT call; this call still needs the older keys for its earlier queries.
            drop = self.n - (self.window - 1)
            if self.dtype == "f32":  # views of the arrays trimmed below (an f16 cache's are copies)
                keys, vals = keys.copy(), vals.copy()
            self.k[: self.n - drop] = self.k[drop:self.n]
            self.v[: self.n - drop] = self.v[drop:self.n]
            self.n -= drop
            self.start += drop
        return keys, vals, first

    def truncate(self, end: int) -> None:
        """Forget every key at absolute position >= end (speculative rollback)."""
        if end < self.start:
            raise ValueError(f"cannot roll back to {end}: the window already dropped positions < {self.start}")
        self.n = min(self.n, end - self.start)


class LinearState:
    """Gated DeltaNet state of one layer: the last K-1 conv inputs and S [heads, dk, dv].

    A recurrent state cannot be cut back like a KV cache, so rollback works from snapshots: while
    ``record`` is on, each forward call keeps the state before it and after each of its positions
    (:meth:`remember`); :meth:`truncate` restores one of those. Only the latest call's snapshots
    are kept — exactly what a speculative verify round needs.
    """

    def __init__(self, conv_dim: int, kernel: int, heads: int, k_dim: int, v_dim: int) -> None:
        self.conv = np.zeros((kernel - 1, conv_dim), np.float32)
        self.S = np.zeros((heads, k_dim, v_dim), np.float32)
        self.pos = 0  # absolute position after the last consumed token
        self.record = False
        self._snap: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def remember(self, pos0: int, before: tuple[np.ndarray, np.ndarray], convs: list[np.ndarray],
                 states: list[np.ndarray]) -> None:
        """Snapshots of a forward call that started at ``pos0``: the state before it and after each
        of its positions (replacing the previous call's)."""
        self._snap = {pos0: before}
        for i, (c, s) in enumerate(zip(convs, states)):
            self._snap[pos0 + i + 1] = (c, s)

    def can_truncate(self, end: int) -> bool:
        return end >= self.pos or end in self._snap

    def truncate(self, end: int) -> None:
        """Return to the state after position ``end - 1`` (speculative rollback)."""
        if end >= self.pos:
            return
        if not self.can_truncate(end):
            raise ValueError(f"cannot roll linear-attention state back to {end}: no snapshot (record is off "
                             f"or the position is older than the last forward call)")
        conv, s = self._snap[end]
        self.conv, self.S = conv.copy(), s.copy()
        self.pos = end


class Cache:
    """The whole model's cache: one entry per layer (None for layers without sequence state)."""

    def __init__(self, layers: list[LayerKV | LinearState | None]) -> None:
        self.layers = layers
        self.pos = 0  # tokens consumed so far

    def record(self, on: bool = True) -> None:
        """Keep per-position linear-attention snapshots of each forward call (for :meth:`truncate`)."""
        for layer in self.layers:
            if isinstance(layer, LinearState):
                layer.record = on

    def truncate(self, pos: int) -> None:
        """Forget every position >= ``pos`` (KV entries dropped, linear states restored)."""
        for layer in self.layers:  # check first: a refused rollback leaves every layer as it was
            if isinstance(layer, LinearState) and not layer.can_truncate(pos):
                layer.truncate(pos)  # raises, naming the position
            if isinstance(layer, LayerKV) and pos < layer.start:
                layer.truncate(pos)
        for layer in self.layers:
            if layer is not None:
                layer.truncate(pos)
        self.pos = min(self.pos, pos)
