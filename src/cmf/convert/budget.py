"""Target-size quantization (``--target-mb N`` / ``--bpw B``): per-matrix dtypes that fit a budget.

Every matrix the quant's policy puts on a ladder dtype (q2tp, q4tp, the 4-bit family, vbit…) may
instead take any rung of :data:`LADDER` — ``q2tp`` (2.2 bits), ``vbit`` at a mean of 3 bits (3.5),
``q4tp`` (4.2), ``vbit`` at a mean of 5 and 6 bits (5.5 and 6.5 with its row widths and scales),
``q8_row`` (8.1). Each
candidate is encoded once to measure its predicted loss: the relative output error
``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` under the matrix's calibration Hessian H (or H = I, the relative
weight error, without ``--calib``). Starting from the cheapest candidate everywhere, the upgrade
with the most loss removed per byte is taken while the file still fits (greedy knapsack); what
the policy fixes (norms, precision-critical tensors; the token table unless the calibration
measured its rungs, then an item of its own scored by their KL) is counted first. A tight
budget (its floor at q4tp or lower) re-encodes the ladder against a ridged Hessian (the FFN down
projections a larger ridge: ``calib.encoding.DOWN_RIDGE``), may take the
table below 8 bits and has no floor (:func:`_tight`). The choices are ordinary dtypes: every
reader decodes the file.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..calib import stats as calib_stats
from ..calib.sensitivity import TABLE_RUNGS, relative_loss
from .budget_padding import use_padding_slack, worst_padding
from .errors import ConvertError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Rung:
    """One step of the ladder: a dtype and the encoder options that set its size."""

    label: str
    dtype: str
    options: tuple[tuple[str, Any], ...] = ()


# The vbit rungs fill the gap between 4 and 8 bits: on SmolLM2-135M (14 matrices of layers 5
# and 20, relative weight error) q4tp 7.6e-3 at 4.22 bits, vbit 5 2.1e-3 at 5.52, vbit 6 5.5e-4
# at 6.45, q8_row 7.4e-5 at 8.03 — the step to vbit 5 removes 4.2e-3 per added bit, the jump to
# q8_row 2.0e-3 (docs/QUANT.md, "Target size"). vbit 3 (~3.5 bits) is the step between q2tp, which
# a dense model does not survive, and q4tp: on the shared model at llama.cpp Q3_K_M's size it took
# PPL from 24.03 to 23.55 (docs/QUANT.md, "A 3-bit rung, a 6-bit table, and a robust Hessian").
LADDER = (Rung("q2tp", "q2tp"), Rung("vbit3", "vbit", (("mean_bits", 3.0),)), Rung("q4tp", "q4tp"),
          Rung("vbit5", "vbit", (("mean_bits", 5.0),)), Rung("vbit6", "vbit", (("mean_bits", 6.0),)),
          Rung("q8_row", "q8_row"))
# The token table's own rungs (vbit 5 and 6, q8_row, vbit 8): a budget may move it between them when
# the calibration measured each one's KL (calib.sensitivity.measure_table), which is its loss.
TABLE_LADDER = tuple(Rung(label, dtype, options) for label, dtype, options in TABLE_RUNGS)
# the table's rungs offered only to a tight budget (see _tight)
TABLE_TIGHT_ONLY = frozenset(label for label, dtype, options in TABLE_RUNGS if dict(options).get("mean_bits", 8) < 8)
# No matrix of a budget that is not tight (_tight) goes below its uniform level (the highest rung all of them could take at once):
# the predicted loss of a rung two steps down comes from in-sample output error and was too
# optimistic on other text (SmolLM2 with --calib: 112.1 MB 18.668 with the floor against 18.693
# without, 105.5 MB 18.825 against 18.960; docs/QUANT.md "Target size").
FLOOR = True
# policy dtypes a budget may move along the ladder (the others stay as the policy says)
MOVABLE = frozenset({"q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro", "q8_row"})


@dataclass
class Candidate:
    dtype: str
    nbytes: int
    loss: float
    options: dict[str, Any] = field(default_factory=dict)  # the encoder options of its rung
    label: str = ""  # the rung's name ("" = the dtype)

    @property
    def name(self) -> str:
        return self.label or self.dtype


@dataclass
class BudgetPlan:
    """The rung per movable matrix and what the budget cost (``choice``: the rung's name;
    ``picked``: the candidate itself — dtype, encoder options, exact payload size)."""

    target_bytes: int
    fixed_bytes: int
    picked: dict[str, Candidate] = field(default_factory=dict)
    bytes: int = 0
    loss: float = 0.0

    @property
    def choice(self) -> dict[str, str]:
        return {n: c.name for n, c in self.picked.items()}

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for d in self.choice.values():
            counts[d] = counts.get(d, 0) + 1
        return {"target_bytes": self.target_bytes, "bytes": self.bytes, "fixed_bytes": self.fixed_bytes,
                "matrices": counts, "predicted_loss": round(self.loss, 6)}


def movable(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """Whether a budget may move this matrix along the ladder: a policy ladder dtype, whole groups
    of 32 inputs, not the token table / output head, not an expert-id table."""
    from .policy import TOKEN_TABLE

    return (len(shape) == 2 and dtype in MOVABLE and shape[1] % 32 == 0 and not TOKEN_TABLE.search(name)
            and not name.endswith(".tid2eid"))


def table_item(name: str, shape: tuple[int, ...], dtype: str, calibration) -> bool:  # noqa: ANN001
    """Whether a budget may move the token table / output head ``name`` between the
    :data:`TABLE_LADDER` rungs: the policy stores it q8_row, its rows are whole 32-groups, and the
    calibration measured its rungs' KL."""
    from .policy import TOKEN_TABLE

    losses = getattr(calibration, "table_loss", None) or {}
    return (len(shape) == 2 and dtype == "q8_row" and shape[1] % 32 == 0 and TOKEN_TABLE.search(name) is not None
            and all(r.label in losses.get(name, {}) for r in TABLE_LADDER))


