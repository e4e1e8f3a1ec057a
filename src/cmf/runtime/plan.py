"""THE place that reads tensor names: directory + header → one LayerPlan per layer.

Operators are chosen by tensor presence and header fields (spec §2 "capability dispatch"),
never by a model or architecture name. Everything else in the runtime consumes these plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import PlanError
from .loops import visit_plans
from .ops.rope import RopeProfile, build_rope
from .plan_mixers import GdnPlan, MlaPlan, gdn_plan, mla_plan
from .plan_moe import FfnPlan, MoePlan, ffn_plan

__all__ = ["AttentionPlan", "FfnPlan", "GdnPlan", "LayerPlan", "MlaPlan", "ModelPlan", "MoePlan", "MtpPlan",
           "PlanError", "build_plan", "plan_names"]


@dataclass(frozen=True)
class AttentionPlan:
    q: str
    k: str
    v: str
    o: str
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    rope: RopeProfile
    window: int | None = None
    softcap: float | None = None
    q_bias: str | None = None
    k_bias: str | None = None
    v_bias: str | None = None
    o_bias: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    output_gate: bool = False  # q_proj rows = 2·heads·head_dim: [q; gate] per head, sigmoid gate
    g_proj: str | None = None  # per-head (rows = heads) or per-channel softplus gate before o_proj


@dataclass(frozen=True)
class LayerPlan:
    index: int
    kind: str  # FullAttention | SlidingAttention | LinearAttention
    attn: AttentionPlan | MlaPlan | GdnPlan  # the token mixer
    ffn: FfnPlan | MoePlan
    input_norm: str | None
    post_attn_norm: str | None
    pre_ffn_norm: str | None = None  # present → sandwich norms (gemma2/3)
    post_ffn_norm: str | None = None
    exit_norm: str | None = None  # looped stacks: the final norm applied after this visit (loops.py)

    @property
    def sandwich(self) -> bool:
        return self.pre_ffn_norm is not None


@dataclass(frozen=True)
class ModelPlan:
    hidden: int
    vocab: int
    eps: float
    gemma_norm: bool
    embed: str
    lm_head: str
    final_norm: str | None
    embed_multiplier: float
    final_softcap: float | None
    logit_multiplier: float
    max_positions: int
    layers: list[LayerPlan] = field(default_factory=list)
    mtp: MtpPlan | None = None


@dataclass(frozen=True)
class MtpPlan:
    """The multi-token-prediction head (spec §2.1): x = eh_proj·[enorm(embed(t)); hnorm(h)] → layers
    → norm → lm_head."""

    enorm: str
    hnorm: str
    eh_proj: str
    layers: list[LayerPlan]
    norm: str | None
    embed: str
    lm_head: str


def _opt(arch_raw: dict, key: str, default=None):
    v = arch_raw.get(key, default)
    return default if v is None else v


def build_plan(arch, shape_of: Callable[[str], tuple[int, ...] | None]) -> ModelPlan:
    """Build the execution plan from an ``Arch`` view and a name → shape lookup (None = absent)."""
    raw = arch.raw
    hidden = arch.hidden_size
    has = lambda name: shape_of(name) is not None  # noqa: E731

    embed = "model.embed_tokens.weight"
    if not has(embed):
        raise PlanError(f"the file has no {embed}: not a decoder this runtime can run")
    lm_head = "lm_head.weight" if has("lm_head.weight") else embed
    if lm_head == embed and not arch.tie_word_embeddings:
        raise PlanError("no lm_head.weight and tie_word_embeddings is false")
    vocab = shape_of(embed)[0]
    ctx = _Context(arch, shape_of)
    # layer_kinds: the written tags, or the sliding_window_pattern schedule when no layer is tagged
    # SlidingAttention (files that carry only the pattern would otherwise run every layer global).
    layers = [_layer(ctx, i, f"model.layers.{i}.", kind, f"layer {i}") for i, kind in enumerate(arch.layer_kinds)]
    final_norm = "model.norm.weight" if has("model.norm.weight") else None
    layers = visit_plans(arch, layers, final_norm)  # looped stacks: one plan per visit (loops.py)
    return ModelPlan(
        hidden=hidden, vocab=vocab, eps=float(arch.rms_norm_eps), gemma_norm=arch.norm_style == "gemma",
        embed=embed, lm_head=lm_head, final_norm=final_norm,
        embed_multiplier=float(arch.embed_multiplier), final_softcap=_opt(raw, "final_logit_softcapping"),
        logit_multiplier=float(_opt(raw, "logit_multiplier", 1.0)),
        max_positions=int(arch.max_position_embeddings), layers=layers, mtp=_mtp(ctx, embed, lm_head))


class _Context:
    """What every layer's plan needs: the header, the shape lookup and the two rope profiles."""

    def __init__(self, arch, shape_of: Callable[[str], tuple[int, ...] | None]) -> None:
        raw = arch.raw
        self.arch, self.shape_of = arch, shape_of
        self.full_rope = build_rope(arch.rope_theta, arch.head_dim, arch.partial_rotary_factor,
                                    _rope_scaling(raw), _opt(raw, "rope_freq_factors"))
        if _opt(raw, "rope_attention_factor"):  # longrope: cos/sin scaled at every length
            self.full_rope = RopeProfile(self.full_rope.inv_freq, self.full_rope.rotary_dim,
                                         float(raw["rope_attention_factor"]))
        self.local_rope = build_rope(_opt(raw, "rope_local_base_freq", arch.rope_theta), arch.head_dim,
                                     _opt(raw, "local_partial_rotary_factor", arch.partial_rotary_factor), None, None)

    def has(self, name: str) -> bool:
        return self.shape_of(name) is not None


