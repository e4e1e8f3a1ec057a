"""Carry out a conversion :class:`~cmf.convert.plan_types.Plan`: read, encode and write one tensor
at a time into a :class:`~cmf.format.writer.CmfWriter` (atomic rename at the end), the encoding on
worker threads within a working-memory cap."""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..format.constants import Dtype
from ..format.writer import CmfWriter
from .errors import ConvertError
from .plan_types import ConvertResult, Plan, PlanItem
from .policy import Choice

log = logging.getLogger(__name__)

_LAYER_IDX = re.compile(r"model\.layers\.(\d+)\.")
_FAMILY = re.compile(r"\A(?P<pre>.+\.mlp\.experts)\.\d+\.(?P<role>gate_proj|up_proj|down_proj)\.weight\Z")


def _family_key(name: str) -> tuple[str, str] | None:
    m = _FAMILY.match(name)
    return (m.group("pre"), m.group("role")) if m else None


def _vbit_biases(plan: Plan, members: list[PlanItem]) -> dict[str, float]:
    """Joint water-filling over one MoE family (REFERENCE_NOTES §1.8): only each row's absmax
    matters, so the experts are read once for that and handed over as (rows, 1) proxies."""
    from .. import quant

    proxies = []
    for it in members:
        w = plan.checkpoint.read(it.source, it.cut)
        proxies.append(np.abs(w.reshape(w.shape[0], -1)).max(axis=1, initial=np.float32(0))[:, None])
        del w
    counts = None
    m = _LAYER_IDX.match(members[0].name)
    if plan.route_counts is not None and m and not members[0].name.startswith("model.mtp."):
        layer = int(m.group(1))
        counts = plan.route_counts.get(layer)
        if counts is not None and len(counts) != len(members):
            raise ConvertError(f"route stats for layer {layer} hold {len(counts)} counts for {len(members)} experts")
    mb = float(members[0].choice.options.get("mean_bits", 4.25))
    biases = quant.vbit_family_biases(proxies, mb, counts)
    return {it.name: b for it, b in zip(members, biases)}


def _encode(arr: np.ndarray, choice: Choice, bias: float | None, stats: Any = None) -> tuple[Any, Dtype]:
    from .. import quant

    dtype = quant.resolve_dtype(choice.dtype)
    if dtype == Dtype.F32:
        return np.ascontiguousarray(arr, dtype="<f4"), dtype
    if dtype in (Dtype.F16, Dtype.BF16) and arr.nbytes > _CHUNK:
        # Element-wise formats: encode in slices into one buffer, so the encoder's whole-tensor
        # temporaries (about 2x the f32 input) never exist at once.
        flat = arr.reshape(-1)
        out = np.empty(flat.size * 2, np.uint8)
        step = _CHUNK // 4
        for at in range(0, flat.size, step):
            part = quant.encode(flat[at:at + step], dtype)
            out[2 * at:2 * at + len(part)] = np.frombuffer(part, np.uint8)
        return out, dtype
    opts = dict(choice.options)
    if bias is not None:
        opts["bias"] = bias
    if stats is not None:  # calibration statistics of this matrix (cmf.calib)
        from .. import calib

        return calib.encode(arr, dtype, stats, **opts), dtype
    return quant.encode(arr, dtype, **opts), dtype


def _produce(plan: Plan, it: PlanItem, bias: float | None) -> tuple[Any, Dtype]:
    """Read, check and encode one tensor (runs on a worker thread)."""
    arr = plan.checkpoint.read(it.source, it.cut)
    if it.choice.dtype not in ("f32", "f16", "bf16") and not np.isfinite(arr).all():
        raise ConvertError(f"tensor {it.source!r} holds NaN or infinity; cannot quantize it")
    stats = plan.calibration.get(it.name) if plan.calibration is not None else None
    return _encode(arr, it.choice, bias, stats)


def _f32_bytes(it: PlanItem) -> int:
    return 4 * int(np.prod(it.shape, dtype=np.int64))


