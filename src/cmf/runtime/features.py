"""What this runtime models: one explicit list of the header keys, layer types and tensor
families a file may need, and whether pycmf executes each (docs/INTERCHANGE.md).

The reference loader understands more than pycmf runs (Gemma-3n, Gemma-4 global layers,
DeepSeek-V4, short-conv and KDA mixers, ...). A key pycmf does not model is never ignored: a
file that needs one opens as a container (``cmf.open``) but ``cmf.load`` refuses it with
:class:`NotRunnable` naming the key, instead of running a different model whose output
depends on shapes. The same table says which keys *pycmf* writes that the reference's loader
does not read (``reference=False``): those files run here but need a reader that understands
them (``cmf info`` says so).

Keys owned by work in progress elsewhere (loop execution, tube tensors) have rows with
``owner`` set; the implementer flips ``modelled`` in the same commit that lands the execution.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ..format.errors import NotRunnable
from .ops.activations import ACTIVATIONS

__all__ = ["ENTRIES", "Feature", "check_runnable", "describe", "needs", "reference_unknown", "report", "unmet"]

# hidden_act values the reference's pipeline.rs `Act::from_arch_full` distinguishes; any other
# name silently runs as SiLU there.
REFERENCE_ACTIVATIONS = frozenset({"silu", "gelu_tanh", "situ"})
# Layer tags the reference's types.rs `LayerType` accepts, and the ones this runtime executes.
MODELLED_LAYER_TYPES = frozenset({"FullAttention", "SlidingAttention", "LinearAttention"})
MODELLED_LINEAR_CORES = frozenset({"gated_delta_net"})

_LAYER = re.compile(r"^model\.(?:mtp\.)?layers\.(\d+)\.")


@dataclass(frozen=True)
class Feature:
    """One thing a file may need: ``key`` as users see it, ``what`` it is, whether this runtime
    executes it (``modelled``), whether the reference loader reads it (``reference``), and the
    work item that owns it when it is not modelled yet (``owner``)."""

    key: str
    what: str
    modelled: bool
    reference: bool = True
    owner: str | None = None

    def __str__(self) -> str:
        return f"{self.key} ({self.what})"


class _Ctx:
    """The header dict and tensor names one check reads (names scanned once, lazily)."""

    def __init__(self, header: Any, names: Iterable[str]) -> None:
        raw = header.raw if hasattr(header, "raw") else header
        self.header: dict[str, Any] = raw if isinstance(raw, dict) else {}
        arch = self.header.get("arch")
        self.arch: dict[str, Any] = arch if isinstance(arch, dict) else {}
        self.names: Collection[str] = names if isinstance(names, Collection) else list(names)
        self._suffixes: set[str] | None = None

    def get(self, *path: str) -> Any:
        d: Any = self.arch
        for k in path:
            if not isinstance(d, dict):
                return None
            d = d.get(k)
        return d

    def layer_types(self) -> list[str]:
        lt = self.arch.get("layer_types")
        return [t for t in lt if isinstance(t, str)] if isinstance(lt, list) else []

    @property
    def suffixes(self) -> set[str]:
        """Tensor names with their ``model.layers.N.`` prefix cut (``mlp.gate.weight``)."""
        if self._suffixes is None:
            self._suffixes = {_LAYER.sub("", n) for n in self.names}
        return self._suffixes

    def layer_has(self, *suffixes: str) -> bool:
        """Whether one decoder layer holds all of ``suffixes``."""
        per: dict[str, set[str]] = {}
        for n in self.names:
            m = _LAYER.match(n)
            if m and not n.startswith("model.mtp."):
                per.setdefault(m.group(1), set()).add(n[m.end():])
        return any(all(s in have for s in suffixes) for have in per.values())


def _on(*path: str) -> Callable[[_Ctx], bool]:
    """Active when the arch value at ``path`` is set: not absent, null, false, 0 or empty."""
    return lambda c: bool(c.get(*path))


def _layer_type(kind: str) -> Callable[[_Ctx], bool]:
    return lambda c: kind in c.layer_types()


def _tensor(pattern: str) -> Callable[[_Ctx], bool]:
    rx = re.compile(pattern)
    return lambda c: any(rx.search(n) for n in c.names)


def _group_limited(c: _Ctx) -> bool:
    n = c.get("moe", "n_group") or 1
    k = c.get("moe", "topk_group") or n
    return isinstance(n, int) and isinstance(k, int) and n > 1 and k < n


def _scaled_rope_dict(c: _Ctx) -> bool:
    r = c.get("rope_scaling")
    return isinstance(r, dict) and r.get("rope_type", r.get("type")) not in (None, "default")


def _linear_core_other(c: _Ctx) -> bool:
    kind = c.get("linear_core", "kind")
    return "LinearAttention" in c.layer_types() and kind is not None and kind not in MODELLED_LINEAR_CORES


def _unknown_layer_type(c: _Ctx) -> bool:
    return any(t not in MODELLED_LAYER_TYPES | {"ShortConv", "Kda"} for t in c.layer_types())


def _dual_branch(c: _Ctx) -> bool:
    return c.layer_has("mlp.gate.weight", "mlp.gate_proj.weight")


# (feature, is it needed by this file?) — the one list. Order = the order `cmf info` prints.
ENTRIES: tuple[tuple[Feature, Callable[[_Ctx], bool]], ...] = (
    # -- token mixers (arch.layer_types, types.rs LayerType; loader.rs picks the loader per tag)
    (Feature("layer_types:FullAttention", "GQA/MQA attention", True), _layer_type("FullAttention")),
    (Feature("layer_types:SlidingAttention", "windowed attention", True),
     lambda c: "SlidingAttention" in c.layer_types() or bool(c.get("sliding_window_pattern"))),
    (Feature("layer_types:LinearAttention", "Gated DeltaNet", True),
     lambda c: "LinearAttention" in c.layer_types() and not _linear_core_other(c)),
    (Feature("arch.linear_core.kind", "a linear core other than gated_delta_net (vmf_phase)", False),
     _linear_core_other),
    (Feature("layer_types:ShortConv", "LFM2 gated short-convolution mixer", False), _layer_type("ShortConv")),
    (Feature("layer_types:Kda", "Kimi delta attention", False), _layer_type("Kda")),
    (Feature("arch.kda_gate_lower_bound", "Kimi-K3 KDA lower-bound decay gate", False), _on("kda_gate_lower_bound")),
    (Feature("layer_types", "a layer tag this runtime does not know", False), _unknown_layer_type),
    (Feature("arch.mla", "multi-head latent attention", True), _on("mla")),
    (Feature("arch.mla.nope", "Kimi Linear NoPE full-attention layers", True), _on("mla", "nope")),
    # -- attention variants
    (Feature("arch.global_head_dim", "Gemma-4 global layers with their own head dim", False), _on("global_head_dim")),
    (Feature("arch.num_global_kv_heads", "Gemma-4 global-layer KV heads", False), _on("num_global_kv_heads")),
    (Feature("arch.global_partial_rotary_factor", "Gemma-4 global-layer partial RoPE", False),
     _on("global_partial_rotary_factor")),
    (Feature("arch.attn_v_norm", "Gemma-4 scale-less V norm", False), _on("attn_v_norm")),
    (Feature("arch.qk_norm_after_rope", "q/k norm after RoPE (HunYuan)", False), _on("qk_norm_after_rope")),
    (Feature("arch.attn_logit_softcapping", "attention soft-capping", True), _on("attn_logit_softcapping")),
    (Feature("arch.attention_heads_per_layer", "per-layer head counts", True), _on("attention_heads_per_layer")),
    # -- positions
    (Feature("arch.yarn", "YaRN RoPE", True), _on("yarn")),
    (Feature("arch.yarn.truncate", "untruncated YaRN correction range (gpt-oss)", True, reference=False),
     lambda c: c.get("yarn", "truncate") is False),
    (Feature("arch.rope_freq_factors", "per-frequency RoPE divisors (linear, llama3, longrope)", True),
     _on("rope_freq_factors")),
    (Feature("arch.rope_attention_factor", "longrope cos/sin scale (phi-3)", True, reference=False),
     lambda c: c.get("rope_attention_factor") not in (None, 1, 1.0)),
    (Feature("arch.rope_scaling", "an HF rope_scaling block", True, reference=False), _scaled_rope_dict),
    # -- FFN and MoE
    (Feature("arch.hidden_act", "an activation this runtime does not know", False),
     lambda c: isinstance(c.get("hidden_act"), str) and c.get("hidden_act") not in ACTIVATIONS),
    (Feature("arch.hidden_act", "an activation the reference runs as SiLU", True, reference=False),
     lambda c: c.get("hidden_act") in ACTIVATIONS and c.get("hidden_act") not in REFERENCE_ACTIVATIONS),
    (Feature("arch.moe", "mixture of experts", True), _on("moe")),
    (Feature("arch.moe.n_group", "group-limited routing (n_group/topk_group)", True, reference=False),
     _group_limited),
    (Feature("arch.moe.router_resonance", "resonance routing by expert descriptors", False),
     _on("moe", "router_resonance")),
    (Feature("tensor:mlp.per_expert_scale", "Gemma-4 per-expert weight scale", False),
     _tensor(r"\.mlp\.per_expert_scale$")),
    (Feature("tensor:mlp.gate_proj+mlp.gate", "Gemma-4 dense + MoE dual-branch FFN", False), _dual_branch),
    (Feature("tensor:mlp.tid2eid", "DeepSeek-V4 hash routing by token id", False), _tensor(r"\.mlp\.tid2eid$")),
    (Feature("tensor:hc_*", "DeepSeek-V4 hyper-connections", False), _tensor(r"(^|\.)hc_(attn|ffn|head)_")),
    (Feature("tensor:layer_scalar", "Gemma-4 per-layer output scalar", False), _tensor(r"\.layer_scalar$")),
    (Feature("tensor:mlp.*_proj.tube", "tube-bake task tubes mlp.{gate,up,down}_proj.tube{k}.weight of a "
             "dense FFN; without them only the core FFN would run", False,
             owner="tube files (docs/INTERCHANGE.md)"), _tensor(r"\.mlp\.(gate|up|down)_proj\.tube\d+\.weight$")),
    # -- whole-model families and heads
    (Feature("tensor:te.*/dit.*/vae.*", "a text-to-image pipeline container (spec §12): run it with cmf imagine",
             False), _tensor(r"^(te|dit|vae)\.")),
    (Feature("arch.g3n", "Gemma-3n stack (AltUp, LAuReL, per-layer embeddings)", False), _on("g3n")),
    (Feature("arch.qwen4_exp", "Qwen3.8-Flash-Next stack", False), _on("qwen4_exp")),
    (Feature("arch.deepseek_v41", "DeepSeek-V4.1 source configuration", False), _on("deepseek_v41")),
    (Feature("arch.prism_hadamard", "Prism/Bonsai Hadamard-basis weights", False), _on("prism_hadamard")),
    (Feature("arch.head_clusters", "hierarchical (clustered) output head", False), _on("head_clusters")),
    (Feature("arch.num_loops", "looped layer stack (num_loops > 1)", True),
     lambda c: isinstance(c.get("num_loops"), int) and c.get("num_loops") > 1),
    (Feature("arch.loop_final_norm", "final norm after every loop", True),
     _on("loop_final_norm")),
    (Feature("arch.mtp", "multi-token-prediction head", True), lambda c: bool(c.get("mtp", "num_layers"))),
    (Feature("arch.final_logit_softcapping", "final-logit soft-capping", True), _on("final_logit_softcapping")),
    (Feature("arch.logit_multiplier", "logit scale", True), lambda c: c.get("logit_multiplier") not in (None, 1, 1.0)),
)


def _active(header: Any, names: Iterable[str]) -> list[Feature]:
    c = _Ctx(header, names)
    return [f for f, on in ENTRIES if on(c)]


def needs(header: Any, names: Iterable[str]) -> list[Feature]:
    """Every listed feature ``header`` + tensor ``names`` need, in table order."""
    return _active(header, names)


def unmet(header: Any, names: Iterable[str]) -> list[Feature]:
    """The features the file needs that this runtime does not model (empty = it runs here)."""
    return [f for f in _active(header, names) if not f.modelled]


def reference_unknown(header: Any, names: Iterable[str]) -> list[Feature]:
    """Features this runtime runs but the reference's loader does not read: a file needing one
    gives other numbers there (it needs a reader that understands them)."""
    return [f for f in _active(header, names) if f.modelled and not f.reference]


def describe(features: Iterable[Feature], header: Any = None) -> str:
    """``key (what)`` joined by "; ", with the value for keys whose value matters (hidden_act)."""
    arch = (header.raw if hasattr(header, "raw") else header or {}).get("arch", {}) if header is not None else {}
    out = []
    for f in features:
        if f.key == "arch.hidden_act" and isinstance(arch, dict):
            out.append(f"arch.hidden_act = {arch.get('hidden_act')!r} ({f.what})")
        elif f.key == "layer_types" and isinstance(arch, dict):
            known = MODELLED_LAYER_TYPES | {"ShortConv", "Kda"}
            odd = sorted({t for t in arch.get("layer_types") or [] if t not in known})
            out.append(f"layer_types {', '.join(map(str, odd))} ({f.what})")
        else:
            out.append(str(f))
    return "; ".join(out)


def report(header: Any, names: Iterable[str], *, skill_file: bool = False) -> dict[str, Any]:
    """What ``cmf info`` shows: the features needed, whether this runtime runs the file (and why
    not), and the keys a reader must understand to get the numbers pycmf gets."""
    names = names if isinstance(names, Collection) else list(names)
    active = needs(header, names)
    missing = [f for f in active if not f.modelled]
    why = ([describe(missing, header)] if missing else [])
    if skill_file:
        why.insert(0, "a standalone skill file (SKILL_FILE): attach it with cmf skill apply")
    foreign = [f for f in active if f.modelled and not f.reference]
    return {"needs": [f.key for f in active], "runs_here": not why, "why_not": why,
            "not_modelled": [f.key for f in missing],
            "reference_unknown": [f.key for f in foreign],
            "reference_unknown_text": describe(foreign, header) if foreign else None}


def check_runnable(header: Any, names: Iterable[str], where: object) -> None:
    """Raise :class:`NotRunnable` naming every unmodelled key the file needs."""
    missing = unmet(header, names)
    if missing:
        raise NotRunnable(f"{where}: this runtime does not model {describe(missing, header)}; refusing to run "
                          f"the file (its output would be another model's). It still opens as a container "
                          f"(cmf info, cmf verify).", unmet=tuple(f.key for f in missing))