def _layer(ctx: _Context, i: int, p: str, kind: str, where: str) -> LayerPlan:
    """One decoder layer whose tensor names start with ``p``."""
    arch, has = ctx.arch, ctx.has
    heads_per_layer = _opt(arch.raw, "attention_heads_per_layer")
    heads = int(heads_per_layer[i]) if heads_per_layer and i < len(heads_per_layer) else arch.num_attention_heads
    if kind == "LinearAttention":
        mixer = gdn_plan(p, arch, ctx.shape_of, where)
    elif kind not in ("FullAttention", "SlidingAttention"):
        raise PlanError(f"{where}: {kind} layers are not supported by this runtime")
    elif has(p + "self_attn.kv_a_proj_with_mqa.weight"):
        mixer = mla_plan(p, arch, ctx.shape_of, heads, where)
    else:
        mixer = _attention(ctx, p, kind, heads, where)
    name = lambda n: p + n if has(p + n) else None  # noqa: E731
    return LayerPlan(
        index=i, kind=kind, attn=mixer, ffn=ffn_plan(p, arch, ctx.shape_of, where),
        input_norm=name("input_layernorm.weight"), post_attn_norm=name("post_attention_layernorm.weight"),
        pre_ffn_norm=name("pre_feedforward_layernorm.weight"), post_ffn_norm=name("post_feedforward_layernorm.weight"))


