"""What a model file contains, as plain data (spec §2–§7, §9, §12): the summary behind ``cmf info``
and the server's model card.

:func:`info` returns arch, parameter count, a dtype table grouped by tensor family with bits per
weight, the envelope sections and their sizes, skills, masks and, for pipeline containers (§12:
``te.``/``dit.``/``vae.`` namespaces), one entry per component with its config JSON.
:func:`list_tensors` lists directory entries under a name prefix with totals. It sits below both
``cmf.tools`` (which renders it) and ``cmf.server`` (which serves it), so neither imports the other.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Any

from .format.constants import SECTION_NAMES, Dtype
from .format.reader import CmfFile
from .format.reader import open as cmf_open
from .format.signature import signature_path
from .image.components import NAMESPACES as PIPELINE_NAMESPACES
from .image.components import is_pipeline

FAMILY_ORDER = ("embed", "attention", "ffn", "experts", "norms", "lm_head", *PIPELINE_NAMESPACES,
                "skill", "other")

# Tensor family from the name, first match wins. Norms come before attention so that
# `self_attn.q_norm.weight` counts as a norm; experts (routed, shared, router) before dense FFN.
_FAMILY_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("norms", re.compile(r"(^|[._])([a-z0-9_]*norm[a-z0-9_]*|ln_[a-z0-9]+|ln)(\.|$)")),
    ("embed", re.compile(r"(^|\.)(embed_tokens|tok_embeddings|word_embeddings|wte|embeddings?)(\.|$)")),
    ("lm_head", re.compile(r"(^|\.)(lm_head|output)(\.|$)")),
    ("experts", re.compile(r"\.(experts|shared_experts?|router|block_sparse_moe)(\.|$)"
                           r"|(^|\.)mlp\.gate\.(weight|bias)$|\.shared_expert_gate\.")),
    ("ffn", re.compile(r"(^|\.)(mlp|feed_forward|ffn|gate_proj|up_proj|down_proj|fc1|fc2|w1|w2|w3)(\.|$)")),
    ("attention", re.compile(r"(^|\.)(self_attn|attention|attn|linear_attn|q_proj|k_proj|v_proj|o_proj"
                             r"|qkv_proj|query_key_value)(\.|$)")),
)


def family_of(name: str, pipeline: bool = False) -> str:
    """The tensor family used by the dtype table: embed, attention, ffn, experts, norms, lm_head,
    skill (``skill.*`` replacements), other; in a pipeline container, the component namespace."""
    if name.startswith("skill."):
        return "skill"
    if pipeline:
        ns = name.split(".", 1)[0]
        if ns in PIPELINE_NAMESPACES:
            return ns
    for family, pattern in _FAMILY_RULES:
        if pattern.search(name):
            return family
    return "other"


def _params(t: Any) -> int:
    """Weights in a tensor; raw-byte u8 blobs (component configs) are not parameters."""
    return 0 if t.dtype == Dtype.U8 else t.numel


def _bpw(nbytes: int, params: int) -> float | None:
    return round(nbytes * 8 / params, 4) if params else None


def _arch_summary(a: Any) -> dict[str, Any]:
    kinds: dict[str, int] = defaultdict(int)
    for k in a.layer_kinds:  # as run: a sliding_window_pattern without tags counts its sliding layers
        kinds[k] += 1
    out: dict[str, Any] = {
        "arch_name": a.arch_name, "num_layers": a.num_layers, "layer_types": dict(kinds),
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_position_embeddings, "rope_theta": a.rope_theta,
        "norm_style": a.norm_style, "tie_word_embeddings": a.tie_word_embeddings,
    }
    if a.num_loops > 1:
        out["num_loops"] = a.num_loops
    if a.moe is not None:
        out["moe"] = {"num_experts": a.moe.num_experts, "top_k": a.moe.top_k,
                      "moe_intermediate_size": a.moe.moe_intermediate_size}
    if a.mtp is not None:
        out["mtp_layers"] = a.mtp.num_layers
    return out


def _component_config(f: CmfFile, ns: str) -> tuple[Any, str | None]:
    name = f"{ns}.config_json"
    if name not in f:
        return None, None
    try:
        return json.loads(bytes(f.tensor(name).data).decode("utf-8")), None
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"{name} is not UTF-8 JSON: {exc}"


def _sections(f: CmfFile) -> list[dict[str, Any]]:
    rows = []
    for shard, path in enumerate(f.paths):
        env = f.envelope if shard == 0 else None
        for name in SECTION_NAMES:
            n = len(f.section_bytes(name, shard))
            if not n:
                continue
            row: dict[str, Any] = {"name": name, "bytes": n}
            if env is not None:
                row["offset"] = env.section(name).off
            if len(f.paths) > 1:
                row["file"] = path.name
            rows.append(row)
    return rows


def _masks_summary(f: CmfFile) -> dict[str, Any] | None:
    if f.masks is None:
        return None
    return {"default_task": f.masks.default_task,
            "tasks": [{"name": m.name, "sparsity": m.sparsity,
                       "quality": None if m.quality is None else m.quality.get("value")}
                      for m in f.masks]}


# Dtypes no reference writer emits (convert.rs quantize_2d / encode_f16, skill bake, the Python
# writer): allowed by the spec and decoded by the reference's readers, but worth saying.
REFERENCE_UNWRITTEN_DTYPES = ("bf16",)


def _interchange(f: CmfFile, names: list[str], groups: dict[tuple[str, str], list[int]]) -> dict[str, Any]:
    """Features the file needs, whether this version runs it, and what a reader must understand."""
    from .runtime.features import report  # light: no kernels (runtime/__init__ is lazy)

    out = report(f.header, names, skill_file=f.is_skill_file)
    unwritten: dict[str, int] = defaultdict(int)
    for (_, dt), (n, _, _) in groups.items():
        if dt in REFERENCE_UNWRITTEN_DTYPES:
            unwritten[dt] += n
    out["reference_unwritten_dtypes"] = dict(unwritten)
    return out


def info(model: str | os.PathLike | CmfFile) -> dict[str, Any]:
    """Summary of a model (path or open CmfFile) as JSON-ready data; see the module docstring."""
    if not isinstance(model, CmfFile):
        with cmf_open(model) as f:
            return info(f)
    f = model
    names = f.keys()
    pipeline = is_pipeline(names)
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    skill_tensors: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    params = skill_params = 0
    for t in f.tensors():
        fam = family_of(t.name, pipeline)
        p = _params(t)
        g = groups[(fam, t.dtype.label)]
        g[0] += 1
        g[1] += p
        g[2] += t.nbytes
        if fam == "skill":
            skill_params += p
            sid = t.name.split(".", 2)[1] if t.name.count(".") >= 2 else ""
            s = skill_tensors[sid]
            s[0] += 1
            s[1] += p
            s[2] += t.nbytes
        else:
            params += p
    order = {fam: i for i, fam in enumerate(FAMILY_ORDER)}
    dtype_table = [
        {"family": fam, "dtype": dt, "tensors": n, "params": p, "bytes": b, "bits_per_weight": _bpw(b, p)}
        for (fam, dt), (n, p, b) in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1]))
    ]
    h = f.header
    skills = []
    for rec in h.skills:
        n, p, b = skill_tensors.get(rec.id, [0, 0, 0])
        skills.append({"id": rec.id, "name": rec.name, "layers": list(rec.layers),
                       "routable": rec.selection is not None, "input_mask_task": rec.input_mask_task,
                       "quality": rec.quality, "tensors": n, "params": p, "bytes": b,
                       "base_dir_hash": rec.base_dir_hash})
    data: dict[str, Any] = {
        "path": str(f.path),
        "files": [str(p) for p in f.paths],
        "size": f.size,
        "version": f.envelope.version,
        "features": [flag.name for flag in type(f.features) if flag in f.features],
        "runnable": f.runnable,
        "quant_type": h.quant_type,
        "arch": _arch_summary(h.arch),
        "tensors": len(names),
        "parameters": params,
        "skill_parameters": skill_params,
        "dtypes": dtype_table,
        "sections": _sections(f),
        "header_hash": f"{f.envelope.header_hash:016x}",
        "dir_hash": f"{f.envelope.dir_hash:016x}",
        "skills": skills,
        "masks": _masks_summary(f),
        "tokenizer": {"vocab_bytes": len(f.section_bytes("vocab")),
                      "chat_template": bool(h.tokenizer_config and h.tokenizer_config.chat_template)},
        "signature": signature_path(f.path).exists(),
        "interchange": _interchange(f, names, groups),
    }
    if pipeline:
        comps = []
        for ns in PIPELINE_NAMESPACES:
            rows = [r for r in dtype_table if r["family"] == ns]
            if not rows:
                continue
            config, error = _component_config(f, ns)
            comp = {"namespace": ns, "tensors": sum(r["tensors"] for r in rows),
                    "params": sum(r["params"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
                    "dtypes": {r["dtype"]: r["tensors"] for r in rows}, "config": config}
            if error:
                comp["config_error"] = error
            comps.append(comp)
        data["pipeline"] = {"components": comps,
                            "provenance": h.provenance.get("pipeline") if isinstance(h.provenance, dict) else None}
    return data


def list_tensors(model: str | os.PathLike | CmfFile, prefix: str = "") -> dict[str, Any]:
    """Directory entries whose name starts with ``prefix`` (all when empty), with totals."""
    if not isinstance(model, CmfFile):
        with cmf_open(model) as f:
            return list_tensors(f, prefix)
    rows = []
    for t in model.tensors():
        if not t.name.startswith(prefix):
            continue
        p = _params(t)
        rows.append({"name": t.name, "dtype": t.dtype.label, "shape": list(t.shape), "params": p,
                     "bytes": t.nbytes, "bits_per_weight": _bpw(t.nbytes, p), "hash": f"{t.hash:016x}",
                     "shard": t.shard + 1})
    return {"prefix": prefix, "tensors": rows,
            "total": {"tensors": len(rows), "params": sum(r["params"] for r in rows),
                      "bytes": sum(r["bytes"] for r in rows)}}
