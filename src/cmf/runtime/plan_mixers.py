"""Plan of the token mixers beyond plain GQA: Gated DeltaNet and multi-head latent attention.

Part of the plan (see plan.py): reads tensor names and header fields, validates shapes, and
returns frozen plans the executors in blocks.py run. GDN geometry comes from the header's
``linear_*`` fields checked against the projections; MLA geometry from ``arch.mla`` checked the
same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .errors import PlanError
from .ops.rope import RopeProfile, build_rope

ShapeOf = Callable[[str], "tuple[int, ...] | None"]


@dataclass(frozen=True)
class GdnPlan:
    """A Gated DeltaNet layer (``linear_attn.*``)."""

    qkv: str
    z: str
    a: str
    b: str
    conv: str
    a_log: str
    dt_bias: str
    norm: str
    out: str
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True)
class MlaPlan:
    """Multi-head latent attention (DeepSeek-V2/V3): a compressed KV latent shared by all heads."""

    kv_a: str  # [kv_rank + rope_dim, hidden]: latent and the shared rope key
    kv_a_norm: str
    kv_b: str  # [heads·(nope + v), kv_rank]
    o: str
    heads: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    kv_rank: int
    scale: float
    rope: RopeProfile
    interleave: bool  # legacy layout only: rope pairs (2i, 2i+1) instead of (i, i + d/2)
    rope_first: bool = True  # query heads stored [rope | nope] (interchange layout) or [nope | rope] (legacy)
    rotate: bool = True  # False: NoPE (arch.mla.nope), the rope dims are never rotated
    q: str | None = None  # without a query LoRA
    q_a: str | None = None
    q_a_norm: str | None = None
    q_b: str | None = None
    q_a_bias: str | None = None
    kv_a_bias: str | None = None
    o_bias: str | None = None


def gdn_plan(p: str, arch, shape_of: ShapeOf, where: str) -> GdnPlan:
    """The Gated DeltaNet of the layer whose names start with ``p``."""
    core = arch.linear_core
    if core is not None and core.kind != "gated_delta_net":
        raise PlanError(f"{where}: linear_core kind {core.kind!r} is not supported (gated_delta_net)")
    a = p + "linear_attn."
    names = {k: a + k + ("" if k in ("A_log", "dt_bias") else ".weight")
             for k in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias",
                       "norm", "out_proj")}
    shapes = {k: shape_of(n) for k, n in names.items()}
    missing = [names[k] for k, s in shapes.items() if s is None]
    if missing:
        raise PlanError(f"{where}: LinearAttention layer lacks {', '.join(missing)}")
    nk, nv = arch.linear_num_key_heads, arch.linear_num_value_heads or (core.num_heads if core else None)
    dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim or (core.value_head_dim if core else None)
    kernel = arch.linear_conv_kernel_dim
    if None in (nk, nv, dk, dv, kernel) or 0 in (nk, nv, dk, dv, kernel):
        raise PlanError(f"{where}: the header lacks linear_num_key_heads / linear_num_value_heads / "
                        f"linear_key_head_dim / linear_value_head_dim / linear_conv_kernel_dim")
    if nv % nk:
        raise PlanError(f"{where}: {nv} value heads do not group over {nk} key heads")
    h = arch.hidden_size
    conv_dim = 2 * nk * dk + nv * dv
    want = {"in_proj_qkv": (conv_dim, h), "in_proj_z": (nv * dv, h), "in_proj_a": (nv, h), "in_proj_b": (nv, h),
            "A_log": (nv,), "dt_bias": (nv,), "norm": (dv,), "out_proj": (h, nv * dv)}
    for k, shape in want.items():
        if tuple(shapes[k]) != shape:
            raise PlanError(f"{where}: {names[k]} has shape {list(shapes[k])}, the header implies {list(shape)}")
    conv = tuple(shapes["conv1d"])
    if conv not in ((conv_dim, 1, kernel), (conv_dim, kernel)):
        raise PlanError(f"{where}: {names['conv1d']} has shape {list(conv)}, expected [{conv_dim}, 1, {kernel}]")
    return GdnPlan(qkv=names["in_proj_qkv"], z=names["in_proj_z"], a=names["in_proj_a"], b=names["in_proj_b"],
                   conv=names["conv1d"], a_log=names["A_log"], dt_bias=names["dt_bias"], norm=names["norm"],
                   out=names["out_proj"], k_heads=nk, v_heads=nv, k_dim=dk, v_dim=dv, kernel=kernel)


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _layout(mla: dict) -> dict:
    """How an ``arch.mla`` block's rows are laid out (docs/INTERCHANGE.md, "MLA").

    Without ``rope_interleave`` (the reference converter and current pycmf): query heads
    rope-first, rope dims already in half-split order in q and in kv_a's rope tail, as the
    reference runtime reads them. With it (files of earlier pycmf releases): the Hugging Face row
    order, ``[nope | rope]`` heads, interleaved pairs when the key is true. ``nope`` true: the
    rope dims are used unrotated (Kimi Linear's full-attention layers)."""
    rotate = not bool(mla.get("nope", False))
    if "rope_interleave" in mla:
        return dict(interleave=bool(mla["rope_interleave"]) and rotate, rope_first=False, rotate=rotate)
    return dict(interleave=False, rope_first=True, rotate=rotate)


def mla_plan(p: str, arch, shape_of: ShapeOf, heads: int, where: str) -> MlaPlan:
    """The MLA attention of the layer whose names start with ``p`` (``self_attn.kv_a_proj_with_mqa``)."""
    mla = arch.mla
    if not mla:
        raise PlanError(f"{where}: kv_a_proj_with_mqa exists but the header has no arch.mla block")
    try:
        nope, rope_dim, v_dim, rank = (int(mla[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                             "v_head_dim", "kv_lora_rank"))
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"{where}: arch.mla needs qk_nope_head_dim, qk_rope_head_dim, v_head_dim and "
                        f"kv_lora_rank") from None
    s = p + "self_attn."
    has = lambda n: shape_of(s + n) is not None  # noqa: E731
    h = arch.hidden_size
    qk = nope + rope_dim

    def check(name: str, shape: tuple[int, ...]) -> str:
        got = shape_of(s + name)
        if got is None or tuple(got) != shape:
            raise PlanError(f"{where}: {s + name} has shape {None if got is None else list(got)}, "
                            f"arch.mla implies {list(shape)}")
        return s + name

    kw: dict = {}
    if has("q_a_proj.weight"):
        q_rank = shape_of(s + "q_a_proj.weight")[0]
        kw.update(q_a=check("q_a_proj.weight", (q_rank, h)), q_a_norm=check("q_a_layernorm.weight", (q_rank,)),
                  q_b=check("q_b_proj.weight", (heads * qk, q_rank)),
                  q_a_bias=s + "q_a_proj.bias" if has("q_a_proj.bias") else None)
    else:
        kw["q"] = check("q_proj.weight", (heads * qk, h))
    # HF's DeepSeek rope: YaRN over the rope dims, its mscale² folded into the softmax scale.
    yarn = arch.yarn
    scaling = dict(yarn.raw, rope_type="yarn") if yarn is not None else None
    # NoPE never rotates: its rope profile is a placeholder (Kimi's rope_theta may be 0)
    unrotated = bool(mla.get("nope", False))
    rope = build_rope(10000.0 if unrotated else arch.rope_theta, rope_dim, 1.0, None if unrotated else scaling,
                      None)
    scale = qk ** -0.5
    if yarn is not None and yarn.mscale_all_dim:
        m = _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        scale *= m * m
    return MlaPlan(
        kv_a=check("kv_a_proj_with_mqa.weight", (rank + rope_dim, h)),
        kv_a_norm=check("kv_a_layernorm.weight", (rank,)),
        kv_b=check("kv_b_proj.weight", (heads * (nope + v_dim), rank)),
        o=check("o_proj.weight", (h, heads * v_dim)), heads=heads, nope_dim=nope, rope_dim=rope_dim, v_dim=v_dim,
        kv_rank=rank, scale=scale, rope=rope, **_layout(mla),
        kv_a_bias=s + "kv_a_proj_with_mqa.bias" if has("kv_a_proj_with_mqa.bias") else None,
        o_bias=s + "o_proj.bias" if has("o_proj.bias") else None, **kw)