def table_candidates(w: np.ndarray, losses: dict[str, float]) -> list[Candidate]:
    """The token table's rungs, each with its payload size and its measured KL as the loss."""
    from .. import quant

    cands = sorted((Candidate(r.dtype, len(quant.encode(w, r.dtype, **dict(r.options))), float(losses[r.label]),
                              dict(r.options), r.label) for r in TABLE_LADDER), key=lambda c: c.nbytes)
    # vbit's widths follow the rows' amplitudes: it can come out smaller than q8_row; a rung no
    # smaller and no better than the one before it is dropped (the knapsack climbs in size)
    out = [cands[0]]
    for c in cands[1:]:
        if c.loss < out[-1].loss and c.nbytes > out[-1].nbytes:
            out.append(c)
    return out


def target_bytes(target_mb: float | None, bpw: float | None, total_weights: int) -> int:
    """The budget in bytes from ``--target-mb`` (10^6 bytes) or ``--bpw`` (bits per weight)."""
    if (target_mb is None) == (bpw is None):
        raise ConvertError("give one of --target-mb and --bpw")
    if target_mb is not None:
        if not target_mb > 0:
            raise ConvertError(f"--target-mb {target_mb} must be positive")
        return int(target_mb * 1e6)
    if not 1.0 <= bpw <= 32.0:  # type: ignore[operator]
        raise ConvertError(f"--bpw {bpw} is outside 1..32")
    return int(bpw * total_weights / 8)  # type: ignore[operator]


def candidates(w: np.ndarray, stats, options: dict[str, Any],  # noqa: ANN001
               sensitivity: float | None = None, ridge: float = 0.0) -> list[Candidate]:
    """Each ladder rung's payload size and predicted loss for one matrix (its encoder options:
    the rung's own, and the policy's ``encoder`` choice for the tile formats). ``sensitivity``:
    the matrix's measured KL per unit relative error (:mod:`cmf.calib.sensitivity`), which
    scales every rung's loss; None leaves the relative error as it is. ``ridge``: the calibrated
    encoders round and the losses are scored against H + ridge·mean(diag H)·I (the sensitivity
    rescaled by how the plain probe's error changes with it), and the candidates carry it as an
    encoder option so the file is written with the same bytes."""
    from .. import calib, quant
    from ..calib.sensitivity import probe_round_trip

    bare = stats.mean_hessian() if stats is not None else None
    ridge = ridge if bare is not None else 0.0
    hess = calib_stats.with_ridge(bare, ridge) if bare is not None else None
    if ridge and sensitivity is not None:
        probe = probe_round_trip(w)
        ridged = relative_loss(w, probe, hess)
        sensitivity *= relative_loss(w, probe, bare) / ridged if ridged > 0 else 1.0
    out = []
    for rung in LADDER:
        kept = dict(rung.options, **({"ridge": ridge} if ridge else {}))  # what the file is written with
        opts = dict(kept)
        if rung.dtype in ("q2tp", "q4tp", "q8_row") and "encoder" in options:
            opts["encoder"] = options["encoder"]
        data = calib.encode(w, rung.dtype, stats, **opts)
        loss = relative_loss(w, quant.decode(data, rung.dtype, w.shape), hess)
        if sensitivity is not None:
            loss *= sensitivity
        out.append(Candidate(rung.dtype, len(data), loss, kept, rung.label))
    return out


