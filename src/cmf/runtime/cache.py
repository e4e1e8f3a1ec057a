"""Per-layer KV cache. Sliding-window layers keep only the keys their window can still see."""

from __future__ import annotations

import numpy as np


class LayerKV:
    """Keys/values of one attention layer: [n, kv_heads, head_dim] arrays that grow by doubling.

    ``window`` (sliding layers) bounds what is kept: after each append, keys older than
    ``window - 1`` positions before the newest are dropped (the next query cannot see them).
    """

    def __init__(self, kv_heads: int, head_dim: int, window: int | None = None, v_dim: int | None = None) -> None:
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window
        self.v_dim = v_dim or head_dim
        cap = 64
        self.k = np.empty((cap, kv_heads, head_dim), np.float32)
        self.v = np.empty((cap, kv_heads, self.v_dim), np.float32)
        self.n = 0  # valid entries
        self.start = 0  # absolute position of entry 0

    @property
    def end(self) -> int:
        """Absolute position after the last cached key."""
        return self.start + self.n

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Add T new keys/values; returns (keys, values, position of keys[0]) for attention."""
        t = k.shape[0]
        if self.n + t > self.k.shape[0]:
            cap = max(self.k.shape[0] * 2, self.n + t)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.empty((cap,) + old.shape[1:], np.float32)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        self.k[self.n:self.n + t] = k
        self.v[self.n:self.n + t] = v
        self.n += t
        keys, vals, first = self.k[: self.n], self.v[: self.n], self.start
        if self.window is not None and self.n > self.window:
            # Trim for the NEXT call; this call still needs the older keys for its earlier queries.
            drop = self.n - (self.window - 1)
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


class Cache:
    """The whole model's cache: one entry per layer (None for layers without attention state)."""

    def __init__(self, layers: list[LayerKV | None]) -> None:
        self.layers = layers
        self.pos = 0  # tokens consumed so far

    def truncate(self, pos: int) -> None:
        for layer in self.layers:
            if layer is not None:
                layer.truncate(pos)
        self.pos = min(self.pos, pos)
