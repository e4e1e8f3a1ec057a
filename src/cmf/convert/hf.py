"""Hugging Face checkpoint -> CMF: the plan (names, dtypes, header) and its streaming execution.

:func:`plan` reads only metadata: config.json, tokenizer files and the safetensors headers. It
maps every source tensor to its CMF name(s) (:mod:`.names`), picks each dtype (:mod:`.policy`),
builds the header (:mod:`.config`, :mod:`.tokenizer`) and sorts the tensors into the canonical
order. Everything that can be refused is refused here, before a byte is written.
:func:`execute` then reads, encodes and writes one tensor at a time into a
:class:`~cmf.format.writer.CmfWriter` (spooled to disk, atomic rename at the end).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..format.constants import Dtype
from ..format.hash64 import hash64_hex
from ..format.header import parse_header, serialize_header
from ..format.writer import CmfWriter
from .config import ModelConfig, load_config
from .errors import ConvertError
from .mla_layout import converter_layout
from .mla_layout import cut as mla_cut
from .names import TOP_LEVEL, Cut, rename_table, sort_key, split_rules, unwrap
from .policy import Choice, Policy, is_expert
from .source import Checkpoint, resolve
from .tokenizer import TokenizerFiles, read_tokenizer

log = logging.getLogger(__name__)

_LAYER_IDX = re.compile(r"model\.layers\.(\d+)\.")
_FAMILY = re.compile(r"\A(?P<pre>.+\.mlp\.experts)\.\d+\.(?P<role>gate_proj|up_proj|down_proj)\.weight\Z")


@dataclass
class PlanItem:
    """One output tensor: its CMF name, where it comes from and how it is stored."""

    name: str
    source: str
    cut: Cut | None
    shape: tuple[int, ...]
    source_dtype: str
    source_bytes: int
    choice: Choice = field(default_factory=lambda: Choice("f32"))
    out_bytes: int = 0
    out_exact: bool = True  # False when the dtype's size depends on the data (vbit, q1s, q1t)


@dataclass
class Plan:
    """Everything a conversion will do, before it does it (``--dry-run`` prints this)."""

    model: str
    folder: Path
    config: ModelConfig
    policy: Policy
    header: dict[str, Any]
    items: list[PlanItem]
    tokenizer: TokenizerFiles
    checkpoint: Checkpoint
    dropped: list[str]
    route_counts: dict[int, list[float]] | None = None
    shard_max_bytes: int | None = None
    calibration: Any = None  # a cmf.calib.Calibration: activation-aware encoding (convert/calibrate.py)

    @property
    def source_bytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(i.source_bytes for i in self.items)

    @property
    def out_bytes(self) -> int:
        """Tensor payload bytes written (estimated for variable-length dtypes)."""
        return sum(i.out_bytes for i in self.items)

    def close(self) -> None:
        self.checkpoint.close()

    def summary(self) -> dict[str, Any]:
        """JSON-ready description: arch, options, per-tensor dtypes and sizes, totals."""
        by_dtype: dict[str, list[int]] = {}
        for i in self.items:
            agg = by_dtype.setdefault(i.choice.dtype, [0, 0, 0])
            agg[0] += 1
            agg[1] += int(np.prod(i.shape, dtype=np.int64))
            agg[2] += i.out_bytes
        return {
            "model": self.model, "folder": str(self.folder), "model_type": self.config.source_type,
            "arch": self.header["arch"], "quant_type": self.header["quant_type"],
            "options": self.header["provenance"]["options"],
            "tensors": [{"name": i.name, "source": i.source, "shape": list(i.shape), "source_dtype": i.source_dtype,
                         "dtype": i.choice.dtype, "reason": i.choice.reason, "source_bytes": i.source_bytes,
                         "bytes": i.out_bytes, "exact": i.out_exact} for i in self.items],
            "dtypes": {k: {"tensors": v[0], "params": v[1], "bytes": v[2]} for k, v in sorted(by_dtype.items())},
            "dropped": self.dropped, "source_bytes": self.source_bytes, "bytes": self.out_bytes,
            "vocab_bytes": len(self.tokenizer.tokenizer_json or b""),
            "chat_template": bool(self.tokenizer.bundle and self.tokenizer.bundle.get("chat_template")),
        }


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    paths: list[Path]
    tensors: int
    source_bytes: int
    bytes: int
    seconds: float
    plan: Plan

    def to_dict(self) -> dict[str, Any]:
        return {"paths": [str(p) for p in self.paths], "tensors": self.tensors, "source_bytes": self.source_bytes,
                "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "source_gb_per_s": round(self.source_bytes / 1e9 / max(self.seconds, 1e-9), 3)}


# ----------------------------------------------------------------------------------- planning


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder}: no config.json")

    def no_constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        cfg = json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConvertError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return cfg


def _mtp_kind(mc: ModelConfig, names: list[str]) -> str | None:
    n = mc.arch["num_layers"]
    if mc.family == "deepseek":
        extra = sorted({int(m.group(1)) for s in names if (m := _LAYER_IDX.match(s)) and int(m.group(1)) >= n})
        if not extra:
            return None
        if extra != [n]:
            raise ConvertError(f"{mc.model_type}: MTP modules at layers {extra}; only one MTP module is supported")
        return "deepseek"
    if any(s.startswith("mtp.") for s in names):
        return "qwen"
    return None


def _map_names(mc: ModelConfig, ckpt: Checkpoint) -> tuple[list[PlanItem], list[str], str | None]:
    """Source tensors -> plan items (unwrapped, renamed, fused tensors split)."""
    dropped: list[str] = []
    unwrapped: list[tuple[str, str]] = []
    for src in ckpt:
        u = unwrap(src)
        if u is None:
            dropped.append(src)
        else:
            unwrapped.append((src, u))
    mtp = _mtp_kind(mc, [u for _, u in unwrapped])
    table = rename_table(mc.family, mc.arch["num_layers"], mtp)
    rules = split_rules(mc.family, mc.dims)
    layout = converter_layout(mc.arch, mc.text)
    items: list[PlanItem] = []
    for src, u in unwrapped:
        name = table.forward(u)
        if not name.startswith(TOP_LEVEL) or name.startswith("mtp."):
            raise ConvertError(f"tensor {src!r} is not part of a {mc.model_type} text model "
                               "(unexpected namespace); refusing to guess where it belongs")
        m = _LAYER_IDX.match(name)
        if m and int(m.group(1)) >= mc.arch["num_layers"]:
            raise ConvertError(f"tensor {src!r}: layer {m.group(1)} but the config has {mc.arch['num_layers']} layers")
        t = ckpt.check_float(src)
        for rx, split in rules:
            mm = rx.match(name)
            if mm:
                parts = split(mm, t.shape)
                _check_split(src, t.shape, parts, mc)
                for part_name, cut in parts:
                    shape = cut.shape(t.shape)
                    nbytes = t.itemsize * int(np.prod(shape, dtype=np.int64))
                    items.append(PlanItem(part_name, src, cut, shape, t.dtype, nbytes))
                break
        else:
            # MLA projections are read in the interchange row order (a permutation, same shape)
            items.append(PlanItem(name, src, mla_cut(layout, name, t.shape), t.shape, t.dtype, t.nbytes))
    return items, sorted(dropped), mtp


def _check_split(src: str, shape: tuple[int, ...], parts: list[tuple[str, Cut]], mc: ModelConfig) -> None:
    """Refuse fused tensors whose geometry disagrees with the config (e.g. a transposed bank)."""
    h = mc.arch["hidden_size"]
    rows_needed = max((b for _, c in parts if c.rows for a, b in c.rows), default=0)
    first = shape[1] if parts and parts[0][1].index is not None else (shape[0] if shape else 0)
    ok = len(shape) in (2, 3) and rows_needed <= first
    if ".experts.gate_up_proj" in src:
        ok = ok and len(shape) == 3 and shape[1] % 2 == 0 and shape[2] == h
    elif ".experts.down_proj" in src:
        ok = ok and len(shape) == 3 and shape[1] == h
    elif rows_needed != first:
        ok = False
    if not ok:
        raise ConvertError(f"tensor {src!r} of shape {list(shape)} does not match the fused layout the "
                           f"{mc.model_type} config implies")


def _load_route_stats(path: str | os.PathLike[str] | None) -> tuple[dict[int, list[float]] | None, str | None]:
    if path is None:
        return None, None
    p = Path(path)
    try:
        raw = p.read_bytes()
        data = json.loads(raw)
        counts = {int(k): [float(x) for x in v] for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConvertError(f"{p}: route stats must be JSON {{layer: [count per expert]}} ({exc})") from None
    if any(x < 0 for v in counts.values() for x in v):
        raise ConvertError(f"{p}: route stats hold a negative count")
    return counts, hash64_hex(raw)


def _shared_copy(ckpt: Checkpoint, a: str, b: str) -> bool:
    """Whether two source tensors hold the same bytes (an MTP head's copy of the main head)."""
    return ckpt.same_bytes(a, b)


def _estimate(choice: Choice, shape: tuple[int, ...]) -> tuple[int, bool]:
    from .. import quant

    codec = quant.get_codec(choice.dtype)
    n = codec.expected_nbytes(shape)
    if n is not None:
        return int(n), True
    rows = shape[0] if shape else 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    gpr = max(cols // 32, 1)
    if choice.dtype in ("vbit", "vbit_ro"):
        mb = float(choice.options.get("mean_bits", 4.25))
        return int(rows + 2 * rows * gpr + 4 * (rows + 1) + rows * cols * mb / 8), False
    tile = 6 if choice.dtype == "q1s" else 9
    return int(rows * gpr * tile + 4 * (rows + 1)), False


def plan(model: str | os.PathLike[str], quant: str = "q8", *, attn_quant: str | None = None,
         mean_bits: float | None = None, route_stats: str | os.PathLike[str] | None = None,
         shard_max_gb: float | None = None, revision: str | None = None) -> Plan:
    """Plan the conversion of ``model`` (a folder or hub id): names, dtypes, header, sizes.

    Reads metadata only (and, for DeepSeek-style MTP heads, compares the head's copies of the
    embedding and lm_head with the originals). Raises :class:`ConvertError` for anything the
    conversion would refuse. The returned plan keeps the checkpoint open: ``execute`` it or
    ``close()`` it.
    """
    if shard_max_gb is not None and not shard_max_gb > 0:
        raise ConvertError(f"--shard-max-gb must be positive, got {shard_max_gb}")
    folder = resolve(model, revision)
    config = _read_config(folder)
    mc = load_config(config)
    tok = read_tokenizer(folder, config, mc.text)
    route_counts, route_hash = _load_route_stats(route_stats)
    ckpt = Checkpoint(folder)
    try:
        items, dropped, mtp = _map_names(mc, ckpt)
        items = _resolve_heads(mc, ckpt, items, mtp)
        names = [i.name for i in items]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConvertError(f"two source tensors map to the same name(s): {', '.join(dup[:5])}")
        if "model.embed_tokens.weight" not in names:
            raise ConvertError(f"{folder}: no model.embed_tokens.weight among the weights; not a "
                               f"{mc.model_type} checkpoint?")
        pol = Policy.make(quant, attn_quant, mean_bits, has_experts=any(is_expert(n) for n in names))
        if route_counts is not None and not {"vbit", "vbit_ro"} & {pol.quant, pol.attn_quant}:
            log.warning("--route-stats only shapes vbit bit allocation; ignored for --quant %s", pol.quant)
        for it in items:
            it.choice = pol.choose(it.name, it.shape)
            it.out_bytes, it.out_exact = _estimate(it.choice, it.shape)
        items.sort(key=lambda i: sort_key(i.name))
        header = _header(mc, items, tok, pol, model, revision, config, shard_max_gb, route_hash)
        shard_bytes = None if shard_max_gb is None else max(int(shard_max_gb * 1e9), 1)
        return Plan(str(model), folder, mc, pol, header, items, tok, ckpt, dropped, route_counts, shard_bytes)
    except BaseException:
        ckpt.close()
        raise


def _resolve_heads(mc: ModelConfig, ckpt: Checkpoint, items: list[PlanItem], mtp: str | None) -> list[PlanItem]:
    """Tied lm_head and MTP copies of the head/embedding: drop duplicates, keep real tensors."""
    by = {i.name: i for i in items}
    if mc.tie_word_embeddings and "lm_head.weight" in by:
        log.info("tie_word_embeddings: the checkpoint's lm_head.weight is not stored (the embedding serves)")
        del by["lm_head.weight"]
    elif not mc.tie_word_embeddings and "lm_head.weight" not in by:
        raise ConvertError("lm_head.weight is missing and tie_word_embeddings is false")
    mc.arch.pop("mtp", None)
    if mtp is not None:
        share = {"share_lm_head": True, "share_embed": True}
        head_src = "lm_head.weight" if "lm_head.weight" in by else "model.embed_tokens.weight"
        for cmf_name, key, main in (("model.mtp.lm_head.weight", "share_lm_head", head_src),
                                    ("model.mtp.embed_tokens.weight", "share_embed", "model.embed_tokens.weight")):
            it = by.get(cmf_name)
            if it is None:
                continue
            if main in by and _shared_copy(ckpt, it.source, by[main].source):
                del by[cmf_name]
            else:
                share[key] = False
        mtp_layers = {int(m.group(1)) for n in by if (m := re.match(r"model\.mtp\.layers\.(\d+)\.", n))}
        if mtp_layers:
            mc.arch["mtp"] = {"num_layers": len(mtp_layers), **share}
        else:
            log.warning("MTP tensors without an MTP block; dropped")
            by = {k: v for k, v in by.items() if not k.startswith("model.mtp.")}
    return list(by.values())


def _header(mc: ModelConfig, items: list[PlanItem], tok: TokenizerFiles, pol: Policy, model: Any,
            revision: str | None, config: dict[str, Any], shard_max_gb: float | None,
            route_hash: str | None) -> dict[str, Any]:
    arch = dict(mc.arch)
    names = {i.name for i in items}
    if "moe" in arch:
        moe = dict(arch["moe"])
        dense = [i for i in range(arch["num_layers"]) if f"model.layers.{i}.mlp.gate.weight" not in names]
        if dense:
            moe["dense_layers"] = dense
        arch["moe"] = moe
    options = pol.options()
    if shard_max_gb is not None:
        options["shard_max_gb"] = shard_max_gb
    if route_hash is not None:
        options["route_stats_hash64"] = route_hash
    prov: dict[str, Any] = {"tool": f"pycmf {__version__}", "source_model": str(model), "source_format": "safetensors",
                            "source_dtypes": sorted({i.source_dtype for i in items}), "options": options,
                            "hf_config": config}
    if revision is not None:
        prov["revision"] = revision
    if tok.generation_config is not None:
        prov["hf_generation_config"] = tok.generation_config
    if tok.tokenizer_config is not None:
        prov["hf_tokenizer_config"] = tok.tokenizer_config
    header: dict[str, Any] = {"format": "cmf", "version": 2, "quant_type": pol.quant_type, "arch": arch}
    if tok.bundle is not None:
        header["tokenizer_config"] = tok.bundle
    header["provenance"] = prov
    try:
        parse_header(serialize_header(header))
    except Exception as exc:  # noqa: BLE001 - ParseError or a non-JSON value from config.json
        raise ConvertError(f"cannot build a valid CMF header: {exc}") from None
    return header


# ----------------------------------------------------------------------------------- execution


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
        if key is not None and it.choice.dtype in ("vbit", "vbit_ro"):
            fam_members.setdefault(key, []).append(it)
    biases: dict[str, float] = {}
    done_families: set[tuple[str, str]] = set()
    n_workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    cap = max((_cost(i) for i in plan.items), default=0)
    try:
        # The tensor list is known up front: the writer reserves the head and writes each payload
        # once, at its final offset (no spool copy).
        with CmfWriter(out, plan.header, max_shard_bytes=plan.shard_max_bytes,
                       expected_names=[i.name for i in plan.items]) as w, \
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


def convert(model: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, quant: str = "q8", *,
            attn_quant: str | None = None, mean_bits: float | None = None,
            route_stats: str | os.PathLike[str] | None = None, shard_max_gb: float | None = None,
            dry_run: bool = False, revision: str | None = None,
            progress: Callable[[int], None] | None = None, calib: str | os.PathLike[str] | None = None,
            calib_tokens: int | None = None,
            calib_progress: Callable[[int], None] | None = None) -> ConvertResult | Plan:
    """Convert a Hugging Face checkpoint (local folder or hub id) into a CMF file.

    ``quant``: f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp (profile), vbit, q1, q1p, q1s, q1t;
    ``attn_quant``: a different quant for attention projections; ``mean_bits``: the vbit budget;
    ``route_stats``: JSON ``{layer: [selection count per expert]}`` for vbit MoE allocation;
    ``shard_max_gb``: split the output into shards of at most this many GB; ``calib``: a text the
    model is run on first, for activation-aware encoding (convert/calibrate.py; ``calib_tokens``
    caps the tokens used, ``calib_progress(n)`` gets the tokens of each window done).
    With ``dry_run`` nothing is written and the :class:`Plan` is returned; otherwise a
    :class:`ConvertResult`.
    """
    if not dry_run and out is None:
        raise ConvertError("an output path is needed (or dry_run=True)")
    p = plan(model, quant, attn_quant=attn_quant, mean_bits=mean_bits, route_stats=route_stats,
             shard_max_gb=shard_max_gb, revision=revision)
    if dry_run:
        p.close()
        return p
    assert out is not None
    if calib is not None:
        attach_calibration(p, model, calib, Path(out).parent, revision=revision, tokens=calib_tokens,
                           progress=calib_progress)
    return execute(p, out, progress)


def attach_calibration(p: Plan, source: str | os.PathLike[str], text: str | os.PathLike[str], work_dir: Path, *,
                       revision: str | None = None, tokens: int | None = None,
                       progress: Callable[[int], None] | None = None) -> None:
    """Collect calibration statistics of ``source`` on ``text`` into the plan (and its provenance)."""
    from .. import calib as _calib
    from .calibrate import calibrate_source

    try:
        extra = {k: v for k, v in p.header["arch"].items() if k == "rope_freq_factors"}

        def write_f16(path: Path) -> None:
            p16 = plan(source, "f16", revision=revision)
            p16.header["arch"].update(extra)
            execute(p16, path)

        cal = calibrate_source(write_f16, text, work_dir, tokens=tokens or _calib.DEFAULT_MAX_TOKENS,
                               progress=progress)
    except BaseException:
        p.close()
        raise
    p.calibration = cal
    p.header["provenance"]["options"]["calib"] = cal.provenance()