def _ladder_rungs(cs: list[Candidate]) -> list[int] | None:
    """Each candidate's index in :data:`LADDER`, or None for an item off the ladder (the token table)."""
    index = {r.label: k for k, r in enumerate(LADDER)}
    ks = [index.get(c.name) for c in cs]
    return None if None in ks else ks


def ladder_floor(cands: dict[str, list[Candidate]], fixed_bytes: int, budget: int) -> int:
    """The index in :data:`LADDER` of the highest rung that every ladder matrix could take at once
    within the budget — each at its cheapest candidate on that rung or above; items off the ladder
    (the token table) at their cheapest: the budget's uniform level."""
    rungs = {n: _ladder_rungs(cs) for n, cs in cands.items()}
    floor = 0
    for k in range(len(LADDER)):
        total = fixed_bytes
        for n, cs in cands.items():
            if rungs[n] is None:
                total += cs[0].nbytes
                continue
            up = [c.nbytes for c, r in zip(cs, rungs[n]) if r >= k]
            if not up:
                return floor
            total += min(up)
        if total > budget:
            break
        floor = k
    return floor


def above_floor(cands: dict[str, list[Candidate]], floor: int) -> dict[str, list[Candidate]]:
    """Each ladder matrix's candidates without the rungs below ``floor`` (other items as they are)."""
    out = {}
    for n, cs in cands.items():
        rungs = _ladder_rungs(cs)
        out[n] = cs if rungs is None else ([c for c, r in zip(cs, rungs) if r >= floor] or cs)
    return out


def allocate(cands: dict[str, list[Candidate]], fixed_bytes: int, budget: int) -> BudgetPlan:
    """Greedy: the cheapest candidate everywhere, then the best loss-per-byte upgrades that fit;
    then exchanges (:func:`_exchange`) while one lowers the total loss, each followed by the
    greedy again for the bytes it left."""
    plan = BudgetPlan(budget, fixed_bytes)
    at = {n: 0 for n in cands}
    used = fixed_bytes + sum(c[0].nbytes for c in cands.values())
    if used > budget:
        raise ConvertError(f"a target of {budget / 1e6:.1f} MB is below the smallest file this model can be "
                           f"with {LADDER[0].label} everywhere it is allowed: {used / 1e6:.1f} MB")
    used = _greedy(cands, at, used, budget)
    # each exchange lowers the loss by at least a millionth of the total (there are finitely many
    # states, but the bound keeps a plan of thousands of matrices from crawling)
    for _ in range(4 * len(cands)):
        moved = _exchange(cands, at, used, budget)
        if moved is None:
            break
        used = _greedy(cands, at, moved, budget)
    plan.picked = {n: cands[n][i] for n, i in at.items()}
    plan.bytes = used
    plan.loss = float(sum(cands[n][i].loss for n, i in at.items()))
    return plan


def _greedy(cands: dict[str, list[Candidate]], at: dict[str, int], used: int, budget: int) -> int:
    """Take the upgrade with the most loss removed per byte while the file fits (``at`` is moved in
    place); the bytes then used."""
    heap: list[tuple[float, str, int]] = []

    def push(name: str) -> None:
        i = at[name]
        c = cands[name]
        # the next step up the ladder, or a jump two rungs when that removes more loss per byte
        best = None
        for j in range(i + 1, len(c)):
            extra = c[j].nbytes - c[i].nbytes
            gain = c[i].loss - c[j].loss
            if extra > 0 and gain > 0 and (best is None or gain / extra > best[0]):
                best = (gain / extra, j)
        if best is not None:
            heapq.heappush(heap, (-best[0], name, best[1]))

    for n in cands:
        push(n)
    while heap:
        _, name, j = heapq.heappop(heap)
        i = at[name]
        extra = cands[name][j].nbytes - cands[name][i].nbytes
        if used + extra > budget:
            if j > i + 1 and cands[name][i + 1].nbytes - cands[name][i].nbytes + used <= budget \
                    and cands[name][i + 1].loss < cands[name][i].loss:
                c0, c1 = cands[name][i], cands[name][i + 1]
                heapq.heappush(heap, (-(c0.loss - c1.loss) / max(c1.nbytes - c0.nbytes, 1), name, i + 1))
            continue  # this one does not fit; smaller upgrades still may
        used += extra
        at[name] = j
        push(name)
    return used


