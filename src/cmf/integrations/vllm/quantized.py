"""``quantized: keep``: hand vLLM a CMF file's int8 / int4 weights as compressed-tensors, not floats.

vLLM's CPU backend runs two compressed-tensors integer schemes whose weights are exactly pycmf's:

- ``q8_row`` (``w = q[o,i]·s[o]``, int8 q, f16 s) is W8A8 int8 with a per-channel symmetric
  weight scale: ``weight`` int8 ``[out, in]`` and ``weight_scale`` f32 ``[out, 1]`` (f16 -> f32 is
  exact). vLLM's kernel also quantizes the activations to int8 per token (there is no int8
  weight-only kernel on its CPU backend), so the arithmetic, not the weights, differs from f32.
- ``q4_block`` (2-D, ``in % 32 == 0``), ``q4_tiled`` and ``q4tp`` (``w = (n - 8)·s[o, g]`` for
  nibble n and one scale per row and group of 32 inputs) are W4A16 ``uint4b8`` with group size
  32 in the ``pack-quantized`` format: ``weight_packed`` int32 ``[out, in/8]`` (8 nibbles per
  word, input 8j+i in bits 4i..4i+3 of word j), ``weight_scale`` ``[out, in/32]``,
  ``weight_shape`` ``[out, in]``. vLLM stores the scale in the serving dtype: exact at float32;
  at float16 exact for q4_block/q4_tiled (f16 scales), not for q4tp (f32 ladder rungs); rounded
  at bfloat16.

Only linear layers of the decoder blocks take part (not embeddings, the head, MoE experts or
routers, nor tensors the export re-fuses or reorders). vLLM fuses q/k/v and gate/up into one
layer with one scheme, so a group whose members differ is served dequantized as a whole.
Everything else streams as today (dequantized floats).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ...format.constants import GROUP, Dtype
from ...format.reader import CmfFile

# The codecs (cmf.quant.*) are imported inside the functions that decode: they pull in numba and
# llvmlite, and an llvmlite object in sys.modules before vLLM's CPU worker starts breaks its
# register_triton_kernel_overrides scan (vLLM 0.32: "'_lib_fn_wrapper' object has no attribute
# 'get'"). The plugin's register() and prepare() run before that point, the loader after it.

MODES = ("dequantize", "keep")
W8A8 = "w8a8"
W4A16 = "w4a16"
Q4_DTYPES = (Dtype.Q4_BLOCK, Dtype.Q4_TILED, Dtype.Q4TP)
# Members vLLM's Llama-style models fuse into one layer (packed_modules_mapping): one scheme each.
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def scheme_of(dtype: Dtype, shape: tuple[int, ...]) -> str | None:
    """The compressed-tensors scheme that holds a tensor of ``dtype`` exactly, or None."""
    if len(shape) != 2:
        return None
    out, cols = shape
    if dtype == Dtype.Q8_ROW:
        return W8A8
    # vLLM's CPU int4 kernel wants input and output sizes in multiples of 32.
    if dtype in Q4_DTYPES and cols % GROUP == 0 and out % GROUP == 0:
        return W4A16
    return None


def _module(hf_name: str) -> str | None:
    """``model.layers.3.self_attn.q_proj`` for its ``.weight``; None for anything not a block linear."""
    if not hf_name.endswith(".weight") or not hf_name.startswith("model.layers."):
        return None
    mod = hf_name[:-len(".weight")]
    return mod if mod.endswith(LINEAR_SUFFIXES) else None


def plan_kept(file: CmfFile, outs: list[Any], mla: Any) -> dict[str, tuple[str, str]]:
    """HF weight name -> (scheme, CMF tensor) for the tensors served quantized (see the module doc)."""
    if mla is not None:  # MLA rows are reordered on export; keep it simple and exact: floats
        return {}
    cand: dict[str, tuple[str, str] | None] = {}
    for o in outs:
        mod = _module(o.name)
        if mod is None or o.fuse is not None:
            continue
        t = file.tensor(o.parts[0])
        s = scheme_of(t.dtype, tuple(t.shape))
        cand[o.name] = (s, o.parts[0]) if s is not None else None
    # A fused group (layer, qkv or gate_up) is kept only if every member has the same scheme.
    groups: dict[tuple[str, str], list[str]] = {}
    for name in cand:
        mod = name[:-len(".weight")]
        parent, leaf = mod.rsplit(".", 1)
        if leaf in FUSED:
            groups.setdefault((parent, FUSED[leaf]), []).append(name)
    for (_, kind), names in groups.items():
        want = 3 if kind == "qkv" else 2
        schemes = {cand[n][0] if cand[n] else None for n in names}
        if len(names) != want or len(schemes) != 1 or None in schemes:
            for n in names:
                cand[n] = None
    return {n: v for n, v in cand.items() if v is not None}


def quantization_config(kept: dict[str, tuple[str, str]]) -> dict[str, Any] | None:
    """The compressed-tensors ``quantization_config`` for config.json (None when nothing is kept)."""
    by: dict[str, list[str]] = {}
    for name, (scheme, _) in sorted(kept.items()):
        by.setdefault(scheme, []).append(name[:-len(".weight")])
    if not by:
        return None
    groups: dict[str, Any] = {}
    if W8A8 in by:
        groups["group_0"] = {
            "targets": by[W8A8], "format": "int-quantized",
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}
    if W4A16 in by:
        groups["group_1"] = {
            "targets": by[W4A16], "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False}}
    return {"quant_method": "compressed-tensors", "format": "mixed", "quantization_status": "compressed",
            "config_groups": groups, "ignore": ["lm_head"]}


def q4_parts(dtype: Dtype, raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(nibbles uint8 ``[out, in]`` in 0..15, scales f32 ``[out, in/32]``) of a 4-bit group tensor."""
    from ...quant.ladder import Q4tpCodec
    from ...quant.q4 import Q4TiledCodec

    out, cols = shape
    gpr = cols // GROUP
    if dtype == Dtype.Q4_BLOCK:
        groups = out * gpr
        packed = raw[:16 * groups].reshape(out, gpr, 16)
        scales = raw[16 * groups:18 * groups].view("<f2").astype(np.float32).reshape(out, gpr)
    elif dtype == Dtype.Q4_TILED:
        tiles = Q4TiledCodec()._tiles(raw, shape).reshape(out, gpr)  # noqa: SLF001 - validated view
        packed, scales = tiles["q"], tiles["scale"].astype(np.float32)
    elif dtype == Dtype.Q4TP:
        codec = Q4tpCodec()
        packed, params, codes = codec.split(raw, shape)
        scales = codec.scales(params, codes, gpr).astype(np.float32)
    else:
        raise ValueError(f"not a 4-bit group dtype: {dtype!r}")
    nib = np.empty((out, gpr, GROUP), np.uint8)
    nib[..., 0::2] = packed & 15  # element 2k in the low nibble, 2k+1 in the high one
    nib[..., 1::2] = packed >> 4
    return nib.reshape(out, cols), np.ascontiguousarray(scales)


