"""Tensor sources for the runtime: skill indirection, soft blends, cached small vectors, prepared matrices.

Matrices stay quantized in the mmap (``cmf.kernels.prepare`` gives a LinearOp over the stored
bytes); only 1-D tensors (norms, biases) are decoded once, since they are tiny.

Skills (spec §9): with a skill active, every tensor is read from ``skill.{id}.{name}`` when the
file has it, else from the backbone entry ``name`` — replacement, never addition, and still a view
into the mmap. A soft blend (spec claim 14) is the one case where memory is spent: each tensor
that at least one blended skill replaces becomes the working tensor Σ wᵢ·Tᵢ materialized in f32
(Tᵢ = skill i's replacement or the backbone tensor); every other tensor stays a view.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Mapping

import numpy as np

from .. import kernels
from ..format.reader import CmfFile, QTensor

log = logging.getLogger(__name__)

SKILL_PREFIX = "skill."


def skill_index(file: CmfFile) -> dict[str, dict[str, str]]:
    """{skill id: {backbone name: stored name}} read from the directory (the per-skill delta index
    of spec §9 is the directory itself: a prefix filter)."""
    out: dict[str, dict[str, str]] = {}
    for stored in file.keys():
        if stored.startswith(SKILL_PREFIX):
            sid, sep, name = stored[len(SKILL_PREFIX):].partition(".")
            if sep and sid and name:
                out.setdefault(sid, {})[name] = stored
    return out


class DenseLinear:
    """A LinearOp over a materialized f32 matrix (blended working tensors)."""

    def __init__(self, w: np.ndarray) -> None:
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.out_features, self.in_features = self.w.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32) @ self.w.T

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32) @ self.w[np.asarray(rows)].T

    def dequant_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows of the matrix (embedding lookups through a dense table)."""
        return self.w[np.asarray(rows)]

    def dense(self) -> np.ndarray:
        return self.w


# One component of the active selection: (skill id or None for the backbone, weight).
Component = tuple[str | None, float]