def _exchange(cands: dict[str, list[Candidate]], at: dict[str, int], used: int, budget: int) -> int | None:
    """The best single exchange: one matrix up to any higher rung, paid for by one-rung steps down
    of others (cheapest loss per freed byte first), when the loss it removes exceeds the loss the
    steps down add. The greedy misses these: a large upgrade with the best ratio that did not fit
    when the greedy reached it, after which smaller, worse ones took the bytes. Applies it to
    ``at`` and returns the bytes then used, or None when no exchange lowers the loss."""
    total = sum(cands[n][i].loss for n, i in at.items())
    downs = sorted(((cands[m][i - 1].loss - cands[m][i].loss) / max(cands[m][i].nbytes - cands[m][i - 1].nbytes, 1),
                    m) for m, i in at.items() if i > 0 and cands[m][i].nbytes > cands[m][i - 1].nbytes)
    slack = budget - used
    best: tuple[float, str, int, list[str], int] | None = None
    for n, i in at.items():
        c = cands[n]
        for j in range(i + 1, len(c)):
            gain = c[i].loss - c[j].loss
            extra = c[j].nbytes - c[i].nbytes
            if gain <= 0 or extra <= 0:
                continue
            freed, cost, steps = 0, 0.0, []
            for _, m in downs:
                if freed >= extra - slack or cost >= gain:
                    break
                if m == n:
                    continue
                k = at[m]
                freed += cands[m][k].nbytes - cands[m][k - 1].nbytes
                cost += cands[m][k - 1].loss - cands[m][k].loss
                steps.append(m)
            net = gain - cost
            if freed >= extra - slack and net > 1e-6 * total and (best is None or net > best[0]):
                best = (net, n, j, steps, extra - freed)
    if best is None:
        return None
    _, n, j, steps, delta = best
    at[n] = j
    for m in steps:
        at[m] -= 1
    return used + delta


def sensitivity_lookup(calibration) -> Callable[[str], float | None]:  # noqa: ANN001 - a calib.Calibration
    """``lookup(name)``: the measured sensitivity of matrix ``name`` when the calibration has
    measured any (None otherwise). A matrix the measurement did not reach (one no layer takes
    through ``Weights.linear``, such as routed experts) gets the median of the others, so that
    every loss of one knapsack is on the same scale; the median is taken once."""
    table = getattr(calibration, "sensitivity", None)
    if not table:
        return lambda name: None
    median = float(np.median(list(table.values())))
    return lambda name: table.get(name, median)


def plan_budget(items: list[tuple[str, Callable[[], np.ndarray], dict[str, Any]]], fixed_bytes: int,
                budget: int, calibration=None, progress: Callable[[int], None] | None = None,  # noqa: ANN001
                cache: dict[str, list[Candidate]] | None = None,
                layout: list[tuple[str, int | None]] | None = None, reserved: int = 0) -> BudgetPlan:
    """Dtypes for the movable matrices ``items`` (name, loader of its f32 values, encoder options).

    ``cache``: candidates by name, filled on the first call and reused after (several budgets of
    one model and calibration measure each candidate once). ``layout``: every payload of the file
    in write order (name, size; None for a movable matrix) and ``reserved``: the alignment padding
    the caller set aside beyond ``budget`` (:func:`worst_padding`). With both, the plan is
    redone while the exact padding of its layout leaves room (:func:`.budget_padding.use_padding_slack`)."""
    cands = _measure(items, calibration, progress, cache, 0.0)
    ridge = calib_stats.RIDGE
    if calibration is not None and ridge and _tight(cands, fixed_bytes, budget):
        log.info("budget: tight (floor at q4tp or lower): the ladder re-encoded with the ridged Hessian")
        cands = _measure(items, calibration, None, cache, ridge)
    plan = _plan(cands, fixed_bytes, budget)
    if layout is not None and reserved > 0:
        plan = use_padding_slack(plan, layout, budget + reserved, lambda b: _plan(cands, fixed_bytes, b))
    log.info("budget: %s", plan.summary())
    return plan


