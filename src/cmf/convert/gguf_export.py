"""CMF → GGUF for llama.cpp (the profiles that export: llama, mistral, qwen2, qwen3, qwen3_moe): metadata,
vocabulary, tensors.

Names follow llama.cpp's tables (the inverse of :mod:`cmf.convert.gguf`), llama-arch Q/K rows get
llama.cpp's permutation, expert tensors of a layer are stacked into 3-D banks, 1-D tensors are
F32 and matrices the requested type (F32, F16, Q8_0, Q4_0; a matrix whose rows are not a multiple
of 32 falls back to F16). Written through ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..format.atomic import apply_output_mode
from ..format.reader import open as cmf_open
from .gguf import NAME_TABLE, permute_qk
from .gguf_scan import GgufError
from .gguf_tokenizer import gguf_vocab_from_tokenizer_json
from .profiles import GGUF_EXPORTS, PROFILES

log = logging.getLogger(__name__)

MODEL_TYPE_TO_ARCH = GGUF_EXPORTS  # model_type -> llama.cpp architecture (the profiles' table)
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0")


def _inverse_table() -> list[tuple[re.Pattern[str], str]]:
    out = []
    for gguf_pat, hf_tmpl in NAME_TABLE:
        # turn "model.layers.{0}.self_attn.q_proj.{1}" into a regex and the GGUF pattern into a template
        rx = re.escape(hf_tmpl).replace(r"\{0\}", r"(\d+)").replace(r"\{1\}", r"(weight|bias)")
        tmpl = gguf_pat.replace(r"\.", ".").replace(r"(\d+)", "{0}").replace("(weight|bias)", "{1}")
        out.append((re.compile(rx + r"\Z"), tmpl))
    return out


_INVERSE = _inverse_table()
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight\Z")


def gguf_name(hf: str) -> str | None:
    for rx, tmpl in _INVERSE:
        m = rx.match(hf)
        if m:
            return tmpl.format(*m.groups())
    return None


def export_gguf(model: str | os.PathLike[str], out: str | os.PathLike[str], gguf_type: str = "F16") -> Path:
    """Write a GGUF file llama.cpp can run from a CMF file."""
    import gguf

    gguf_type = gguf_type.upper()
    if gguf_type not in GGUF_TYPES:
        raise GgufError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    qtype = gguf.GGMLQuantizationType[gguf_type]
    out = Path(out)
    with cmf_open(model) as f:
        hdr = f.header.to_dict()
        prov = hdr.get("provenance") or {}
        mt = (prov.get("hf_config") or {}).get("model_type") or f.arch.arch_name
        arch = MODEL_TYPE_TO_ARCH.get(mt)
        if arch is None:
            raise GgufError(f"GGUF export supports {', '.join(MODEL_TYPE_TO_ARCH)}; this model is {mt!r}")
        conv = PROFILES[mt].gguf
        assert conv is not None  # GGUF_EXPORTS lists only profiles with one
        permuted = conv.permute_qk  # llama.cpp's interleaved Q/K rows
        a = f.arch
        raw = a.raw
        tmp = out.with_name(f".{out.name}.tmp")
        w = gguf.GGUFWriter(str(tmp), arch, use_temp_file=True)
        w.add_name(Path(str(model)).stem)
        w.add_context_length(a.max_position_embeddings)
        w.add_embedding_length(a.hidden_size)
        w.add_block_count(a.num_layers)
        w.add_feed_forward_length(a.intermediate_size)
        w.add_head_count(a.num_attention_heads)
        w.add_head_count_kv(a.num_kv_heads)
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
        w.add_layer_norm_rms_eps(a.rms_norm_eps)
        w.add_rope_freq_base(a.rope_theta)
        w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7, "Q4_0": 2}[gguf_type])
        if raw.get("yarn"):
            y = raw["yarn"]
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(y["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(y["original_max_position_embeddings"]))
        if a.moe is not None:
            w.add_expert_count(a.moe.num_experts)
            w.add_expert_used_count(a.moe.top_k)
            w.add_expert_feed_forward_length(a.moe.moe_intermediate_size)
            w.add_expert_weights_norm(bool(a.moe.norm_topk_prob))
        _add_vocab(w, f, gguf)
        if raw.get("rope_freq_factors"):  # llama3 / linear scaling: llama.cpp's rope_freqs tensor
            w.add_tensor("rope_freqs.weight", np.asarray(raw["rope_freq_factors"], dtype=np.float32))
        banks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
        for name in f.keys():
            if name.startswith(("skill.", "model.mtp.")):
                continue
            m = _EXPERT.match(name)
            if m:
                banks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = f.array(name)
                continue
            g = gguf_name(name)
            if g is None:
                raise GgufError(f"tensor {name!r} has no llama.cpp name (GGUF export supports plain "
                                f"llama/qwen2/qwen3/qwen3_moe tensors)")
            arr = np.ascontiguousarray(f.array(name), dtype=np.float32)
            if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                arr = permute_qk(arr, a.num_attention_heads)
            elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                arr = permute_qk(arr, a.num_kv_heads)
            _add(w, g, arr, qtype, gguf)
        for (layer, role), experts in sorted(banks.items()):
            bank = np.stack([experts[e] for e in range(len(experts))])
            _add(w, f"blk.{layer}.ffn_{role}_exps.weight", bank, qtype, gguf)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    apply_output_mode(tmp, out)  # a re-export keeps the existing file's mode
    os.replace(tmp, out)
    return out


def _add(w, name: str, arr: np.ndarray, qtype, gguf) -> None:
    if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        return
    if qtype == gguf.GGMLQuantizationType.F16 or arr.shape[-1] % 32:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
        return
    data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
    w.add_tensor(name, data, raw_dtype=qtype)  # the byte shape implies the element shape


def _add_vocab(w, f, gguf) -> None:
    tj = f.tokenizer_json
    if tj is None:
        raise GgufError("the model has no tokenizer section; llama.cpp needs a vocabulary")
    v = gguf_vocab_from_tokenizer_json(tj, f.tensor("model.embed_tokens.weight").shape[0])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    w.add_token_merges(v["merges"])
    bundle: Any = f.chat_config
    if bundle is not None:
        if bundle.eos_token_ids:
            w.add_eos_token_id(int(bundle.eos_token_ids[0]))
        if bundle.bos_token_id is not None:
            w.add_bos_token_id(int(bundle.bos_token_id))
        if bundle.pad_token_id is not None:
            w.add_pad_token_id(int(bundle.pad_token_id))
        if bundle.chat_template:
            w.add_chat_template(bundle.chat_template)
    w.add_add_bos_token(bool(v["add_bos"]))
