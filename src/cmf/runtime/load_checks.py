"""Checks and options resolved while loading a model: verify on load (spec §1.2) and the
route-statistics expert restriction (spec §11.1). Split out of model.py to keep it short."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..format.errors import CmfError, HashMismatch
from ..format.reader import CmfFile
from .plan import ModelPlan

log = logging.getLogger(__name__)


def verify_or_refuse(file: CmfFile) -> None:
    """Raise :class:`HashMismatch` listing what ``file.verify()`` found (the first few problems)."""
    problems = file.verify()
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise HashMismatch(f"{file.path}: verify on load found {len(problems)} problem(s): {shown}; "
                           f"refusing to run it (the file is damaged or was modified)")
    log.info("%s: verified on load (%d tensors)", file.path, len(file))


DEFAULT_MOE_COVER = 0.95  # moe-defrag's default cover (REFERENCE_NOTES §2)


def moe_keep(spec, cover: float | None, plan: ModelPlan) -> dict[int, np.ndarray]:
    """Per MoE layer, the experts a route-statistics mask admits (spec §11.1)."""
    import json

    from .ops.moe import cover_mask
    from .plan import MoePlan

    if isinstance(spec, dict):
        data, where = spec, "moe mask"
    else:
        where = str(spec)
        try:
            data = json.loads(Path(spec).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CmfError(f"{where}: cannot read the expert mask statistics ({exc})") from None
    if not isinstance(data, dict):
        raise CmfError(f"{where}: expert statistics must be a JSON object {{layer: [count per expert]}}")
    cover = DEFAULT_MOE_COVER if cover is None else float(cover)
    if not 0.0 < cover <= 1.0:
        raise CmfError(f"moe mask cover {cover} is not in (0, 1]")
    keep: dict[int, np.ndarray] = {}
    for key, counts in data.items():
        try:
            i = int(key)
            arr = np.asarray(counts, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise CmfError(f"{where}: entry {key!r} is not layer -> [count per expert]") from None
        if not 0 <= i < len(plan.layers) or not isinstance(plan.layers[i].ffn, MoePlan):
            log.warning("%s: layer %s is not an MoE layer of this model; ignored", where, key)
            continue
        n = plan.layers[i].ffn.n_experts
        if arr.size != n or (arr < 0).any() or not np.isfinite(arr).all():
            raise CmfError(f"{where}: layer {i} has {arr.size} counts (must be {n} non-negative numbers)")
        keep[i] = cover_mask(arr, cover)
    return keep
