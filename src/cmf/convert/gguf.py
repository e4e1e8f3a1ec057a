"""GGUF → CMF: read a llama.cpp GGUF file, undo its conventions, and convert through the HF path.

The file is first checked by :mod:`cmf.convert.gguf_scan` (every count and length against the
file size), then read with the `gguf` package. Each tensor is dequantized (any ggml type the
package knows, K-quants included) and mapped back to its Hugging Face name: llama-arch Q/K rows
are un-permuted, 3-D expert banks are split per expert. The result is written as a temporary
Hugging Face folder (config.json synthesized from the metadata, tokenizer.json synthesized from
the vocabulary, f32 safetensors written one tensor at a time) and converted with
:func:`cmf.convert.convert`, so the dtype policy, names and header are the same as for HF input.
Supported architectures: those a profile imports (:mod:`.profiles`, ``GgufArch.imports``): llama
(and mistral, which GGUF calls llama), qwen2, qwen3, qwen2moe, qwen3moe.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .gguf_scan import GgufError, scan
from .gguf_tokenizer import check_tokenizer_vocab, tokenizer_json_from_gguf
from .profiles import GGUF_IMPORTS, PROFILES, GgufArch

log = logging.getLogger(__name__)

ARCH_TO_MODEL_TYPE = GGUF_IMPORTS  # llama.cpp architecture -> model_type (the profiles' table)

# GGUF tensor name → HF name ({i} = block, {w} = weight|bias); expert banks handled separately.
NAME_TABLE = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{0}.self_attn.q_proj.{1}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{0}.self_attn.k_proj.{1}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{0}.self_attn.v_proj.{1}"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "model.layers.{0}.self_attn.o_proj.{1}"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", "model.layers.{0}.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", "model.layers.{0}.mlp.shared_expert_gate.weight"),
    (r"blk\.(\d+)\.ffn_gate_shexp\.weight", "model.layers.{0}.mlp.shared_expert.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up_shexp\.weight", "model.layers.{0}.mlp.shared_expert.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down_shexp\.weight", "model.layers.{0}.mlp.shared_expert.down_proj.weight"),
]
EXPERT_TABLE = [
    (r"blk\.(\d+)\.ffn_gate_exps\.weight", "model.layers.{0}.mlp.experts.{e}.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up_exps\.weight", "model.layers.{0}.mlp.experts.{e}.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down_exps\.weight", "model.layers.{0}.mlp.experts.{e}.down_proj.weight"),
]
SKIP = (re.compile(r"rope_freqs\.weight"),)  # carried into the header as rope_freq_factors
_COMPILED = [(re.compile(p + r"\Z"), t) for p, t in NAME_TABLE]
_COMPILED_EXP = [(re.compile(p + r"\Z"), t) for p, t in EXPERT_TABLE]


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a (non-expert) GGUF tensor, or None when it is not in the table."""
    for rx, tmpl in _COMPILED:
        m = rx.match(gguf_name)
        if m:
            return tmpl.format(*m.groups())
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its ``permute``) for ``n_head`` heads."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (for GGUF export of llama-arch models)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader) -> dict[str, Any]:
    """All GGUF metadata fields as Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as exc:  # noqa: BLE001 - a field the package cannot decode
            raise GgufError(f"metadata {key!r} cannot be decoded: {exc}") from None
    return out


# Bounds on counts the converter loops over or builds lists from, far above any real model's
_MAX_HEADS, _MAX_HEAD_DIM, _MAX_EXPERTS = 1 << 14, 1 << 14, 1 << 16


def hf_config(meta: dict[str, Any], tensor_names: set[str], vocab: int) -> dict[str, Any]:
    """A Hugging Face config.json for the GGUF metadata (legacy rope style)."""
    arch = meta.get("general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise GgufError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCH_TO_MODEL_TYPE)})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if required and v is None:
            raise GgufError(f"GGUF metadata lacks {arch}.{key}")
        return v

    def num(key: str, kind: type, default: Any = None, required: bool = False, low: int | None = None,
            high: int | None = None) -> Any:
        """A numeric field as ``kind``; a string, list or non-integral value is a GgufError (found by
        fuzzing: ``int('x')`` and a zero head count escaped as ValueError/ZeroDivisionError)."""
        v = get(key, default, required)
        if v is None:
            return None
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        if ok and kind is int:
            ok = float(v).is_integer()
        if not ok or (low is not None and v < low) or (high is not None and v > high):
            need = "an integer" if kind is int else "a finite number"
            raise GgufError(f"GGUF metadata {arch}.{key} = {v!r} is not {need}"
                            + (f" >= {low}" if low is not None else "") + (f" <= {high}" if high is not None else ""))
        return kind(v)

    p = PROFILES[ARCH_TO_MODEL_TYPE[arch]]
    conv = _gguf_of(arch)
    hidden = num("embedding_length", int, required=True, low=1)
    heads = num("attention.head_count", int, required=True, low=1, high=_MAX_HEADS)
    cfg: dict[str, Any] = {
        "model_type": ARCH_TO_MODEL_TYPE[arch], "hidden_size": hidden,
        "num_hidden_layers": _layers(num("block_count", int, required=True, low=1), tensor_names),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv", int, heads, low=1, high=_MAX_HEADS),
        # bounded: the converter builds per-frequency lists of head_dim / 2 (found by fuzzing: 2**63)
        "head_dim": num("attention.key_length", int, hidden // heads, low=1, high=_MAX_HEAD_DIM),
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": num("rope.freq_base", float, 10000.0),
        "max_position_embeddings": num("context_length", int, 4096), "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names, "hidden_act": "silu",
        "bos_token_id": _token_id(meta, "bos"), "eos_token_id": _token_id(meta, "eos"),
    }
    ff = num("feed_forward_length", int)
    if ff is not None:
        cfg["intermediate_size"] = ff
    if conv.attention_bias:
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    scaling = get("rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):  # found by fuzzing: a list was a TypeError
        raise GgufError(f"GGUF metadata {arch}.rope.scaling.type = {scaling!r} is not a string")
    if scaling and scaling != "none":
        rs = {"rope_type": scaling, "factor": num("rope.scaling.factor", float, 1.0)}
        if get("rope.scaling.original_context_length"):
            rs["original_max_position_embeddings"] = num("rope.scaling.original_context_length", int)
        cfg["rope_scaling"] = rs
    if p.moe is not None:
        cfg.update(num_experts=num("expert_count", int, required=True, low=1, high=_MAX_EXPERTS),
                   num_experts_per_tok=num("expert_used_count", int, required=True, low=1, high=_MAX_EXPERTS),
                   moe_intermediate_size=num("expert_feed_forward_length", int, required=True),
                   decoder_sparse_step=1, mlp_only_layers=[])
        cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
        cfg["norm_topk_prob"] = bool(get("expert_weights_norm", conv.norm_topk_default))
        if p.moe_shared_expert:
            cfg["shared_expert_intermediate_size"] = num("expert_shared_feed_forward_length", int, 0)
    return cfg


def _layers(n: int, tensor_names: set[str]) -> int:
    """``block_count``, at most the blocks the tensors name (found by fuzzing: 2**40 built a list
    of that many layer types in the converter)."""
    blocks = {name.split(".", 2)[1] for name in tensor_names if name.startswith("blk.") and name.count(".") >= 2}
    if n > len(blocks):
        raise GgufError(f"GGUF metadata block_count = {n}, but the tensors name {len(blocks)} block(s)")
    return n


def _gguf_of(arch: str) -> GgufArch:
    """The GGUF conventions of an importable llama.cpp architecture."""
    g = PROFILES[ARCH_TO_MODEL_TYPE[arch]].gguf
    assert g is not None  # GGUF_IMPORTS lists only profiles with one
    return g


def _token_id(meta: dict[str, Any], which: str) -> int | None:
    """``tokenizer.ggml.{which}_token_id`` when it is a non-negative integer, else None (logged)."""
    v = meta.get(f"tokenizer.ggml.{which}_token_id")
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    log.warning("GGUF metadata tokenizer.ggml.%s_token_id = %r is not a token id; ignored", which, v)
    return None


def _plan_tensors(reader, cfg: dict[str, Any], arch: str) -> list[tuple[str, Any, Callable[[np.ndarray], np.ndarray],
                                                                      tuple[int, ...]]]:
    """(hf name, reader tensor, transform, hf shape) for every output tensor, in file order."""
    out = []
    permuted = _gguf_of(arch).permute_qk
    for t in reader.tensors:
        if any(rx.match(t.name) for rx in SKIP):
            log.info("skipping %s (not needed by the HF model)", t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        exp = next(((rx.match(t.name), tmpl) for rx, tmpl in _COMPILED_EXP if rx.match(t.name)), None)
        if exp is not None:
            m, tmpl = exp
            for e in range(shape[0]):
                out.append((tmpl.format(m.group(1), e=e), t, (lambda a, e=e: a[e]), shape[1:]))
            continue
        name = hf_name(t.name)
        if name is None:
            raise GgufError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart we know")
        fn: Callable[[np.ndarray], np.ndarray] = lambda a: a  # noqa: E731
        heads = None
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = cfg["num_attention_heads"]
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = cfg["num_key_value_heads"]
        if heads is not None:
            if shape[0] % (2 * heads):  # the un-permute splits each head's rows in two halves
                raise GgufError(f"GGUF tensor {t.name!r}: {shape[0]} rows do not split into {heads} heads "
                                f"of an even size")
            fn = lambda a, h=heads: unpermute_qk(a, h)  # noqa: E731
        out.append((name, t, fn, shape))
    return out


def _dequant(t) -> np.ndarray:
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)


def _write_safetensors(path: Path, items, progress: Callable[[int], None] | None = None) -> None:
    """A single f32 safetensors file written one tensor at a time (RAM: one tensor)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, _, _, shape in items:
        n = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    cache: dict[int, np.ndarray] = {}
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb)
        for name, t, fn, shape in items:
            key = id(t)
            if key not in cache:  # a 3-D expert bank feeds several outputs: dequantize it once
                cache.clear()
                cache[key] = _dequant(t)
            arr = np.ascontiguousarray(fn(cache[key]), dtype="<f4")
            if arr.shape != tuple(shape):
                raise GgufError(f"{name}: got shape {arr.shape}, expected {tuple(shape)}")
            fh.write(arr.tobytes())
            if progress:
                progress(arr.nbytes)