def _measure(items: list[tuple[str, Callable[[], np.ndarray], dict[str, Any]]], calibration,  # noqa: ANN001
             progress: Callable[[int], None] | None, cache: dict | None, ridge: float) -> dict[str, list[Candidate]]:
    """Every item's candidates (the token table's by their measured KL), encoded with ``ridge``."""
    cands: dict[str, list[Candidate]] = {}
    sensitivity_of = sensitivity_lookup(calibration)
    tables = getattr(calibration, "table_loss", None) or {}
    for name, load, opts in items:
        key = name if not ridge else f"{name}|ridge={ridge}"
        if cache is not None and key in cache:
            cands[name] = cache[key]
            continue
        w = load()
        if name in tables:  # the token table: its own rungs, scored by their measured KL
            cands[name] = table_candidates(w, tables[name])
        else:
            stats = calibration.get(name) if calibration is not None else None
            cands[name] = candidates(w, stats, opts, sensitivity_of(name), ridge)
        if cache is not None:
            cache[key] = cands[name]
        if progress is not None:
            progress(1)
    return cands


def _plan(cands: dict[str, list[Candidate]], fixed_bytes: int, budget: int) -> BudgetPlan:
    """A tight budget (:func:`_tight`) plans over every candidate; a loose one keeps the token
    table at 8 bits and no matrix below the floor (:data:`FLOOR`)."""
    eight = _table_at_8_bits(cands)
    floor = ladder_floor(eight, fixed_bytes, budget)
    if floor > _rung("q4tp"):  # loose (see _tight)
        cands = above_floor(eight, floor) if FLOOR else eight
    return allocate(cands, fixed_bytes, budget)


def _tight(cands: dict[str, list[Candidate]], fixed_bytes: int, budget: int) -> bool:
    """Whether the budget's floor, with the token table at 8 bits, is q4tp or lower: most matrices
    at 4 bits or below. There the table's vbit 5/6 rungs, the ridged Hessian (``stats.RIDGE``) and
    no floor measured better; above it, worse: the matrices' predicted gains (a q4tp probe's KL
    scaled to errors 4-15x smaller) overstate what bytes buy — SmolLM2 at 112.1 MB took the table
    to vbit 6 for matrix upgrades, 18.862 against 18.646 with it at q8_row — and in-sample scores
    of the low rungs are too optimistic without the ridge (docs/QUANT.md)."""
    return ladder_floor(_table_at_8_bits(cands), fixed_bytes, budget) <= _rung("q4tp")


def _rung(label: str) -> int:
    """The index of rung ``label`` in :data:`LADDER`."""
    return next(k for k, r in enumerate(LADDER) if r.label == label)


def _table_at_8_bits(cands: dict[str, list[Candidate]]) -> dict[str, list[Candidate]]:
    """The candidates without the token table's rungs below 8 bits (:data:`TABLE_TIGHT_ONLY`)."""
    return {n: [c for c in cs if c.name not in TABLE_TIGHT_ONLY] or cs if _ladder_rungs(cs) is None else cs
            for n, cs in cands.items()}


