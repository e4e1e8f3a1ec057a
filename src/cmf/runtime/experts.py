"""MoE routing statistics and expert restriction: the Model's methods over its MoE layers (a
mixin of runtime.model.Model, which holds the blocks: ``_blocks``, ``_moe_keep``).

Statistics (``collect_route_stats`` / ``route_stats``) are the JSON that ``cmf convert
--route-stats`` and ``moe-defrag`` read (spec §11.1). The admitted experts of a layer are the
runtime mask (``moe_mask``, CMF_MOE_MASK) ∧ the active task mask's row.
"""

from __future__ import annotations

import numpy as np

from ..format.errors import CmfError
from .blocks import MoeFfn


def keep_counts(old, new) -> None:  # noqa: ANN001 - runtime.blocks.Block
    """Carry a rebuilt layer's routing statistics over from the block it replaces (they survive a
    skill switch)."""
    if isinstance(new.ffn, MoeFfn) and isinstance(old.ffn, MoeFfn):
        new.ffn.counts = old.ffn.counts


class MoeStats:
    """Mixin: routing statistics and expert masks of the MoE layers."""

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i, b in enumerate(self._blocks) if isinstance(b.ffn, MoeFfn)]

    def collect_route_stats(self, on: bool = True) -> None:
        """Count, per MoE layer, how often each expert is selected (see :meth:`route_stats`)."""
        for b in self._blocks:
            if isinstance(b.ffn, MoeFfn):
                b.ffn.counts = (b.ffn.counts if b.ffn.counts is not None else
                                np.zeros(b.ffn.m.n_experts, np.int64)) if on else None

    def route_stats(self) -> dict[str, list[int]]:
        """{layer: [selections per expert]} since :meth:`collect_route_stats` (the JSON that
        ``cmf convert --route-stats`` and ``moe-defrag`` read, spec §11.1)."""
        return {str(i): b.ffn.counts.tolist() for i, b in enumerate(self._blocks)
                if isinstance(b.ffn, MoeFfn) and b.ffn.counts is not None}

    def reset_route_stats(self) -> None:
        for b in self._blocks:
            if isinstance(b.ffn, MoeFfn) and b.ffn.counts is not None:
                b.ffn.counts[:] = 0

    def _restrict_experts(self, mask) -> None:  # noqa: ANN001 - a format.masks.TaskMask or None
        """The admitted experts per MoE layer: the runtime mask ∧ ``mask``'s expert row."""
        for i, b in enumerate(self._blocks):
            if not isinstance(b.ffn, MoeFfn):
                continue
            n = b.ffn.m.n_experts
            allowed = self._moe_keep.get(i)
            if mask is not None and mask.experts is not None and i < mask.experts.shape[0]:
                row = np.asarray(mask.experts[i][:n], dtype=bool)
                if row.size == n and row.any():  # an empty row means "unrestricted"
                    allowed = row if allowed is None else (allowed & row)
            if allowed is not None and not allowed.any():
                raise CmfError(f"layer {i}: the expert masks admit no expert")
            b.ffn.allowed = None if allowed is None or allowed.all() else allowed
