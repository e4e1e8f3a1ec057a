"""Hugging Face checkpoint -> CMF: the plan (names, dtypes, header); :mod:`.execute` carries it out.

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
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..format.hash64 import hash64_hex
from ..format.header import parse_header, serialize_header
from .config import ModelConfig, load_config
from .errors import ConvertError
from .execute import execute
from .mla_layout import converter_layout
from .mla_layout import cut as mla_cut
from .names import TOP_LEVEL, Cut, rename_table, sort_key, split_rules, unwrap
from .plan_types import ConvertResult, Plan, PlanItem
from .policy import Choice, Policy, is_expert
from .source import Checkpoint, resolve
from .tokenizer import TokenizerFiles, read_tokenizer

log = logging.getLogger(__name__)

_LAYER_IDX = re.compile(r"model\.layers\.(\d+)\.")


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
    if mc.profile.mtp_style == "deepseek":  # the MTP module is the decoder layer after the last
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


def convert(model: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, quant: str = "q8", *,
            attn_quant: str | None = None, mean_bits: float | None = None,
            route_stats: str | os.PathLike[str] | None = None, shard_max_gb: float | None = None,
            dry_run: bool = False, revision: str | None = None,
            progress: Callable[[int], None] | None = None, calib: str | os.PathLike[str] | None = None,
            calib_tokens: int | None = None, calib_progress: Callable[[str, int, int], None] | None = None,
            target_mb: float | None = None, bpw: float | None = None,
            sensitivity_tokens: int | None = None) -> ConvertResult | Plan:
    """Convert a Hugging Face checkpoint (local folder or hub id) into a CMF file.

    ``quant``: f32, f16, bf16, q8, q8_2f, q4, q4t, q4tp, q2tp (profile), vbit, q1, q1p, q1s, q1t;
    ``attn_quant``: a different quant for attention projections; ``mean_bits``: the vbit budget;
    ``route_stats``: JSON ``{layer: [selection count per expert]}`` for vbit MoE allocation;
    ``shard_max_gb``: split the output into shards of at most this many GB; ``calib``: a text the
    model is run on first, for activation-aware encoding (convert/calibrate.py; ``calib_tokens``
    caps the tokens used, ``calib_progress(stage, n, total)`` reports its progress, cmf.calib.Progress);
    ``target_mb`` / ``bpw``: fit the whole file in a budget (cmf.convert.budget.apply_to_plan),
    weighing each matrix by its measured sensitivity on ``sensitivity_tokens`` tokens of the
    calibration text (default: 128 with a target, 0 = not measured; cmf.calib.sensitivity).
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
        from .calibrate import sensitivity_tokens_for

        attach_calibration(p, model, calib, Path(out).parent, revision=revision, tokens=calib_tokens,
                           progress=calib_progress,
                           sensitivity_tokens=sensitivity_tokens_for(sensitivity_tokens, target_mb, bpw))
    if target_mb is not None or bpw is not None:
        fit_budget(p, target_mb, bpw)
    return execute(p, out, progress)


def fit_budget(p: Plan, target_mb: float | None, bpw: float | None) -> None:
    """``--target-mb`` / ``--bpw`` on a plan (closed on failure, like :func:`attach_calibration`)."""
    from .budget import apply_to_plan

    try:
        apply_to_plan(p, target_mb, bpw)
    except BaseException:
        p.close()
        raise


def attach_calibration(p: Plan, source: str | os.PathLike[str], text: str | os.PathLike[str], work_dir: Path, *,
                       revision: str | None = None, tokens: int | None = None,
                       progress: Callable[[str, int, int], None] | None = None, sensitivity_tokens: int = 0) -> None:
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
                               progress=progress, sensitivity_tokens=sensitivity_tokens)
    except BaseException:
        p.close()
        raise
    p.calibration = cal
    p.header["provenance"]["options"]["calib"] = cal.provenance()
