"""CMF -> Hugging Face: safetensors + config.json + generation/tokenizer files (``cmf export``).

The config comes from the header. When the file was converted by us, ``provenance.hf_config``
holds the source config.json and is restored as it was (for a multimodal source: its text tower
as a text-only causal LM, since only that tower was converted), with any geometry the header
now says differently (a file pruned by moe-defrag has fewer experts) written over it. Without
provenance a config is rebuilt from the arch block alone (best effort: scaled RoPE other than
yarn/linear cannot be inverted from per-frequency factors).

Tensor names are mapped back through the same tables as the converter (:mod:`.names`), so the
output uses the hub's layout: per-expert tensors (Mixtral ``w1/w2/w3``), DeepSeek
``shared_experts`` and ``e_score_correction_bias``, re-fused phi3 ``qkv_proj``/``gate_up_proj``
and qwen3_next ``in_proj_qkvz``/``in_proj_ba``, MTP heads where the hub keeps them. The
safetensors files are written tensor by tensor (headers first, then each payload as it is
decoded), so RAM stays near one tensor; each file appears under its final name only when done.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..format.atomic import apply_output_mode
from ..format.header import as_arch
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .config import load_config, text_config
from .errors import ConvertError
from .mla_layout import MlaLayout, export_layout, hf_rows
from .names import Fuse, fuse_groups, rename_table
from .profiles import ARCH_TO_TYPE, CAUSAL_LM, PROFILES, WRAPPERS, family_of
from .tokenizer import token_content

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"f32": ("F32", 4, "float32"), "f16": ("F16", 2, "float16"), "bf16": ("BF16", 2, "bfloat16")}
TORCH_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclass
class ExportResult:
    """What an export wrote."""

    folder: Path
    files: list[Path]
    tensors: int
    dtype: str
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "files": [p.name for p in self.files], "tensors": self.tensors,
                "dtype": self.dtype, "bytes": self.bytes, "seconds": round(self.seconds, 3)}


# ----------------------------------------------------------------------------------- config


def _geometry(arch: dict[str, Any]) -> dict[str, Any]:
    keys = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "vocab_size", "intermediate_size",
            "tie_word_embeddings")
    out = {k: arch.get(k) for k in keys}
    moe = arch.get("moe") or {}
    out["num_experts"] = moe.get("num_experts")
    out["top_k"] = moe.get("top_k")
    return out


# HF keys that carry each geometry field, per family; the first that exists is updated.
_HF_KEYS = {"hidden_size": ("hidden_size",), "num_layers": ("num_hidden_layers",),
            "num_attention_heads": ("num_attention_heads",), "num_kv_heads": ("num_key_value_heads",),
            "vocab_size": ("vocab_size",), "intermediate_size": ("intermediate_size",),
            "tie_word_embeddings": ("tie_word_embeddings",),
            "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
            "top_k": ("num_experts_per_tok",)}


def config_for(arch: dict[str, Any], provenance: Any) -> tuple[dict[str, Any], str]:
    """(config.json dict, text model_type) for a file's arch, restoring the source config if kept."""
    src = provenance.get("hf_config") if isinstance(provenance, dict) else None
    if isinstance(src, dict):
        try:
            top_type, mt, text, top = text_config(src)
            derived = load_config(src).arch
        except ConvertError as exc:
            log.warning("provenance.hf_config is unusable (%s); rebuilding config.json from the header", exc)
        else:
            cfg = dict(text) if top_type in WRAPPERS else dict(src)
            if top_type in WRAPPERS:
                cfg["model_type"] = mt
                cfg["architectures"] = [CAUSAL_LM[mt]]
                cfg["tie_word_embeddings"] = bool(arch.get("tie_word_embeddings"))
                for k in ("dtype", "torch_dtype"):
                    if k in top and k not in cfg:
                        cfg[k] = top[k]
            want, have = _geometry(arch), _geometry(derived)
            for k, v in want.items():
                if v is not None and v != have.get(k):
                    key = next((h for h in _HF_KEYS[k] if h in cfg), _HF_KEYS[k][0])
                    log.info("config.json: %s %r -> %r (the file differs from its source)", key, cfg.get(key), v)
                    cfg[key] = v
            return cfg, mt
    return _rebuild(arch), ARCH_TO_TYPE.get(str(arch.get("arch_name")), "llama")


# The config key counting the experts, per MoE kind (Profile.moe); the others say num_experts.
_EXPERTS_KEY = {"mixtral": "num_local_experts", "deepseek": "n_routed_experts"}