class Weights:
    """Named tensor access for one model, with skill indirection and soft blends (spec §9)."""

    def __init__(self, file: CmfFile, skill: str | None = None, *, blend: Mapping[str | None, float] | None = None,
                 reference_kernels: bool = False, int8_activations: bool = False) -> None:
        self.file = file
        self.reference = reference_kernels
        self.int8 = int8_activations  # the 4-bit family's fused products take int8 activations
        self.skill: str | None = None
        self.blend: dict[str | None, float] | None = None
        self._index = skill_index(file)
        self._vectors: dict[str, np.ndarray] = {}
        self._linears: dict[str, object] = {}
        self._dense: dict[str, np.ndarray] = {}
        self._mixed: dict[str, tuple[tuple[str, float], ...]] = {}
        self.configure(skill, blend)

    # -- selection ------------------------------------------------------------------------------
    def replaced(self, skill: str | None) -> set[str]:
        """Backbone names that ``skill`` replaces (empty for None or a skill without tensors)."""
        return set(self._index.get(skill, {})) if skill else set()

    def _sources_for(self, comps: list[Component], names: set[str]) -> dict[str, tuple[tuple[str, float], ...]]:
        """For each name, its sources with summed weights (the backbone counted once)."""
        out: dict[str, tuple[tuple[str, float], ...]] = {}
        for name in names:
            acc: dict[str, float] = {}
            for sid, w in comps:
                src = self._index.get(sid, {}).get(name, name) if sid else name
                acc[src] = acc.get(src, 0.0) + w
            out[name] = tuple(sorted(acc.items()))
        return out

    def _components(self) -> list[Component]:
        if self.blend is not None:
            return list(self.blend.items())
        return [(self.skill, 1.0)]

    def configure(self, skill: str | None = None, blend: Mapping[str | None, float] | None = None) -> set[str]:
        """Make ``skill`` (or, when given, the normalized ``blend`` {skill id or None: weight}) the
        active selection; return the backbone names whose working tensor changed.

        Cached operators of those names are dropped, everything else is kept, so the caller needs
        to re-prepare only the layers that use a returned name. A blend whose weight sits on one
        component is that component: no tensor is materialized.
        """
        if blend is not None:
            live = {k: float(v) for k, v in blend.items() if v > 0}
            if len(live) == 1:
                skill, blend = next(iter(live)), None
            else:
                blend = live
        old = self._components()
        new: list[Component] = list(blend.items()) if blend is not None else [(skill, 1.0)]
        touched = set().union(*(self.replaced(s) for s, _ in old + new))
        before, after = self._sources_for(old, touched), self._sources_for(new, touched)
        changed = {n for n in touched if before[n] != after[n]}
        self.skill, self.blend = (None, dict(blend)) if blend is not None else (skill, None)
        self._mixed = {n: s for n, s in after.items() if len(s) > 1}
        for n in changed:
            self._vectors.pop(n, None)
            self._linears.pop(n, None)
            self._dense.pop(n, None)
        if self._mixed:
            log.debug("blend %s: %d working tensors materialized in f32 on use", self.blend, len(self._mixed))
        return changed

    @property
    def blended_bytes(self) -> int:
        """Bytes of the f32 working tensors materialized so far for the active blend."""
        return sum(a.nbytes for a in self._dense.values())

    # -- access ---------------------------------------------------------------------------------
    def source_name(self, name: str) -> str:
        """``skill.{active}.{name}`` when the active skill replaces ``name``, else ``name`` (under a
        blend: the backbone name; the working tensor itself is :meth:`dense`)."""
        if self.skill:
            alt = self._index.get(self.skill, {}).get(name)
            if alt is not None:
                return alt
        return name

    def has(self, name: str) -> bool:
        return self.source_name(name) in self.file

    def shape(self, name: str) -> tuple[int, ...] | None:
        src = self.source_name(name)
        return self.file.tensor(src).shape if src in self.file else None

    def qtensor(self, name: str) -> QTensor:
        return self.file.tensor(self.source_name(name))

    def dense(self, name: str) -> np.ndarray:
        """The working tensor ``name`` as float32: Σ wᵢ·Tᵢ under a blend (materialized once), else decoded."""
        mix = self._mixed.get(name)
        if mix is None:
            return self.file.array(self.source_name(name))
        arr = self._dense.get(name)
        if arr is None:
            arr = np.zeros(self.file.tensor(name).shape, dtype=np.float32)
            for src, w in mix:
                arr += np.float32(w) * self.file.array(src)
            self._dense[name] = arr
        return arr

    def vector(self, name: str | None) -> np.ndarray | None:
        """A small tensor decoded to float32 once (norm weights, biases)."""
        if name is None:
            return None
        v = self._vectors.get(name)
        if v is None:
            v = np.ascontiguousarray(self.dense(name), dtype=np.float32)
            self._vectors[name] = v
        return v

    @contextlib.contextmanager
    def substituted(self, name: str, op) -> Iterator[None]:  # noqa: ANN001 - a LinearOp
        """Inside the block ``op`` is matrix ``name``'s LinearOp, lookups included (a measurement
        swapping one table for its quantized round trip); the stored one again after. Ops built
        meanwhile (a model's head) keep ``op``: rebuild them after the block."""
        kept = self._linears.get(name)
        self._linears[name] = op
        try:
            yield
        finally:
            if kept is None:
                self._linears.pop(name, None)
            else:
                self._linears[name] = kept

    def linear(self, name: str):
        """The LinearOp of a stored matrix (y = x @ W.T), prepared once."""
        op = self._linears.get(name)
        if op is None:
            if name in self._mixed:
                op = DenseLinear(self.dense(name))
            else:
                op = kernels.prepare(self.qtensor(name), reference=self.reference, int8_activations=self.int8)
            self._linears[name] = op
        return op

    def row(self, name: str, i: int) -> np.ndarray:
        """Row ``i`` of a matrix as [1, n] float32 (C-contiguous): :meth:`rows` of one id, with
        one bounds check when the matrix has a prepared LinearOp (the decode step's lookup)."""
        op = self._linears.get(name)
        if hasattr(op, "dequant_row"):
            return op.dequant_row(i)
        return np.ascontiguousarray(self.rows(name, np.array([i], np.int64)), dtype=np.float32)

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Decode only the rows ``ids`` of a matrix (embedding lookups)."""
        ids = np.asarray(ids, dtype=np.int64)
        # A decode step looks up one row: through the matrix's LinearOp (prepared once, shared
        # with a tied lm_head) the payload is not re-validated per token (~40 µs of Python for a
        # q4_tiled row through the codec).
        op = self._linears.get(name)
        if op is None and name not in self._mixed:
            t = self.qtensor(name)
            if t.dtype == 0:  # f32: a zero-copy gather
                return t.numpy().view("<f4").reshape(t.shape)[ids].astype(np.float32)
            if len(t.shape) == 2:
                op = self.linear(name)
        if hasattr(op, "dequant_rows"):
            return op.dequant_rows(ids.reshape(-1)).reshape(ids.shape + (op.in_features,))
        if name in self._mixed:
            return self.dense(name)[ids]
        t = self.qtensor(name)
        from .. import quant

        return quant.decode_rows(t.numpy(), t.dtype, t.shape, ids)