# Peak encoder working memory per byte of f32 input, measured with tracemalloc on cmf.quant for
# tensors up to one row chunk (~16 MB). Most codecs work chunk by chunk, so their extra memory
# stops growing there; f16/bf16/q1s/q1t temporaries grow with the whole tensor.
_ENCODE_PEAK = {"f32": 0.0, "f16": 2.0, "bf16": 2.5, "q8_row": 2.3, "q8_2f": 3.3, "q4_block": 2.3,
                "q4_tiled": 2.3, "q4tp": 7.6, "q2tp": 4.2, "vbit": 8.3, "vbit_ro": 8.3, "q1": 2.1, "q1s": 3.5,
                "q1t": 15.0}
_UNCHUNKED = frozenset({"q1s", "q1t"})  # f16/bf16 are sliced in _encode
_CHUNK = 16 << 20


def _cost(it: PlanItem) -> int:
    """Estimated peak bytes of reading and encoding one tensor: the f32 array plus encoder temporaries."""
    n = _f32_bytes(it)
    k = _ENCODE_PEAK.get(it.choice.dtype, 8.0)
    return int(n + k * (n if it.choice.dtype in _UNCHUNKED else min(n, _CHUNK)))


def execute(plan: Plan, out: str | os.PathLike[str], progress: Callable[[int], None] | None = None,
            workers: int | None = None) -> ConvertResult:
    """Write the planned file(s) to ``out``; ``progress(n)`` gets the source bytes done so far.

    Tensors are read and encoded on ``workers`` threads (default: up to 4, one per core) and
    written in plan order by this thread, so the output does not depend on the thread count.
    Tensors run concurrently only while their estimated working memory (:func:`_cost`) together
    stays within the costliest single tensor's: small tensors overlap, the largest runs alone,
    and the peak is that of converting one tensor at a time.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if out.is_dir():
        raise ConvertError(f"{out}: is a folder; give the output file name (e.g. {out / 'model.cmf'})")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: output folder does not exist")
    fam_members: dict[tuple[str, str], list[PlanItem]] = {}
    for it in plan.items:
        key = _family_key(it.name)
        # (a budget's vbit rung was measured per matrix, without a family bias: its size must stay)
        if key is not None and it.choice.dtype in ("vbit", "vbit_ro") and it.choice.reason != "budget":
            fam_members.setdefault(key, []).append(it)
    biases: dict[str, float] = {}
    done_families: set[tuple[str, str]] = set()
    n_workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    cap = max((_cost(i) for i in plan.items), default=0)
    try:
        # The tensor list is known up front: the writer reserves the head and writes each payload
        # once, at its final offset (no spool copy).
        with CmfWriter(out, plan.header, max_shard_bytes=plan.shard_max_bytes,
                       expected_names=[i.name for i in plan.items], packed=plan.packed) as w, \
                ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="cmf-convert") as pool:
            pending: deque[tuple[PlanItem, Future[tuple[Any, Dtype]]]] = deque()
            in_flight = 0

            def drain_one() -> None:
                nonlocal in_flight
                it, fut = pending.popleft()
                payload, dtype = fut.result()
                entry = w.add(it.name, dtype, it.shape, payload)
                it.out_bytes, it.out_exact = entry.nbytes, True
                in_flight -= _cost(it)
                if progress is not None:
                    progress(it.source_bytes)

            try:
                for it in plan.items:
                    key = _family_key(it.name)
                    if key in fam_members and key not in done_families:
                        biases.update(_vbit_biases(plan, fam_members[key]))
                        done_families.add(key)
                    while pending and (len(pending) >= 2 * n_workers or in_flight + _cost(it) > cap):
                        drain_one()
                    pending.append((it, pool.submit(_produce, plan, it, biases.get(it.name))))
                    in_flight += _cost(it)
                while pending:
                    drain_one()
            except BaseException:
                for _, fut in pending:
                    fut.cancel()
                raise
            if plan.tokenizer.tokenizer_json is not None:
                w.set_vocab(plan.tokenizer.tokenizer_json)
        paths = list(w.outputs)
    finally:
        plan.close()
    size = sum(p.stat().st_size for p in paths)
    secs = time.perf_counter() - t0
    log.info("wrote %s: %d tensors, %d bytes in %.2f s", ", ".join(map(str, paths)), len(plan.items), size, secs)
    return ConvertResult(paths, len(plan.items), plan.source_bytes, size, secs, plan)
