"""Tensor names: Hugging Face checkpoint names <-> canonical CMF names, as data.

CMF keeps names 1:1 with HF (spec §3), so almost every tensor passes through unchanged. What
changes is listed here, once, and read in both directions (``convert`` forward, ``export``
backward; REFERENCE_NOTES §3 "Name mapping rules"):

- multimodal wrappers are unwrapped (``model.language_model.`` -> ``model.``) and vision/audio
  towers dropped;
- family renames (:data:`RENAMES`): Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``, DeepSeek/GLM
  ``shared_experts`` and ``gate.e_score_correction_bias``, the MTP heads;
- fused tensors are split (:func:`split_rules`): transformers-5 expert banks
  ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, phi3 ``qkv_proj`` and
  ``gate_up_proj``, qwen3_next ``in_proj_qkvz`` / ``in_proj_ba`` (per key-head-group interleaved,
  see ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``) into the qwen3_5 layout
  ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

A split is described by a :class:`Cut`: an optional index into the first axis (one expert of a
bank) followed by row ranges that are concatenated. Rows of a C-contiguous tensor are contiguous
bytes, so the reader fetches exactly those bytes and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

# Tensors of multimodal checkpoints that belong to other towers: dropped, the text tower stays.
DROP_PREFIXES = (
    "model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
    "model.multi_modal_projector.", "mm_projector.", "model.vision_embedder.", "model.embed_vision.",
    "model.embed_audio.", "model.audio_tower.", "audio_tower.",
)
# Derived buffers some old checkpoints carry; the runtime recomputes them.
DROP_SUFFIXES = (".rotary_emb.inv_freq",)
# Wrapper prefixes -> canonical text-model prefixes (first match wins, longest first).
UNWRAP = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
)
# Top-level namespaces a converted text model may hold (after unwrapping and renames).
TOP_LEVEL = ("model.", "lm_head.", "mtp.")

EXPERT_ROLES = ("gate_proj", "up_proj", "down_proj")  # role-contiguous order (spec §2.2)

# Family renames, HF pattern -> CMF pattern. {P}: a layer prefix (`model.layers.3`,
# `model.mtp.layers.0`), {E}: an expert index, {L}: a layer index, {R}: the rest of the name.
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (
        ("{P}.block_sparse_moe.gate.weight", "{P}.mlp.gate.weight"),
        ("{P}.block_sparse_moe.experts.{E}.w1.weight", "{P}.mlp.experts.{E}.gate_proj.weight"),
        ("{P}.block_sparse_moe.experts.{E}.w3.weight", "{P}.mlp.experts.{E}.up_proj.weight"),
        ("{P}.block_sparse_moe.experts.{E}.w2.weight", "{P}.mlp.experts.{E}.down_proj.weight"),
    ),
    "deepseek": (
        ("{P}.mlp.shared_experts.{R}", "{P}.mlp.shared_expert.{R}"),
        ("{P}.mlp.gate.e_score_correction_bias", "{P}.mlp.expert_bias"),
        ("{P}.mlp.experts.e_score_correction_bias", "{P}.mlp.expert_bias"),
    ),
    # Qwen3-Next / Qwen3.5 MTP head (hub layout `mtp.*`).
    "qwen_mtp": (
        ("mtp.fc.weight", "model.mtp.eh_proj.weight"),
        ("mtp.pre_fc_norm_embedding.weight", "model.mtp.enorm.weight"),
        ("mtp.pre_fc_norm_hidden.weight", "model.mtp.hnorm.weight"),
        ("mtp.norm.weight", "model.mtp.norm.weight"),
        ("mtp.layers.{L}.{R}", "model.mtp.layers.{L}.{R}"),
    ),
}


def deepseek_mtp_renames(num_layers: int) -> tuple[tuple[str, str], ...]:
    """DeepSeek/GLM MTP: the module after the last decoder layer, ``model.layers.{N}.*``."""
    n = f"model.layers.{num_layers}"
    return (
        (f"{n}.enorm.weight", "model.mtp.enorm.weight"),
        (f"{n}.hnorm.weight", "model.mtp.hnorm.weight"),
        (f"{n}.eh_proj.weight", "model.mtp.eh_proj.weight"),
        (f"{n}.shared_head.norm.weight", "model.mtp.norm.weight"),
        # Copies of the main head/embedding: kept under these names only when they differ.
        (f"{n}.shared_head.head.weight", "model.mtp.lm_head.weight"),
        (f"{n}.embed_tokens.weight", "model.mtp.embed_tokens.weight"),
        (f"{n}.{{R}}", "model.mtp.layers.0.{R}"),
    )


_BANK_BIAS = ("{P}.mlp.experts.e_score_correction_bias", "{P}.mlp.expert_bias")
_SLOTS = {"P": r"(?P<P>.+\.layers\.\d+)", "E": r"(?P<E>\d+)", "L": r"(?P<L>\d+)", "R": r"(?P<R>.+)"}


def _compile(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[PELR]\})", pattern)
    return re.compile("".join(_SLOTS[p[1]] if re.fullmatch(r"\{[PELR]\}", p) else re.escape(p) for p in parts)
                      + r"\Z")


def _fill(template: str, m: re.Match[str]) -> str:
    return re.sub(r"\{([PELR])\}", lambda t: m.group(t.group(1)), template)


class RenameTable:
    """Stages of ordered pattern pairs (first match wins inside a stage), readable both ways:
    ``forward`` runs the stages in order, ``backward`` undoes them in reverse order."""

    def __init__(self, *stages: Iterable[tuple[str, str]]) -> None:
        self.stages = tuple(tuple(s) for s in stages)
        self._fwd = [[(_compile(a), b) for a, b in s] for s in self.stages]
        self._bwd = [[(_compile(b), a) for a, b in s] for s in reversed(self.stages)]

    def forward(self, name: str) -> str:
        """HF name -> CMF name."""
        for rules in self._fwd:
            name = self._apply(rules, name)
        return name

    def backward(self, name: str) -> str:
        """CMF name -> HF name."""
        for rules in self._bwd:
            name = self._apply(rules, name)
        return name

    @staticmethod
    def _apply(rules: list[tuple[re.Pattern[str], str]], name: str) -> str:
        for rx, template in rules:
            m = rx.match(name)
            if m:
                return _fill(template, m)
        return name


def rename_table(family: str, num_layers: int, mtp: str | None) -> RenameTable:
    """The renames of one family (``mtp``: "deepseek" or "qwen" when the source has an MTP head).

    MTP names move first, so the family renames then apply inside the MTP block too.
    """
    first: tuple[tuple[str, str], ...] = ()
    if mtp == "deepseek":
        first = deepseek_mtp_renames(num_layers)
    elif mtp == "qwen":
        first = RENAMES["qwen_mtp"]
    family_rules = list(RENAMES.get(family, ()))
    if _BANK_BIAS not in family_rules:  # the transformers-5 spelling of the router bias, in any family
        family_rules.append(_BANK_BIAS)
    return RenameTable(first, family_rules)


def unwrap(name: str) -> str | None:
    """Strip a multimodal wrapper prefix; None for tensors of other towers and derived buffers."""
    if name.startswith(DROP_PREFIXES) or name.endswith(DROP_SUFFIXES):
        return None
    for old, new in UNWRAP:
        if name.startswith(old):
            return new + name[len(old):]
    return name


# ----------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class Cut:
    """A part of a source tensor: ``index`` selects one slice of the first axis, then ``rows``
    (half-open ranges of the remaining first axis) are concatenated in order."""

    index: int | None = None
    rows: tuple[tuple[int, int], ...] | None = None

    def shape(self, src_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the part cut out of a source of ``src_shape``."""
        shape = src_shape[1:] if self.index is not None else src_shape
        if self.rows is not None:
            shape = (sum(b - a for a, b in self.rows),) + tuple(shape[1:])
        return tuple(shape)