def pack_int32(nib: np.ndarray) -> np.ndarray:
    """``[out, in]`` 4-bit codes -> int32 ``[out, in/8]``: input 8j+i in bits 4i..4i+3 of word j."""
    out, cols = nib.shape
    v = nib.astype(np.uint32).reshape(out, cols // 8, 8) << (np.arange(8, dtype=np.uint32) * 4)
    return np.bitwise_or.reduce(v, axis=2).view(np.int32)


def kept_arrays(file: CmfFile, hf_name: str, scheme: str, cmf_name: str) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint tensors of one kept weight, named as compressed-tensors names them."""
    from ...quant.q8 import Q8RowCodec

    t = file.tensor(cmf_name)
    mod = hf_name[:-len(".weight")]
    raw = t.numpy()
    if scheme == W8A8:
        q, s = Q8RowCodec()._parts(raw, t.shape)  # noqa: SLF001 - the validated int8 and f16 planes
        yield f"{mod}.weight", np.ascontiguousarray(q)
        yield f"{mod}.weight_scale", s.astype(np.float32).reshape(-1, 1)
    elif scheme == W4A16:
        out, cols = t.shape
        nib, scales = q4_parts(t.dtype, raw, (out, cols))
        yield f"{mod}.weight_packed", pack_int32(nib)
        yield f"{mod}.weight_scale", scales
        yield f"{mod}.weight_shape", np.array([out, cols], np.int64)
    else:
        raise ValueError(f"unknown scheme {scheme!r}")


def dequantize_kept(arrays: dict[str, np.ndarray], mod: str, scheme: str) -> np.ndarray:
    """The f32 weight the checkpoint tensors of ``mod`` stand for (the methods' documented layout)."""
    if scheme == W8A8:
        return arrays[f"{mod}.weight"].astype(np.float32) * arrays[f"{mod}.weight_scale"]
    words = arrays[f"{mod}.weight_packed"].view(np.uint32)
    out, cols = (int(x) for x in arrays[f"{mod}.weight_shape"])
    nib = ((words[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15).reshape(out, cols)
    scales = np.repeat(arrays[f"{mod}.weight_scale"], GROUP, axis=1)
    return (nib.astype(np.float32) - 8) * scales  # uint4b8: stored value minus 8


__all__ = ["MODES", "W4A16", "W8A8", "dequantize_kept", "kept_arrays", "pack_int32", "plan_kept",
           "q4_parts", "quantization_config", "scheme_of"]