def _attention(ctx: _Context, p: str, kind: str, heads: int, where: str) -> AttentionPlan:
    arch, has, shape_of = ctx.arch, ctx.has, ctx.shape_of
    raw = arch.raw
    hd = arch.head_dim
    q_shape = shape_of(p + "self_attn.q_proj.weight")
    k_shape = shape_of(p + "self_attn.k_proj.weight")
    v_shape = shape_of(p + "self_attn.v_proj.weight")
    o_shape = shape_of(p + "self_attn.o_proj.weight")
    if None in (q_shape, k_shape, v_shape, o_shape):
        raise PlanError(f"{where}: attention projections q/k/v/o are not all present")
    if q_shape[0] == 2 * heads * hd:
        gate = True
    elif q_shape[0] == heads * hd:
        gate = False
    else:
        raise PlanError(f"{where}: q_proj has {q_shape[0]} rows; {heads} heads × {hd} needs "
                        f"{heads * hd} (or {2 * heads * hd} with an output gate)")
    if k_shape[0] % hd or k_shape[0] == 0:
        raise PlanError(f"{where}: k_proj rows {k_shape[0]} are not a multiple of head_dim {hd}")
    kv_heads = k_shape[0] // hd
    if heads % kv_heads:
        raise PlanError(f"{where}: {heads} query heads do not group over {kv_heads} KV heads")
    v_hd = v_shape[0] // kv_heads
    biases = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    has_qkv_bias = all(has(b) for b in biases)
    sliding = kind == "SlidingAttention"
    qpas = _opt(raw, "query_pre_attn_scalar")
    softcap = _opt(raw, "attn_logit_softcapping")
    window = _opt(raw, "sliding_window")
    attn = AttentionPlan(
        q=p + "self_attn.q_proj.weight", k=p + "self_attn.k_proj.weight", v=p + "self_attn.v_proj.weight",
        o=p + "self_attn.o_proj.weight", heads=heads, kv_heads=kv_heads, head_dim=hd, v_head_dim=v_hd,
        scale=(float(qpas) ** -0.5) if qpas else hd ** -0.5, rope=ctx.local_rope if sliding else ctx.full_rope,
        window=int(window) if sliding and window else None, softcap=float(softcap) if softcap else None,
        q_bias=biases[0] if has_qkv_bias else None, k_bias=biases[1] if has_qkv_bias else None,
        v_bias=biases[2] if has_qkv_bias else None,
        o_bias=p + "self_attn.o_proj.bias" if has(p + "self_attn.o_proj.bias") else None,
        q_norm=p + "self_attn.q_norm.weight" if has(p + "self_attn.q_norm.weight") else None,
        k_norm=p + "self_attn.k_norm.weight" if has(p + "self_attn.k_norm.weight") else None,
        output_gate=gate,
        g_proj=p + "self_attn.g_proj.weight" if has(p + "self_attn.g_proj.weight") else None,
    )
    if sliding and attn.window is None:
        why = "" if "SlidingAttention" in arch.layer_types else " (from arch.sliding_window_pattern)"
        raise PlanError(f"{where} is SlidingAttention{why} but the header has no sliding_window")
    return attn


def _mtp(ctx: _Context, embed: str, lm_head: str) -> MtpPlan | None:
    """The MTP head (spec §2.1) when ``arch.mtp`` is declared: ``model.mtp.*``."""
    mtp = ctx.arch.mtp
    if mtp is None or mtp.num_layers == 0:
        return None
    m = "model.mtp."
    names = {k: m + k + ".weight" for k in ("enorm", "hnorm", "eh_proj")}
    missing = [n for n in names.values() if not ctx.has(n)]
    if missing:
        raise PlanError(f"arch.mtp is declared but {', '.join(missing)} is missing")
    h = ctx.arch.hidden_size
    if tuple(ctx.shape_of(names["eh_proj"])) != (h, 2 * h):
        raise PlanError(f"{names['eh_proj']} has shape {list(ctx.shape_of(names['eh_proj']))}, expected [{h}, {2 * h}]")
    layers = []
    for i in range(mtp.num_layers):
        p = f"{m}layers.{i}."
        # The MTP block's kind comes from its tensors: it is not part of layer_types.
        kind = "LinearAttention" if ctx.has(p + "linear_attn.in_proj_qkv.weight") else "FullAttention"
        layers.append(_layer(ctx, i, p, kind, f"MTP layer {i}"))
    return MtpPlan(
        enorm=names["enorm"], hnorm=names["hnorm"], eh_proj=names["eh_proj"], layers=layers,
        norm=m + "norm.weight" if ctx.has(m + "norm.weight") else None,
        embed=m + "embed_tokens.weight" if ctx.has(m + "embed_tokens.weight") else embed,
        lm_head=m + "lm_head.weight" if ctx.has(m + "lm_head.weight") else lm_head)


def _rope_scaling(raw: dict) -> dict | None:
    """The global rope scaling: a ``yarn`` block, or an HF-style ``rope_scaling`` dict."""
    if raw.get("yarn"):
        return dict(raw["yarn"], rope_type="yarn")
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        out = dict(scaling)
        out.setdefault("rope_type", scaling.get("type"))
        return out
    return None


def plan_names(obj) -> set[str]:  # noqa: ANN001 - a (nested) plan dataclass
    """Every string a (nested) plan dataclass holds: the tensor names one layer reads."""
    out: set[str] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            out.add(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dataclass_fields__"):
            stack.extend(getattr(o, f) for f in o.__dataclass_fields__)
    return out
