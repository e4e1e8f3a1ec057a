"""Encoding one matrix with its calibration statistics: same dtype, same layout, better choices.

Per dtype (``encode``):

- q4_block, q4_tiled, q4tp, q2tp: the ``mse`` encoder with the importance (mean x² per input
  feature) as error weights picks the scales; then GPTQ rounding (:mod:`.feedback`) re-chooses
  every level at those scales with error feedback over the Hessian. The feedback result is kept
  only when its output error ``tr(ΔW H ΔWᵀ)`` is lower (it nearly always is).
- q8_row: the reference scales (absmax/127), GPTQ rounding, the same guard.
- q1s / q1t: the importance's square root as ``act_rms`` (the overlay chosen by |W|·RMS(x), and
  q1t's importance-weighted scale fit); q1t keeps a 1% overlay unless told otherwise.
- vbit / vbit_ro: the reference's per-row widths (amplitude water-filling; weighting it by the
  importance measured worse), the ``mse`` scale search with the importance, then GPTQ rounding
  within each row's levels ``-L .. L+1``, with the same guard.
- Everything else (floats, q8_2f, q1): unchanged.

Without statistics for a matrix (the calibration never ran it), the plain encoder runs. A caller
may ask for GPTQ against a ridged Hessian (``ridge=``: tight target-size budgets); the FFN down
projections then take a larger one (:data:`DOWN_RIDGE`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from .. import quant
from ..format.constants import GROUP, Dtype
from ..quant.base import as_bytes_array
from ..quant.float import f16_bits_to_f32
from ..quant.q4 import pack_nibbles
from ..quant.vbit import DEFAULT_MEAN_BITS
from . import feedback
from .stats import InputStats

log = logging.getLogger(__name__)

_FEEDBACK = {Dtype.Q4_BLOCK: "q4", Dtype.Q4_TILED: "q4", Dtype.Q4TP: "q4", Dtype.Q2TP: "q2", Dtype.Q8_ROW: "q8",
             Dtype.VBIT: "int", Dtype.VBIT_RO: "int"}
_MSE = frozenset({Dtype.Q4_BLOCK, Dtype.Q4_TILED, Dtype.Q4TP, Dtype.Q2TP, Dtype.VBIT, Dtype.VBIT_RO})
_VBIT = (Dtype.VBIT, Dtype.VBIT_RO)
Q1T_CALIB_KEEP = 0.01
# The FFN down projections (dense and expert): their input, the gated product of the gate and up
# projections, is heavy-tailed and shifts between texts, and GPTQ on its bare Hessian fits the
# calibration text's activations so closely that on other text the result is worse than plain
# rounding. Where a caller rounds against a ridged Hessian (a tight target-size budget, stats.RIDGE)
# they take at least H + DOWN_RIDGE·mean(diag H)·I (a larger ridge asked for stands); without one
# (plain --calib, loose budgets) the bare Hessian measured better on SmolLM2. docs/QUANT.md,
# "The FFN down projections' ridge".
DOWN_PROJ = re.compile(r"(\A|\.)down_proj\.weight\Z")
DOWN_RIDGE = 1.0


def calibrated_dtypes() -> frozenset[Dtype]:
    """The dtypes whose encoding uses calibration statistics."""
    return frozenset(_FEEDBACK) | {Dtype.Q1S, Dtype.Q1T}


def role_ridge(stats: InputStats, dtype: Dtype, options: dict[str, Any]) -> float:
    """The least ridge the matrices fed by ``stats`` round with at ``dtype`` when a ridge is asked
    for: :data:`DOWN_RIDGE` for FFN down projections (told by the names of the matrices that
    share the input) at 4 bits and more, else 0. Below 4 bits (q2tp, vbit at a mean under 4) the
    feedback removes more error on other text than its fit to the calibration text costs."""
    if dtype == Dtype.Q2TP or (dtype in _VBIT and float(options.get("mean_bits", DEFAULT_MEAN_BITS)) < 4):
        return 0.0
    return DOWN_RIDGE if any(DOWN_PROJ.search(name) for name in stats.members) else 0.0


def encode(array: Any, dtype: Dtype | int | str, stats: InputStats | None, **options: Any) -> bytes:
    """``cmf.quant.encode`` of ``array`` as ``dtype`` using ``stats`` (None: plain encode)."""
    dt = quant.resolve_dtype(dtype)
    w = np.asarray(array, np.float32)
    ridge = float(options.pop("ridge", 0.0))  # GPTQ against H + ridge·mean(diag H)·I (stats.RIDGE)
    if stats is None or w.ndim != 2 or w.shape[1] != stats.cols or dt not in calibrated_dtypes():
        return quant.encode(w, dt, **options)
    if ridge:  # a caller that rounds against a ridged Hessian (a tight budget): the down projections' floor
        ridge = max(ridge, role_ridge(stats, dt, options))
    imp = stats.importance()
    if dt in (Dtype.Q1S, Dtype.Q1T):
        options.setdefault("act_rms", np.sqrt(imp))
        if dt == Dtype.Q1T:
            options.setdefault("keep", Q1T_CALIB_KEEP)
        return quant.encode(w, dt, **options)
    if dt in _MSE and options.get("encoder", "mse") == "mse":
        options["importance"] = _normalized(imp)
    plain = quant.encode(w, dt, **options)
    if stats.hessian is None or (dt == Dtype.Q4_BLOCK and w.shape[1] % GROUP):
        return plain
    hess, perm, u = _factor(stats, ridge)
    levels = None
    if u is not None:
        scales = element_scales(plain, dt, w.shape)
        levels = feedback.gptq_levels(w[:, perm], scales[:, perm], hess[np.ix_(perm, perm)], _FEEDBACK[dt],
                                      act_order=False, factor=u, bounds=_vbit_bounds(plain, dt, w.shape[0]))
    if levels is None:
        log.warning("calibration: the input Hessian of a %s matrix is degenerate; plain rounding kept", w.shape)
        return plain
    unperm = np.empty_like(levels)
    unperm[:, perm] = levels
    out = with_levels(plain, dt, w.shape, unperm)
    before = feedback.output_error(w, quant.decode(plain, dt, w.shape), hess)
    after = feedback.output_error(w, quant.decode(out, dt, w.shape), hess)
    return out if after < before else plain


def _factor(stats: InputStats, ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(Hessian with ``ridge`` (:meth:`InputStats.robust_hessian`), act order, inverse Cholesky
    factor of the permuted Hessian or None), computed once for all the matrices that share the
    input and dropped after the last of them."""
    with stats.lock:
        cache = stats.factor if stats.factor is not None else {}
        stats.factor = cache
        if ridge not in cache:
            hess = stats.robust_hessian(ridge)
            perm = feedback.order(hess)
            cache[ridge] = [(hess, perm, feedback.inverse_cholesky(hess[np.ix_(perm, perm)])), 0]
        entry = cache[ridge]
        entry[1] += 1
        if entry[1] >= len(stats.members):
            del cache[ridge]
    return entry[0]


