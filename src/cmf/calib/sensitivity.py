"""Measured sensitivity of the model's output to each matrix's quantization error.

The target-size knapsack (:mod:`cmf.convert.budget`) predicts a candidate's damage from its
relative output error ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)``. Summed over matrices, that treats an error in
a layer-0 value projection like the same relative error in a mid-network query projection, which
it is not: the budget then spends bytes where they change the output least (on SmolLM2-135M the
summed proxy disagreed with perplexity by up to 0.3%, docs/QUANT.md "Target size").

:func:`measure` asks the model instead. For each matrix it replaces W by its plain round trip
through a probe dtype (q4tp: the error of the rungs the budget chooses between), runs a sample of
the calibration text, and takes the mean KL divergence of the next-token distributions from the
unperturbed model's. KL is second order in a small ΔW, as the relative error is, so their ratio
— the *sensitivity* — is the matrix's KL per unit of relative error; the budget multiplies every
candidate's relative error by it. Each probe reruns the sample from the matrix's own layer on:
210 probes of 128 tokens for SmolLM2-135M's 30 layers, 224 s on 2 shared cores. On that model the
sensitivities spread over more than 30× (an o_proj of layer 26 at 0.04, a k_proj of layer 4 at
1.2), and the budget that weighs by them wrote a 104.8 MB file at PPL 19.141 instead of 19.419
(docs/QUANT.md, "Target size").
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

PROBE_DTYPE = "q4tp"
DEFAULT_SAMPLE_TOKENS = 128
# The token table's rungs (label, dtype, encoder options), cheapest first. At 8 bits (a lookup
# table is wrong at 4) as q8_row (one scale per row) or vbit at a mean of 8 bits (an f16 scale per
# 32, ~0.47 bits more; rows far below the mean amplitude take 6): on SmolLM2-135M, every other
# tensor f32, q8_row PPL 18.444, vbit 8 18.400, f32 18.398 (its rows carry outliers). vbit at 5 and
# 6 bits: on a small model the table is a fifth of the file (shared Qwen3: 0.52 MB of 2.4), and
# llama.cpp's mixes keep it at 6 bits (Q6_K); measured by their KL like the others, they let a
# tight budget spend on the matrices (docs/QUANT.md). convert.budget offers each by its KL.
TABLE_RUNGS = (("vbit5", "vbit", (("mean_bits", 5.0),)), ("vbit6", "vbit", (("mean_bits", 6.0),)),
               ("q8_row", "q8_row", ()), ("vbit8", "vbit", (("mean_bits", 8.0),)))
_FLOOR = 1e-12  # relative errors below this (an all-zero matrix) have no measurable sensitivity


def relative_loss(w: np.ndarray, got: np.ndarray, hessian: np.ndarray | None) -> float:
    """tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) (H = I when None)."""
    w = np.asarray(w, np.float64)
    d = w - np.asarray(got, np.float64)
    if hessian is None:
        den = float((w * w).sum())
        return float((d * d).sum()) / den if den > 0 else 0.0
    den = float(((w @ hessian) * w).sum())
    return float(((d @ hessian) * d).sum()) / den if den > 0 else 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def mean_kl(base_logp: list[np.ndarray], logits: list[np.ndarray]) -> float:
    """Mean over positions of KL(base ‖ other), both as lists of [T, vocab] arrays."""
    total, n = 0.0, 0
    for lp, lg in zip(base_logp, logits):
        lq = _log_softmax(lg)
        total += float((np.exp(lp) * (lp - lq)).sum())
        n += lp.shape[0]
    return total / max(n, 1)


def sample(windows: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """The first ``tokens`` tokens of the calibration windows, window by window."""
    out, left = [], tokens
    for w in windows:
        if left <= 0:
            break
        out.append(list(w[:left]))
        left -= len(out[-1])
    return out


def probe_round_trip(w: np.ndarray, probe: str = PROBE_DTYPE) -> np.ndarray:
    """``w`` through the probe dtype's plain encoder and back: the perturbation a sensitivity is
    measured with (convert.budget rescales by its error under another Hessian)."""
    from .. import quant

    return quant.decode(quant.encode(w, probe), probe, w.shape)


def measure(model, windows: Sequence[Sequence[int]], names: Sequence[str], hessian: Callable[[str], np.ndarray | None],
            *, tokens: int = DEFAULT_SAMPLE_TOKENS, probe: str = PROBE_DTYPE,
            progress: Callable[[int], None] | None = None) -> dict[str, float]:  # noqa: ANN001 - a runtime Model
    """{matrix name: KL per unit relative output error} for ``names`` of the loaded ``model``
    (see the module docstring). ``hessian(name)`` gives the matrix's mean input Hessian (None:
    H = I), the same the budget's candidates are scored with. Each probe reruns the sample from
    the matrix's layer on (the inputs of the layers before it are kept from the unperturbed run).
    ``progress(1)`` per matrix. A name no layer uses is left out."""
    from .. import quant
    from ..runtime.weights import DenseLinear

    ids = sample(windows, tokens)
    w = model.weights
    plain = w.linear
    model._prepare()  # the blocks as the weights give them (not a caller's recording ops)
    layer_of: dict[str, int] = {}
    for i in range(len(model.plan.layers)):
        for n in model.rebuild_layer(i):
            layer_of.setdefault(n, i)
    inputs = [model.layer_inputs(x) for x in ids]
    base = [_log_softmax(model.logits_from(0, xs[0])) for xs in inputs]
    out: dict[str, float] = {}
    try:
        for name in names:
            layer = layer_of.get(name)
            if layer is None:
                continue
            dense = plain(name).dense()
            probed = probe_round_trip(dense, probe)
            rel = relative_loss(dense, probed, hessian(name))
            swapped = DenseLinear(probed)
            w.linear = lambda n, _name=name, _op=swapped: _op if n == _name else plain(n)
            try:
                model.rebuild_layer(layer)
            finally:
                del w.linear
            kl = mean_kl(base, [model.logits_from(layer, xs[layer]) for xs in inputs])
            model.rebuild_layer(layer)
            out[name] = kl / rel if rel > _FLOOR else 0.0
            log.debug("sensitivity %s: KL %.3g at relative error %.3g", name, kl, rel)
            if progress is not None:
                progress(1)
    finally:
        if "linear" in vars(w):
            del w.linear
        model._prepare()
    log.info("sensitivity: %d matrices probed with %s on %d tokens", len(out), probe, sum(map(len, ids)))
    return out


def table_names(model) -> list[str]:  # noqa: ANN001 - a runtime Model
    """The token table and, when it is a matrix of its own, the output head."""
    plan = model.plan
    return [n for n in dict.fromkeys((plan.embed, plan.lm_head)) if n]


def measure_table(model, windows: Sequence[Sequence[int]], *, tokens: int = DEFAULT_SAMPLE_TOKENS,
                  progress: Callable[[int], None] | None = None) -> dict[str, dict[str, float]]:  # noqa: ANN001
    """{table name: {rung label: KL}} for each of :data:`TABLE_RUNGS`: the mean KL divergence of
    the next-token distributions over a sample of the text when that table alone is stored as
    the rung (looked up and, tied, the head: the whole model reruns). Unlike a matrix's
    sensitivity this is the rung's own KL, not a ratio: the budget takes it as the loss as it
    is. ``progress(1)`` per table."""
    from .. import quant
    from ..runtime.weights import DenseLinear

    ids = sample(windows, tokens)
    w = model.weights
    base = [_log_softmax(model.logits(x)) for x in ids]
    out: dict[str, dict[str, float]] = {}
    for name in table_names(model):
        dense = w.linear(name).dense()
        if dense.ndim != 2 or dense.shape[1] % 32:
            continue
        losses: dict[str, float] = {}
        try:
            for label, dtype, options in TABLE_RUNGS:
                probed = quant.decode(quant.encode(dense, dtype, **dict(options)), dtype, dense.shape)
                with w.substituted(name, DenseLinear(probed)):
                    model._prepare()  # the head is the table when tied
                    losses[label] = mean_kl(base, [model.logits(x) for x in ids])
        finally:
            model._prepare()
        out[name] = losses
        log.info("token table %s: KL %s", name, {k: f"{v:.3g}" for k, v in losses.items()})
        if progress is not None:
            progress(1)
    return out