def gguf_to_hf(path: str | os.PathLike[str], folder: str | os.PathLike[str], *,
               tokenizer: str | os.PathLike[str] | None = None) -> Path:
    """Write a Hugging Face folder (config, tokenizer, f32 safetensors) for a GGUF file."""
    import gguf

    path, folder = Path(path), Path(folder)
    scan(path)  # raises GgufError on any inconsistency, before gguf touches the file
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the package's own parse errors
        raise GgufError(f"{path}: {exc}") from None
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    names = {t.name for t in reader.tensors}
    if tokenizer is not None:
        try:
            tok_json = Path(tokenizer).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GgufError(f"--tokenizer {tokenizer}: cannot read it ({exc})") from None
        # an explicit tokenizer replaces the GGUF's pre-tokenizer name, but must index the same tokens
        check_tokenizer_vocab(tok_json, meta, str(tokenizer))
    else:
        tok_json = tokenizer_json_from_gguf(meta)
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise GgufError(f"{path}: no token_embd.weight")
    vocab = int(emb.shape.tolist()[-1])
    cfg = hf_config(meta, names, vocab)
    items = _plan_tensors(reader, cfg, arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    eos = _token_id(meta, "eos")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    tcfg = {"eos_token": tokens[eos] if eos is not None and isinstance(tokens, list) and eos < len(tokens) else None}
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    gen = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (folder / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_safetensors(folder / "model.safetensors", items)
    return folder


def _rope_freqs(path: str | os.PathLike[str]) -> list[float] | None:
    """The ``rope_freqs.weight`` tensor (llama.cpp's rope frequency divisors), if the file has one."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else [float(x) for x in _dequant(t).reshape(-1)]


def import_gguf(path: str | os.PathLike[str], out: str | os.PathLike[str], quant: str = "q8", *,
                tokenizer: str | os.PathLike[str] | None = None, **convert_options: Any):
    """Convert a GGUF file into a CMF file (see the module docstring); returns the ConvertResult."""
    from .hf import attach_calibration, execute, fit_budget, plan

    calib = convert_options.pop("calib", None)
    calib_tokens = convert_options.pop("calib_tokens", None)
    calib_progress = convert_options.pop("calib_progress", None)
    sensitivity_tokens = convert_options.pop("sensitivity_tokens", None)
    target_mb, bpw = convert_options.pop("target_mb", None), convert_options.pop("bpw", None)
    if target_mb is not None or bpw is not None:
        from .budget import target_bytes

        target_bytes(target_mb, bpw, 1)  # a bad value fails before the import's work
    if calib is not None:
        from .calibrate import check_text, sensitivity_tokens_for

        check_text(calib)  # before the import's work
        sensitivity_tokens = sensitivity_tokens_for(sensitivity_tokens, target_mb, bpw)
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-import-", dir=out.parent if out.parent.is_dir() else None))
    try:
        gguf_to_hf(path, tmp, tokenizer=tokenizer)
        p = plan(tmp, quant, **convert_options)
        factors = _rope_freqs(path)
        if factors is not None:  # llama.cpp's per-frequency divisors (llama3/linear scaling)
            p.header["arch"]["rope_freq_factors"] = factors
        prov = p.header["provenance"]
        # record the GGUF file, not the temporary folder (also keeps the output deterministic)
        prov.update(source_model=Path(path).name, source_format="gguf")
        if calib is not None:
            attach_calibration(p, tmp, calib, out.parent if out.parent.is_dir() else Path("."),
                               tokens=calib_tokens, progress=calib_progress, sensitivity_tokens=sensitivity_tokens)
        if target_mb is not None or bpw is not None:
            fit_budget(p, target_mb, bpw)
        result = execute(p, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