def file_budget(f, policy, selected: Callable[[str], bool], budget: int, calibration=None,  # noqa: ANN001
                progress: Callable[[int], None] | None = None,
                cache: dict[str, list[Candidate]] | None = None, reserved: int = 0) -> tuple[BudgetPlan, dict[str, Any]]:
    """Plan the dtypes of an open CMF file's matrices under ``budget`` bytes of tensor payloads
    (``reserved``: the padding set aside beyond it, spent when the exact layout leaves room).

    Returns the plan and {name: Choice} for the movable matrices (``requant`` writes the rest as
    ``policy`` says). A movable matrix is one the policy gives a ladder dtype (not the token
    table, not a precision-critical one) with whole groups of 32 inputs."""
    from .. import quant as _quant
    from .policy import Choice, stored_target

    items = []
    layout: list[tuple[str, int | None]] = []
    for t in f.tensors():
        shape = tuple(t.shape)
        choice = policy.choose(t.name, shape) if len(shape) == 2 else None
        if choice is not None and selected(t.name) and (movable(t.name, shape, choice.dtype)
                                                        or table_item(t.name, shape, choice.dtype, calibration)):
            items.append((t.name, (lambda t=t: _quant.decode(t.numpy(), t.dtype, t.shape)), choice.options))
            layout.append((t.name, None))
            continue
        target, _ = stored_target(policy, t, selected(t.name), t.numpy())  # as requant writes it
        n = None if target is None else _quant.get_codec(target.dtype).expected_nbytes(shape)
        n = t.nbytes if n is None else n
        layout.append((t.name, n))
    fixed = sum(n for _, n in layout if n is not None)
    plan = plan_budget(items, fixed, budget, calibration, progress, cache, layout, reserved)
    return plan, {n: Choice(c.dtype, dict(c.options), "budget") for n, c in plan.picked.items()}


def _plan_overhead(plan) -> tuple[int, int]:  # noqa: ANN001 - a convert.hf.Plan
    """Bytes of the file ``plan`` writes that are not tensor payloads, at most: (envelope, header
    with room for the budget summary it gains, directory and vocab exactly as the writer lays
    them out; every payload's worst-case alignment padding, packed: 63 bytes each)."""
    from ..format.constants import DATA_ALIGN
    from ..format.directory import encode_directory
    from ..format.envelope import ENVELOPE_SIZE
    from ..format.header import serialize_header

    items = plan.items
    head = ENVELOPE_SIZE + len(serialize_header(plan.header)) + 4096  # budget summary, section hashes
    head += len(encode_directory([i.name for i in items], [0] * len(items), [tuple(i.shape) for i in items],
                                 [0] * len(items), [0] * len(items), [0] * len(items)))
    head = -(-head // DATA_ALIGN) * DATA_ALIGN
    vocab = len(plan.tokenizer.tokenizer_json or b"")
    return head + vocab, worst_padding(i.out_bytes for i in items)


def apply_to_plan(plan, target_mb: float | None, bpw: float | None,  # noqa: ANN001 - a convert.hf.Plan
                  progress: Callable[[int], None] | None = None) -> BudgetPlan:
    """``convert`` / ``import-gguf`` ``--target-mb`` / ``--bpw``: choose the ladder dtype of every
    movable matrix of a conversion plan so the whole output file fits, before anything is
    written. The plan's calibration (if attached) predicts each candidate's loss; the items'
    choices, size estimates and the header's provenance are updated in place."""
    from .. import quant as _quant
    from .policy import Choice

    if plan.shard_max_bytes is not None:
        raise ConvertError("--target-mb/--bpw bound one file; they cannot be combined with --shard-max-gb")
    total = sum(int(np.prod(i.shape, dtype=np.int64)) for i in plan.items)
    moved = [i for i in plan.items
             if i.choice.reason in ("quant", "attn-quant") and movable(i.name, tuple(i.shape), i.choice.dtype)
             or table_item(i.name, tuple(i.shape), i.choice.dtype, plan.calibration)]
    names = {i.name for i in moved}
    plan.packed = True  # the writer puts every payload on 64 bytes (budget_padding)
    head, padding = _plan_overhead(plan)
    budget = target_bytes(target_mb, bpw, total) - head - padding
    items = [(i.name, (lambda i=i: np.asarray(plan.checkpoint.read(i.source, i.cut), np.float32)), i.choice.options)
             for i in moved]
    layout = [(i.name, None if i.name in names else i.out_bytes) for i in plan.items]
    fixed = sum(n for _, n in layout if n is not None)
    bplan = plan_budget(items, fixed, budget, plan.calibration, progress, layout=layout, reserved=padding)
    for i in moved:
        c = bplan.picked[i.name]
        i.choice = Choice(c.dtype, dict(c.options), "budget")
        n = _quant.get_codec(c.dtype).expected_nbytes(tuple(i.shape))
        # vbit's size depends on the data: the candidate's own encoding (the same encoder on the
        # same values and statistics as the write) is the exact size
        i.out_bytes = int(n) if n is not None else c.nbytes
        i.out_exact = True
    plan.header["provenance"].setdefault("options", {})["budget"] = bplan.summary()
    return bplan