def _vbit_bounds(data: bytes, dtype: Dtype, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """vbit's per-row level range ``-L .. L+1`` (``L = 2^(width-1) - 1``); None for other dtypes."""
    if dtype not in _VBIT:
        return None
    half = (1 << (as_bytes_array(data)[:rows].astype(np.int64) - 1)) - 1
    return -half.astype(np.float64), half.astype(np.float64) + 1


def _normalized(imp: np.ndarray) -> np.ndarray:
    """Importance scaled to mean 1 (only ratios matter; keeps the encoder's f32 sums in range)."""
    m = float(imp.mean())
    return (imp / m).astype(np.float32) if m > 0 else np.ones_like(imp)


def element_scales(data: bytes, dtype: Dtype, shape: tuple[int, int]) -> np.ndarray:
    """The scale of every element of a 2-D payload of a group dtype (rows × cols, f32)."""
    rows, cols = shape
    gpr = cols // GROUP
    buf = as_bytes_array(data)
    if dtype == Dtype.Q8_ROW:
        s = f16_bits_to_f32(buf[rows * cols:].view("<u2"))
        return np.repeat(s[:, None], cols, axis=1)
    if dtype in _VBIT:  # [u8 widths: rows][f16 scales: rows·gpr]...
        s = f16_bits_to_f32(buf[rows:rows + 2 * rows * gpr].copy().view("<u2")).reshape(rows, gpr)
    elif dtype == Dtype.Q4_BLOCK:
        s = f16_bits_to_f32(buf[16 * rows * gpr:].view("<u2")).reshape(rows, gpr)
    elif dtype == Dtype.Q4_TILED:
        s = f16_bits_to_f32(buf.reshape(-1, 18)[:, :2].copy().view("<u2").reshape(-1)).reshape(rows, gpr)
    else:
        codec = quant.get_codec(dtype)
        _, params, codes = codec.split(buf, shape)
        s = codec.scales(params, codes, gpr)
    return np.repeat(np.asarray(s, np.float32), GROUP, axis=1)


def with_levels(data: bytes, dtype: Dtype, shape: tuple[int, int], levels: np.ndarray) -> bytes:
    """``data`` with its weight plane replaced by ``levels`` (level values at the same scales).

    Groups whose scale is 0 keep their bytes (a q2tp zero rung must stay canonical)."""
    rows, cols = shape
    gpr = cols // GROUP
    buf = as_bytes_array(data).copy()
    if dtype == Dtype.Q8_ROW:
        buf[:rows * cols] = levels.astype(np.int8).reshape(-1).view(np.uint8)
        return buf.tobytes()
    if dtype in _VBIT:
        widths = buf[:rows].copy()
        lo, _ = _vbit_bounds(data, dtype, rows)
        scales = element_scales(data, dtype, shape)[:, ::GROUP]
        codes = (np.asarray(levels, np.float64) - lo[:, None]).astype(np.int64)
        return quant.get_codec(dtype).assemble(widths, scales, codes)
    zero = element_scales(data, dtype, shape).reshape(rows, gpr, GROUP)[..., 0] == 0
    if dtype == Dtype.Q2TP:
        crumbs = (levels + 1.5).astype(np.uint8).reshape(rows, gpr, 8, 4)
        plane = crumbs[..., 0] | (crumbs[..., 1] << 2) | (crumbs[..., 2] << 4) | (crumbs[..., 3] << 6)
        old = buf[:rows * gpr * 8].reshape(rows, gpr, 8)
        old[~zero] = plane[~zero]
        return buf.tobytes()
    nib = pack_nibbles((levels + 8).astype(np.uint8).reshape(rows, gpr, GROUP))
    if dtype == Dtype.Q4_TILED:
        old = buf.reshape(rows, gpr, 18)[..., 2:]
    else:  # q4_block and q4tp: the nibble plane comes first
        old = buf[:rows * gpr * 16].reshape(rows, gpr, 16)
    old[~zero] = nib[~zero]
    return buf.tobytes()