def _rebuild(a: dict[str, Any]) -> dict[str, Any]:
    """A config.json from the arch block alone (files converted by other tools)."""
    mt = ARCH_TO_TYPE.get(str(a.get("arch_name")))
    if mt is None:
        raise ConvertError(f"arch_name {a.get('arch_name')!r} has no known Hugging Face model type and the file "
                           "carries no provenance.hf_config; cannot write a config.json")
    log.warning("no provenance.hf_config in the file: config.json rebuilt from the header (best effort)")
    p = PROFILES[mt]
    lt = {"FullAttention": "full_attention", "SlidingAttention": "sliding_attention",
          "LinearAttention": "linear_attention"}
    cfg: dict[str, Any] = {
        "architectures": [CAUSAL_LM[mt]], "model_type": mt, "hidden_size": a["hidden_size"],
        "intermediate_size": a["intermediate_size"], "num_hidden_layers": a["num_layers"],
        "num_attention_heads": a["num_attention_heads"], "num_key_value_heads": a["num_kv_heads"],
        "head_dim": a["head_dim"], "vocab_size": a["vocab_size"], "rms_norm_eps": a["rms_norm_eps"],
        "max_position_embeddings": a["max_position_embeddings"],
        "tie_word_embeddings": bool(a.get("tie_word_embeddings")),
        "layer_types": [lt.get(t, t) for t in as_arch(a).layer_kinds],  # the schedule as run
    }
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}.get(a.get("hidden_act", "silu"), "silu")
    cfg[p.activation_key] = act
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.get("rope_theta", 10000.0)}
    if a.get("partial_rotary_factor", 1.0) != 1.0:
        rope["partial_rotary_factor"] = a["partial_rotary_factor"]
    y = a.get("yarn")
    factors = a.get("rope_freq_factors")
    if y:
        rope.update(rope_type="yarn", factor=y["factor"], original_max_position_embeddings=y["original_max_position_embeddings"],
                    beta_fast=y.get("beta_fast", 32.0), beta_slow=y.get("beta_slow", 1.0),
                    attention_factor=y.get("attention_factor", 1.0))
    elif factors and len(set(factors)) == 1:
        rope.update(rope_type="linear", factor=factors[0])
    elif factors:
        log.warning("per-frequency RoPE factors cannot be expressed in config.json; exported as plain RoPE")
    if a.get("rope_local_base_freq") is not None and p.local_rope_base:
        cfg["rope_parameters"] = {"full_attention": rope,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": a["rope_local_base_freq"]}}
    else:
        cfg["rope_parameters"] = rope
    for k in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim"):
        if a.get(k) is not None:
            v = a[k]
            # transformers types query_pre_attn_scalar as int; the header stores a number.
            cfg[k] = int(v) if k == "query_pre_attn_scalar" and float(v).is_integer() else v
    moe = a.get("moe")
    if moe:
        cfg[_EXPERTS_KEY.get(p.moe, "num_experts")] = moe["num_experts"]
        cfg["num_experts_per_tok"] = moe["top_k"]
        cfg["moe_intermediate_size"] = moe["moe_intermediate_size"]
        cfg["norm_topk_prob"] = moe.get("norm_topk_prob", False)
        if moe.get("shared_expert_intermediate_size") and p.moe != "deepseek":  # n_shared_experts instead
            cfg["shared_expert_intermediate_size"] = moe["shared_expert_intermediate_size"]
        for k in ("routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace"):
            if moe.get(k) is not None:
                cfg[k] = moe[k]
    mla = a.get("mla")
    if mla:
        cfg.update({k: v for k, v in mla.items() if k != "rope_interleave"})
        cfg["rope_interleave"] = mla.get("rope_interleave", True)
        cfg.pop("head_dim", None)
    return cfg


# ----------------------------------------------------------------------------------- tensors


@dataclass
class OutTensor:
    """One output tensor and how to produce it."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]  # CMF tensors it is built from
    fuse: Fuse | None = None


def _mtp_kind(mt: str, names: list[str]) -> str | None:
    if not any(n.startswith("model.mtp.") for n in names):
        return None
    p = PROFILES.get(mt)
    return "qwen" if p is None else p.mtp_style


def tensor_plan(f: CmfFile, mt: str) -> list[OutTensor]:
    """The HF tensors to write (hub names) and the CMF tensors each is built from."""
    arch = f.header.arch.raw
    family = family_of(mt)
    names = f.keys()
    shapes = {n: f.tensor(n).shape for n in names}
    mtp = _mtp_kind(mt, names)
    table = rename_table(family, int(arch["num_layers"]), mtp)
    dims = {k: arch.get(k) for k in ("num_attention_heads", "num_kv_heads", "head_dim", "linear_num_key_heads",
                                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")}
    fused = fuse_groups(family, names, shapes, dims)
    consumed = {p for fz in fused for p in fz.parts}
    outs: list[OutTensor] = []
    for fz in fused:
        missing = [p for p in fz.parts if p not in shapes]
        if missing:
            raise ConvertError(f"cannot rebuild {fz.name}: missing {', '.join(missing)}")
        rows = sum(b - a for r in fz.rows for a, b in r)
        outs.append(OutTensor(table.backward(fz.name), (rows,) + tuple(shapes[fz.parts[0]][1:]), fz.parts, fz))
    for n in names:
        if n in consumed:
            continue
        outs.append(OutTensor(table.backward(n), shapes[n], (n,)))
    if mtp == "deepseek":
        # The hub keeps copies of the shared head and embedding inside the MTP module.
        mtp_cfg = arch.get("mtp") or {}
        n_layers = int(arch["num_layers"])
        head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
        if mtp_cfg.get("share_lm_head", True) and "model.mtp.lm_head.weight" not in shapes:
            outs.append(OutTensor(f"model.layers.{n_layers}.shared_head.head.weight", shapes[head], (head,)))
        if mtp_cfg.get("share_embed", True) and "model.mtp.embed_tokens.weight" not in shapes:
            outs.append(OutTensor(f"model.layers.{n_layers}.embed_tokens.weight", shapes["model.embed_tokens.weight"],
                             ("model.embed_tokens.weight",)))
    seen: set[str] = set()
    for o in outs:
        if o.name in seen:
            raise ConvertError(f"two tensors map to the Hugging Face name {o.name!r}")
        seen.add(o.name)
    outs.sort(key=lambda o: o.name)
    return outs


def tensor_values(f: CmfFile, o: OutTensor, mla: MlaLayout | None = None) -> np.ndarray:
    """The float32 values of one output tensor of :func:`tensor_plan` (fused parts joined, MLA
    rows in Hugging Face order)."""
    if o.fuse is None:
        # MLA projections go back to the Hugging Face row order (mla_layout.py)
        return hf_rows(mla, o.parts[0], f.array(o.parts[0]))
    out = np.empty(o.shape, np.float32)
    for part, rows in zip(o.fuse.parts, o.fuse.rows):
        src = f.array(part)
        at = 0
        for a, b in rows:
            out[a:b] = src[at:at + (b - a)]
            at += b - a
    return out


def _encode(arr: np.ndarray, dtype: str) -> memoryview:
    if dtype == "f32":
        data = np.ascontiguousarray(arr, dtype="<f4")
    elif dtype == "f16":
        with np.errstate(over="ignore"):
            data = np.ascontiguousarray(arr.astype("<f2"))
    else:
        from ..quant import f32_to_bf16_bits

        data = np.ascontiguousarray(f32_to_bf16_bits(arr).astype("<u2"))
    return memoryview(data.reshape(-1).view(np.uint8))


def _write_safetensors(path: Path, entries: list[tuple[OutTensor, int]], dtype: str,
                       produce: Callable[[OutTensor], memoryview]) -> None:
    """One safetensors file, header first, payloads streamed in header order."""
    st_dtype = EXPORT_DTYPES[dtype][0]
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for o, nbytes in entries:
        head[o.name] = {"dtype": st_dtype, "shape": list(o.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for o, nbytes in entries:
                mv = produce(o)
                if len(mv) != nbytes:
                    raise ConvertError(f"{o.name}: produced {len(mv)} bytes, expected {nbytes}")
                fh.write(mv)
            fh.flush()
            os.fsync(fh.fileno())
        apply_output_mode(tmp, path)  # a re-export keeps the existing file's mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _token_text(tokenizer_json: bytes | None, tid: int | None) -> str | None:
    if tokenizer_json is None or tid is None:
        return None
    try:
        tj = json.loads(tokenizer_json)
    except ValueError:
        return None
    for t in tj.get("added_tokens") or []:
        if isinstance(t, dict) and t.get("id") == tid:
            return token_content(t)
    vocab = (tj.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for k, v in vocab.items():
            if v == tid:
                return k
    return None


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented UTF-8 JSON (the files beside the weights)."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export(model: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str | None = None, *,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Callable[[int], None] | None = None) -> ExportResult:
    """Write ``model`` (a .cmf, any shard of a set) as a Hugging Face folder ``out_dir``.

    ``dtype``: f32, f16 or bf16 for the safetensors (default: the source checkpoint's dtype when
    the file records it, else f32). Quantized tensors are dequantized. ``progress(n)`` gets the
    bytes written per tensor.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a folder")
    with cmf_open(model) as f:
        arch = f.header.arch.raw
        prov = f.header.provenance
        cfg, mt = config_for(arch, prov)
        if dtype is None:
            dtype = TORCH_NAMES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), "f32")
        dtype = str(dtype).lower()
        if dtype not in EXPORT_DTYPES:
            raise ConvertError(f"--dtype {dtype!r}: choose f32, f16 or bf16")
        cfg["dtype" if "torch_dtype" not in cfg else "torch_dtype"] = EXPORT_DTYPES[dtype][2]
        if isinstance(arch.get("mla"), dict) and arch["mla"].get("nope"):
            raise ConvertError("arch.mla.nope: a NoPE latent-attention model has no Hugging Face export here "
                               "(transformers' DeepseekV3 always rotates the rope dims)")
        mla = export_layout(arch, cfg)
        outs = tensor_plan(f, mt)
        out.mkdir(parents=True, exist_ok=True)
        itemsize = EXPORT_DTYPES[dtype][1]
        sized = [(o, itemsize * math.prod(o.shape)) for o in outs]
        shards: list[list[tuple[OutTensor, int]]] = [[]]
        acc = 0
        for o, nb in sized:
            if shards[-1] and acc + nb > max_shard_bytes:
                shards.append([])
                acc = 0
            shards[-1].append((o, nb))
            acc += nb
        count = len(shards)
        files = [out / ("model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors")
                 for i in range(count)]

        def produce(o: OutTensor) -> memoryview:
            mv = _encode(tensor_values(f, o, mla), dtype)
            if progress is not None:
                progress(len(mv))
            return mv

        for path, entries in zip(files, shards):
            _write_safetensors(path, entries, dtype, produce)
        for stale in out.glob("model*.safetensors"):
            if stale not in files:
                stale.unlink()
        index = out / "model.safetensors.index.json"
        if count > 1:
            write_json(index, {"metadata": {"total_size": sum(nb for _, nb in sized)},
                                "weight_map": {o.name: p.name for p, es in zip(files, shards) for o, _ in es}})
        elif index.exists():
            index.unlink()
        write_json(out / "config.json", cfg)
        write_tokenizer(out, f, prov)
    size = sum(p.stat().st_size for p in files)
    res = ExportResult(out, files, len(outs), dtype, size, time.perf_counter() - t0)
    log.info("exported %d tensors (%s) to %s", res.tensors, dtype, out)
    return res


