"""Tensor sources for the runtime: skill indirection, cached small vectors, prepared matrices.

Matrices stay quantized in the mmap (``cmf.kernels.prepare`` gives a LinearOp over the stored
bytes); only 1-D tensors (norms, biases) are decoded once, since they are tiny.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..format.reader import CmfFile, QTensor


class Weights:
    """Named tensor access for one model, with optional skill indirection (spec §9)."""

    def __init__(self, file: CmfFile, skill: str | None = None, *, reference_kernels: bool = False) -> None:
        self.file = file
        self.skill = skill
        self.reference = reference_kernels
        self._vectors: dict[str, np.ndarray] = {}
        self._linears: dict[str, object] = {}

    def source_name(self, name: str) -> str:
        """``skill.{active}.{name}`` when the active skill replaces ``name``, else ``name``."""
        if self.skill:
            alt = f"skill.{self.skill}.{name}"
            if alt in self.file:
                return alt
        return name

    def has(self, name: str) -> bool:
        return self.source_name(name) in self.file

    def shape(self, name: str) -> tuple[int, ...] | None:
        src = self.source_name(name)
        return self.file.tensor(src).shape if src in self.file else None

    def qtensor(self, name: str) -> QTensor:
        return self.file.tensor(self.source_name(name))

    def vector(self, name: str | None) -> np.ndarray | None:
        """A small tensor decoded to float32 once (norm weights, biases)."""
        if name is None:
            return None
        v = self._vectors.get(name)
        if v is None:
            v = np.ascontiguousarray(self.file.array(self.source_name(name)), dtype=np.float32)
            self._vectors[name] = v
        return v

    def linear(self, name: str):
        """The LinearOp of a stored matrix (y = x @ W.T), prepared once."""
        op = self._linears.get(name)
        if op is None:
            op = kernels.prepare(self.qtensor(name), reference=self.reference)
            self._linears[name] = op
        return op

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Decode only the rows ``ids`` of a matrix (embedding lookups)."""
        t = self.qtensor(name)
        ids = np.asarray(ids, dtype=np.int64)
        if t.dtype == 0:  # f32: a zero-copy gather
            return t.numpy().view("<f4").reshape(t.shape)[ids].astype(np.float32)
        from .. import quant

        return quant.decode_rows(t.numpy(), t.dtype, t.shape, ids)
