"""Plan of a layer's FFN: dense SwiGLU/GeGLU or mixture of experts (spec §2.2, §11.1).

Part of the plan (see plan.py): this module reads tensor names, nothing outside the plan does.
A layer is MoE when its router ``mlp.gate.weight`` exists. Experts are enumerated by presence,
``mlp.experts.{e}.gate_proj.weight`` for e = 0, 1, … up to the first gap (``arch.moe.num_experts``
is nominal: a defragged file keeps fewer); the router must have exactly one row per expert.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from .errors import PlanError
from .ops.moe import Routing

log = logging.getLogger(__name__)

ShapeOf = Callable[[str], "tuple[int, ...] | None"]


@dataclass(frozen=True)
class FfnPlan:
    gate: str
    up: str
    down: str
    width: int
    act: str


@dataclass(frozen=True)
class MoePlan:
    router: str
    experts: tuple[tuple[str, str, str], ...]  # (gate, up, down) per expert, in index order
    routing: Routing
    act: str
    expert_bias: str | None = None  # selection only (DeepSeek e_score_correction_bias)
    shared: FfnPlan | None = None  # always added
    shared_gate: str | None = None  # [1, hidden]: the shared expert is weighted by sigmoid(gate·x)

    @property
    def n_experts(self) -> int:
        return len(self.experts)


def _ffn(prefix: str, shape_of: ShapeOf, hidden: int, act: str, where: str) -> FfnPlan:
    g, u, d = (prefix + f"{x}_proj.weight" for x in ("gate", "up", "down"))
    gs, us, ds = shape_of(g), shape_of(u), shape_of(d)
    if None in (gs, us, ds):
        raise PlanError(f"{where}: FFN gate/up/down projections are not all present ({prefix}*)")
    if not (gs[0] == us[0] == ds[1]) or ds[0] != hidden or gs[1] != hidden or us[1] != hidden:
        raise PlanError(f"{where}: FFN shapes disagree (gate {list(gs)}, up {list(us)}, down {list(ds)})")
    return FfnPlan(gate=g, up=u, down=d, width=gs[0], act=act)


def ffn_plan(p: str, arch, shape_of: ShapeOf, where: str) -> FfnPlan | MoePlan:
    """The FFN of the layer whose names start with ``p`` (``model.layers.3.``, ``model.mtp.layers.0.``)."""
    hidden = arch.hidden_size
    router = p + "mlp.gate.weight"
    if shape_of(router) is None:
        return _ffn(p + "mlp.", shape_of, hidden, arch.hidden_act, where)
    moe = arch.moe
    if moe is None:
        raise PlanError(f"{where}: {router} exists but the header has no arch.moe block")
    experts = []
    while shape_of(f"{p}mlp.experts.{len(experts)}.gate_proj.weight") is not None:
        e = len(experts)
        f = _ffn(f"{p}mlp.experts.{e}.", shape_of, hidden, arch.hidden_act, f"{where} expert {e}")
        experts.append((f.gate, f.up, f.down))
    if not experts:
        raise PlanError(f"{where}: a router but no mlp.experts.0.gate_proj.weight")
    rows = shape_of(router)
    if len(rows) != 2 or rows[0] != len(experts) or rows[1] != hidden:
        raise PlanError(f"{where}: the router {router} has shape {list(rows)} but {len(experts)} experts are present "
                    f"(router rows must equal the expert count)")
    bias = p + "mlp.expert_bias"
    bias_shape = shape_of(bias)
    if bias_shape is not None and tuple(bias_shape) != (len(experts),):
        raise PlanError(f"{where}: {bias} has shape {list(bias_shape)}, expected [{len(experts)}]")
    shared = None
    if shape_of(p + "mlp.shared_expert.gate_proj.weight") is not None:
        shared = _ffn(p + "mlp.shared_expert.", shape_of, hidden, arch.hidden_act, f"{where} shared expert")
    sgate = p + "mlp.shared_expert_gate.weight"
    sgate_shape = shape_of(sgate)
    if sgate_shape is not None and (shared is None or tuple(sgate_shape) != (1, hidden)):
        raise PlanError(f"{where}: {sgate} {list(sgate_shape)} needs a shared expert and shape [1, {hidden}]")
    raw = moe.raw
    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or n_group)
    if n_group > 1 and len(experts) % n_group:
        # A defragged file no longer has equal groups; routing then runs over the kept set.
        log.warning("%s: %d experts do not split into %d groups; group-limited routing disabled",
                    where, len(experts), n_group)
        n_group = topk_group = 1
    routing = Routing(top_k=min(int(moe.top_k), len(experts)), sigmoid=bool(moe.router_sigmoid),
                      norm_topk_prob=bool(moe.norm_topk_prob),
                      scaling=float(moe.routed_scaling_factor if moe.routed_scaling_factor is not None else 1.0),
                      n_group=n_group, topk_group=max(1, min(topk_group, n_group)))
    return MoePlan(router=router, experts=tuple(experts), routing=routing, act=arch.hidden_act,
                   expert_bias=bias if bias_shape is not None else None, shared=shared,
                   shared_gate=sgate if sgate_shape is not None else None)