def write_tokenizer(out: Path, f: CmfFile, prov: Any) -> None:
    """The tokenizer and generation files of the export folder ``out`` from ``f``'s header and
    ``prov`` (the file's provenance record)."""
    prov = prov if isinstance(prov, dict) else {}
    tc = f.header.tokenizer_config
    tj = f.tokenizer_json
    if tj is not None:
        (out / "tokenizer.json").write_bytes(tj)
    gen = prov.get("hf_generation_config")
    if not isinstance(gen, dict):
        gen = {}
        if tc is not None:
            eos = list(tc.eos_token_ids)
            if eos:
                gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
            for k in ("bos_token_id", "pad_token_id"):
                if getattr(tc, k) is not None:
                    gen[k] = getattr(tc, k)
    write_json(out / "generation_config.json", gen)
    tok_cfg = prov.get("hf_tokenizer_config")
    if not isinstance(tok_cfg, dict):
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if tc is not None:
            eos = _token_text(tj, tc.eos_token_ids[0] if tc.eos_token_ids else None)
            for key, text in (("eos_token", eos), ("bos_token", _token_text(tj, tc.bos_token_id)),
                              ("pad_token", _token_text(tj, tc.pad_token_id))):
                if text is not None:
                    tok_cfg[key] = text
    if tj is not None or prov.get("hf_tokenizer_config") is not None:
        write_json(out / "tokenizer_config.json", tok_cfg)
    if tc is not None and tc.chat_template:
        (out / "chat_template.jinja").write_text(tc.chat_template, encoding="utf-8")

