"""The row layout of multi-head latent attention (MLA) in a CMF file, and its inverse for export.

A CMF file stores every MLA query head rope-first, ``[rope | nope]`` (Hugging Face: ``[nope |
rope]``), with the rope dims in the order the runtime's half-split rotation (pairs ``i``,
``i + rope/2``) expects. A source that rotates interleaved pairs ``(2i, 2i+1)`` (DeepSeek's
``rope_interleave``) therefore has its rope rows stored even-first: ``0, 2, 4, …, 1, 3, 5, …``,
in the query heads and in the shared rope key, the last ``rope`` rows of
``kv_a_proj_with_mqa``. This is the reference converter's layout (infosave2007/cmf,
``crates/cortiq-cli/src/convert.rs``, ``run_convert``: the q_proj / q_b_proj head permutation
and the kv_a_proj_with_mqa tail fix); docs/INTERCHANGE.md lists the facts.

Files from earlier pycmf releases carry ``arch.mla.rope_interleave`` and keep the Hugging Face
row order; :func:`legacy_layout` tells them apart. Both are pure row permutations: the converter
reads the permuted rows straight from the checkpoint (:func:`cut`), the exporter scatters them
back (:func:`hf_rows`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .names import Cut

_Q = re.compile(r".+\.self_attn\.(q_proj|q_b_proj)\.(weight|bias)\Z")
_KV_A = re.compile(r".+\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)\Z")


def legacy_layout(mla: dict[str, Any] | None) -> bool:
    """Whether an ``arch.mla`` block declares the pre-interchange pycmf layout (HF row order)."""
    return isinstance(mla, dict) and "rope_interleave" in mla


@dataclass(frozen=True)
class MlaLayout:
    """What the permutation needs: head geometry and whether the rope rows go even-first."""

    rope: int
    nope: int
    kv_rank: int
    even_first: bool

    @classmethod
    def of(cls, mla: dict[str, Any], even_first: bool) -> "MlaLayout":
        return cls(int(mla["qk_rope_head_dim"]), int(mla["qk_nope_head_dim"]), int(mla["kv_lora_rank"]),
                   bool(even_first))

    def rope_order(self) -> np.ndarray:
        """The source index of each stored rope dim."""
        r = np.arange(self.rope)
        return np.concatenate([r[0::2], r[1::2]]) if self.even_first else r

    def rows(self, name: str, n_rows: int) -> np.ndarray | None:
        """For tensor ``name`` with ``n_rows`` rows: the Hugging Face row of each stored row, or
        None when the tensor is not permuted (or its rows do not fit the geometry; the runtime's
        shape checks then report it)."""
        if _Q.match(name):
            hd = self.rope + self.nope
            if n_rows % hd:
                return None
            head = np.concatenate([self.nope + self.rope_order(), np.arange(self.nope)])
            return (np.arange(n_rows // hd)[:, None] * hd + head[None, :]).reshape(-1)
        if _KV_A.match(name) and self.even_first:
            if n_rows != self.kv_rank + self.rope:
                return None
            return np.concatenate([np.arange(self.kv_rank), self.kv_rank + self.rope_order()])
        return None


def converter_layout(arch: dict[str, Any], source_config: dict[str, Any]) -> MlaLayout | None:
    """The layout the converter writes for an MLA model (None: no ``arch.mla``).

    Even-first follows the source's own rotation (``rope_interleave``, default true for
    DeepSeek-V3 as in transformers); NoPE models (``mla.nope``) are never rotated, so their rope
    rows keep their order and only move in front of the nope rows, as the reference does."""
    mla = arch.get("mla")
    if not isinstance(mla, dict):
        return None
    even = bool(source_config.get("rope_interleave", True)) and not mla.get("nope")
    return MlaLayout.of(mla, even)


def export_layout(arch: dict[str, Any], hf_config: dict[str, Any]) -> MlaLayout | None:
    """The permutation ``cmf export`` undoes (None: none, e.g. a legacy file in HF order).

    The stored rope rows are in half-split order; a config with ``rope_interleave`` true (the
    DeepSeek default) wants them interleaved again."""
    mla = arch.get("mla")
    if not isinstance(mla, dict) or legacy_layout(mla):
        return None
    even = bool(hf_config.get("rope_interleave", True)) and not mla.get("nope")
    return MlaLayout.of(mla, even)


def cut(layout: MlaLayout | None, name: str, shape: tuple[int, ...]) -> Cut | None:
    """The Cut that reads ``name``'s rows in stored order (consecutive rows merged), or None."""
    if layout is None or not shape:
        return None
    idx = layout.rows(name, int(shape[0]))
    if idx is None:
        return None
    ranges: list[tuple[int, int]] = []
    for i in idx.tolist():
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return Cut(rows=tuple(ranges))


def hf_rows(layout: MlaLayout | None, name: str, stored: np.ndarray) -> np.ndarray:
    """``stored`` (a CMF tensor) back in Hugging Face row order (itself when not permuted)."""
    if layout is None or stored.ndim == 0:
        return stored
    idx = layout.rows(name, stored.shape[0])
    if idx is None:
        return stored
    out = np.empty_like(stored)
    out[idx] = stored
    return out