def _grouped(groups: int, block: int, start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """Rows ``[start, stop)`` of every ``block``-row group, groups in order."""
    return tuple((g * block + start, g * block + stop) for g in range(groups))


def split_rules(family: str, dims: dict[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    """(regex over the CMF-side name, function(match, shape) -> [(name, Cut)]) for fused tensors.

    ``dims`` carries the geometry the cuts need (head counts, head dims, FFN width).
    """
    rules: list[tuple[re.Pattern[str], Any]] = []

    def bank_gate_up(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        e, two_i = shape[0], shape[1]
        i = two_i // 2
        out = []
        for role, rows in (("gate_proj", ((0, i),)), ("up_proj", ((i, two_i),))):
            out += [(f"{m.group('P')}.experts.{k}.{role}.weight", Cut(index=k, rows=rows)) for k in range(e)]
        return out

    def bank_down(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        return [(f"{m.group('P')}.experts.{k}.down_proj.weight", Cut(index=k)) for k in range(shape[0])]

    rules.append((re.compile(r"(?P<P>.+\.mlp)\.experts\.gate_up_proj(\.weight)?\Z"), bank_gate_up))
    rules.append((re.compile(r"(?P<P>.+\.mlp)\.experts\.down_proj(\.weight)?\Z"), bank_down))

    rules += _SPLITS.get(family, _no_rules)(dims)
    return rules


def _phi3_splits(dims: dict[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    """phi3's fused ``qkv_proj`` and ``gate_up_proj`` -> the q/k/v and gate/up projections."""
    nh, nkv, hd = dims["num_attention_heads"], dims["num_kv_heads"], dims["head_dim"]
    q, kv = nh * hd, nkv * hd

    def qkv(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        p = m.group("P")
        return [(f"{p}.q_proj.weight", Cut(rows=((0, q),))), (f"{p}.k_proj.weight", Cut(rows=((q, q + kv),))),
                (f"{p}.v_proj.weight", Cut(rows=((q + kv, q + 2 * kv),)))]

    def gate_up(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        p, i = m.group("P"), shape[0] // 2
        return [(f"{p}.gate_proj.weight", Cut(rows=((0, i),))), (f"{p}.up_proj.weight", Cut(rows=((i, 2 * i),)))]

    return [(re.compile(r"(?P<P>.+\.self_attn)\.qkv_proj\.weight\Z"), qkv),
            (re.compile(r"(?P<P>.+\.mlp)\.gate_up_proj\.weight\Z"), gate_up)]


def _linear_attn_splits(dims: dict[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    """qwen3_next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` -> the qwen3_5 layout."""
    nk, nv = dims["linear_num_key_heads"], dims["linear_num_value_heads"]
    dk, dv = dims["linear_key_head_dim"], dims["linear_value_head_dim"]
    r = nv // nk  # value heads per key-head group
    blk = 2 * dk + 2 * r * dv

    def qkvz(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        p = m.group("P")
        qkv_rows = (_grouped(nk, blk, 0, dk) + _grouped(nk, blk, dk, 2 * dk)
                    + _grouped(nk, blk, 2 * dk, 2 * dk + r * dv))
        return [(f"{p}.in_proj_qkv.weight", Cut(rows=qkv_rows)),
                (f"{p}.in_proj_z.weight", Cut(rows=_grouped(nk, blk, 2 * dk + r * dv, blk)))]

    def ba(m: re.Match[str], shape: tuple[int, ...]) -> list[tuple[str, Cut]]:
        p = m.group("P")
        return [(f"{p}.in_proj_b.weight", Cut(rows=_grouped(nk, 2 * r, 0, r))),
                (f"{p}.in_proj_a.weight", Cut(rows=_grouped(nk, 2 * r, r, 2 * r)))]

    return [(re.compile(r"(?P<P>.+\.linear_attn)\.in_proj_qkvz\.weight\Z"), qkvz),
            (re.compile(r"(?P<P>.+\.linear_attn)\.in_proj_ba\.weight\Z"), ba)]


def _no_rules(dims: dict[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    return []


# ----------------------------------------------------------------------------------- fusion (export)


@dataclass(frozen=True)
class Fuse:
    """An HF tensor assembled from CMF parts: ``parts[i]`` goes to ``rows[i]`` of the output."""

    name: str
    parts: tuple[str, ...]
    rows: tuple[tuple[tuple[int, int], ...], ...]


def fuse_groups(family: str, names: Iterable[str], shapes: dict[str, tuple[int, ...]],
                dims: dict[str, Any]) -> list[Fuse]:
    """The fused HF tensors transformers expects for ``family`` (the inverse of the splits)."""
    return _FUSES.get(family, _no_fuses)(list(names), shapes, dims)


def _concat(name: str, parts: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> Fuse:
    rows, at = [], 0
    for p in parts:
        n = shapes[p][0]
        rows.append(((at, at + n),))
        at += n
    return Fuse(name, parts, tuple(rows))


def _phi3_fuses(names: list[str], shapes: dict[str, tuple[int, ...]], dims: dict[str, Any]) -> list[Fuse]:
    """q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj`` (the inverse of :func:`_phi3_splits`)."""
    out: list[Fuse] = []
    for n in names:
        m = re.fullmatch(r"(.+\.self_attn)\.q_proj\.weight", n)
        if m:
            p = m.group(1)
            parts = (f"{p}.q_proj.weight", f"{p}.k_proj.weight", f"{p}.v_proj.weight")
            out.append(_concat(f"{p}.qkv_proj.weight", parts, shapes))
        m = re.fullmatch(r"(.+\.mlp)\.gate_proj\.weight", n)
        if m:
            p = m.group(1)
            out.append(_concat(f"{p}.gate_up_proj.weight", (f"{p}.gate_proj.weight", f"{p}.up_proj.weight"),
                               shapes))
    return out


def _linear_attn_fuses(names: list[str], shapes: dict[str, tuple[int, ...]], dims: dict[str, Any]) -> list[Fuse]:
    """The grouped ``in_proj_qkvz`` / ``in_proj_ba`` again (the inverse of :func:`_linear_attn_splits`)."""
    out: list[Fuse] = []
    nk, nv = dims["linear_num_key_heads"], dims["linear_num_value_heads"]
    dk, dv = dims["linear_key_head_dim"], dims["linear_value_head_dim"]
    r = nv // nk
    blk = 2 * dk + 2 * r * dv
    for n in names:
        m = re.fullmatch(r"(.+\.linear_attn)\.in_proj_qkv\.weight", n)
        if not m:
            continue
        p = m.group(1)
        qkv_rows = (_grouped(nk, blk, 0, dk) + _grouped(nk, blk, dk, 2 * dk)
                    + _grouped(nk, blk, 2 * dk, 2 * dk + r * dv))
        out.append(Fuse(f"{p}.in_proj_qkvz.weight", (f"{p}.in_proj_qkv.weight", f"{p}.in_proj_z.weight"),
                        (qkv_rows, _grouped(nk, blk, 2 * dk + r * dv, blk))))
        out.append(Fuse(f"{p}.in_proj_ba.weight", (f"{p}.in_proj_b.weight", f"{p}.in_proj_a.weight"),
                        (_grouped(nk, 2 * r, 0, r), _grouped(nk, 2 * r, r, 2 * r))))
    return out


def _no_fuses(names: list[str], shapes: dict[str, tuple[int, ...]], dims: dict[str, Any]) -> list[Fuse]:
    return []


# Name family (Profile.family) -> its fused tensors: split on convert, fused again on export.
_SPLITS: dict[str, Callable[[dict[str, Any]], list[tuple[re.Pattern[str], Any]]]] = {
    "phi3": _phi3_splits, "qwen3_next": _linear_attn_splits}
_FUSES: dict[str, Callable[[list[str], dict[str, tuple[int, ...]], dict[str, Any]], list[Fuse]]] = {
    "phi3": _phi3_fuses, "qwen3_next": _linear_attn_fuses}


# ----------------------------------------------------------------------------------- ordering

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\Z")
_MTP_LAYER = re.compile(r"model\.mtp\.layers\.(\d+)\.(.+)\Z")
_EXPERT = re.compile(r"(?P<pre>.*\bmlp)\.experts\.(?P<e>\d+)\.(?P<role>gate_proj|up_proj|down_proj)\.weight\Z")
_HEAD = {"model.embed_tokens.weight": 0, "model.norm.weight": 1, "lm_head.weight": 2}


def _within(rest: str) -> tuple[Any, ...]:
    m = _EXPERT.match(rest)
    if m:  # one layer's experts: all gate_proj, then all up_proj, then all down_proj
        return (m.group("pre") + ".experts", EXPERT_ROLES.index(m.group("role")), int(m.group("e")))
    return (rest, -1, -1)


def sort_key(name: str) -> tuple[Any, ...]:
    """Canonical order (REFERENCE_NOTES §1.3, Python writer): embed, final norm, lm_head, layers by
    index, MTP, the rest; inside a layer by name, expert banks role-contiguous (spec §2.2)."""
    if name in _HEAD:
        return (0, _HEAD[name], ())
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), _within(m.group(2)))
    if name.startswith("model.mtp."):
        m = _MTP_LAYER.match(name)
        if m:
            return (2, 1 + int(m.group(1)), _within(m.group(2)))
        return (2, 0, (name, -1, -1))
    return (3, 0, (name, -1, -1))
