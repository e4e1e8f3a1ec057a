"""Which dtype each tensor gets (REFERENCE_NOTES §1.8 "Dtype choice in the native converter").

With a quantized ``--quant``: 1-D tensors, tensors of other ranks and tensors under 32 elements
are f16; so are the small precision-critical matrices (MoE router ``mlp.gate.weight``,
``shared_expert_gate``, GDN ``in_proj_a``/``in_proj_b``, any ``conv1d``, ``self_attn.g_proj``).
Attention projections (``self_attn.*``, ``linear_attn.*``) take ``--attn-quant`` when given, every
other matrix the main quant. Under a sub-8-bit quant (q4, q4t, q4tp, q2tp, vbit, q1*) the token
table and output head (``embed_tokens.weight``, ``lm_head.weight``) are stored q8_row, as
llama.cpp keeps them at 8 bits (docs/QUANT.md). Formats that need ``in % 32 == 0`` (q4t, q4tp,
q2tp, vbit, q1*) fall back to q8_2f for a matrix whose input width is not a multiple of 32. ``--quant q2tp`` is a
profile: expert gate/up matrices (dense FFN gate/up in a model without experts) get q2tp, the
rest q4tp.

With a float ``--quant`` (f32, f16, bf16) every tensor is stored at that precision: f32 is the
lossless archive form (and what an exact HF -> CMF -> HF round trip needs), so the f16 rule for
1-D tensors, which buys nothing at full precision, does not apply there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConvertError

FLOATS = ("f32", "f16", "bf16")
# --quant name -> (dtype label, encoder options, header quant_type (REFERENCE_NOTES §1.2)).
QUANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "f32": ("f32", {}, "F32"), "f16": ("f16", {}, "F16"), "bf16": ("bf16", {}, "BF16"),
    "q8": ("q8_row", {}, "Q8_ROW"), "q8_2f": ("q8_2f", {}, "Q8_2F"),
    "q4": ("q4_block", {}, "Q4_BLOCK"), "q4t": ("q4_tiled", {}, "Q4_BLOCK"), "q4tp": ("q4tp", {}, "Q4_BLOCK"),
    "q2tp": ("q4tp", {}, "Q4_BLOCK"),  # a profile, see module docstring
    # vbit (8) is what every reference reader decodes (docs/INTERCHANGE.md); vbit_ro only on request.
    "vbit": ("vbit", {}, "VBIT"), "vbit_ro": ("vbit_ro", {}, "VBIT"),
    "q1": ("q1", {}, "VBIT"), "q1p": ("q1", {"diffusion": True}, "VBIT"), "q1s": ("q1s", {}, "VBIT"),
    "q1t": ("q1t", {}, "VBIT"),
}
# Spec labels accepted as spellings of the converter names.
QUANT_ALIASES = {"q8_row": "q8", "q4_block": "q4", "q4_tiled": "q4t"}
NEED_IN32 = frozenset({"q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro", "q1", "q1s", "q1t"})
FALLBACK = "q8_2f"
Q1T_MAX_IN = 65536  # q1t stores within-row columns as u16

FORCE_F16 = re.compile(
    r"(\.linear_attn\.in_proj_[ab]\.weight|conv1d\.weight|\.mlp\.gate\.weight|shared_expert_gate\.weight"
    r"|\.self_attn\.g_proj\.weight)\Z")
ATTENTION = re.compile(r"\.(self_attn|linear_attn)\.")
EXPERT_GATE_UP = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight\Z")
DENSE_GATE_UP = re.compile(r"\.mlp\.(gate_proj|up_proj)\.weight\Z")
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight\Z")
# The token table and the output head (one matrix when tied): a lookup table and the last
# projection, whose errors no later layer averages out (measured in docs/QUANT.md).
TOKEN_TABLE = re.compile(r"(\A|\.)(embed_tokens\.weight|lm_head\.weight)\Z")
SUB8 = frozenset({"q4", "q4t", "q4tp", "q2tp", "vbit", "q1", "q1p", "q1s", "q1t"})


def quant_name(q: str) -> str:
    """Normalise a ``--quant``/``--attn-quant`` spelling; ConvertError for an unknown one."""
    key = str(q).strip().lower()
    key = QUANT_ALIASES.get(key, key)
    if key not in QUANTS:
        raise ConvertError(f"unknown quant {q!r}; choose one of {', '.join(QUANTS)}")
    return key


@dataclass(frozen=True)
class Choice:
    """The dtype of one tensor, the encoder options, and why."""

    dtype: str
    options: dict[str, Any] = field(default_factory=dict, compare=False)
    reason: str = "quant"


@dataclass(frozen=True)
class Policy:
    """The dtype policy of one conversion."""

    quant: str
    attn_quant: str | None = None
    mean_bits: float = 4.25
    has_experts: bool = False  # decides where the q2tp profile puts its 2-bit matrices

    @classmethod
    def make(cls, quant: str, attn_quant: str | None = None, mean_bits: float | None = None,
             has_experts: bool = False) -> Policy:
        q = quant_name(quant)
        a = quant_name(attn_quant) if attn_quant is not None else None
        mb = 4.25 if mean_bits is None else float(mean_bits)
        if not 3.0 <= mb <= 8.0:
            raise ConvertError(f"--mean-bits {mb} is outside 3..8")
        return cls(q, a, mb, has_experts)

    @property
    def quant_type(self) -> str:
        """The header's informational ``quant_type`` for the main quant."""
        return QUANTS[self.quant][2]

    def _dtype_of(self, q: str, name: str, profile: bool) -> tuple[str, dict[str, Any]]:
        label, opts, _ = QUANTS[q]
        if profile and q == "q2tp":
            two_bit = EXPERT_GATE_UP.search(name) if self.has_experts else DENSE_GATE_UP.search(name)
            label = "q2tp" if two_bit else "q4tp"
        if label in ("vbit", "vbit_ro"):
            opts = {"mean_bits": self.mean_bits}
        return label, dict(opts)

    def small(self, name: str, shape: tuple[int, ...]) -> str:
        """Why tensor ``name`` stays out of the quantizers ("not 2-D", "< 32 elements",
        "precision-critical"), or "" for a matrix."""
        numel = 1
        for d in shape:
            numel *= d
        if len(shape) != 2:
            return "not 2-D"
        if numel < 32:
            return "< 32 elements"
        return "precision-critical" if FORCE_F16.search(name) else ""

    def choose(self, name: str, shape: tuple[int, ...]) -> Choice:
        """The dtype of tensor ``name`` of ``shape``."""
        small = self.small(name, shape)
        attn = self.attn_quant is not None and ATTENTION.search(name) is not None
        if self.quant in FLOATS:
            if small or not attn:
                return Choice(self.quant, {}, "float")
        elif small:
            return Choice("f16", {}, small)
        if self.quant in SUB8 and TOKEN_TABLE.search(name) and not attn:
            return Choice("q8_row", {}, "token table / output head")
        if attn:
            label, opts = self._dtype_of(self.attn_quant, name, profile=False)
            reason = "attn-quant"
        else:
            label, opts = self._dtype_of(self.quant, name, profile=True)
            reason = "quant"
        if label in FLOATS:
            return Choice(label, {}, reason)
        cols = shape[1]
        if label in NEED_IN32 and cols % 32:
            return Choice(FALLBACK, {}, f"in % 32 = {cols % 32}")
        if label == "q1t" and cols > Q1T_MAX_IN:
            return Choice(FALLBACK, {}, f"in > {Q1T_MAX_IN}")
        return Choice(label, opts, reason)

    def options(self) -> dict[str, Any]:
        """The options as recorded in provenance."""
        out: dict[str, Any] = {"quant": self.quant}
        if self.attn_quant is not None:
            out["attn_quant"] = self.attn_quant
        if {"vbit", "vbit_ro"} & {self.quant, self.attn_quant}:
            out["mean_bits"] = self.mean_bits
        return out


def kept_small(policy: Policy, name: str, shape: tuple[int, ...], stored: str,
               values: Any = None) -> tuple[str | None, Choice | None]:
    """What ``requant`` (and its ``--target-mb`` budget) does with a tensor the policy keeps out
    of the quantizers: (why, None) to keep it as stored, (why, f16) for one stored at f32 under a
    quantized profile — what ``convert`` writes (FORMATS.md: norms and biases are f16) — or
    (None, None) for a matrix it re-encodes. Under a float profile only 1-D and tiny tensors are
    kept (a precision-critical matrix takes the float like any other, as before). ``values``, the
    stored payload (raw bytes or float32), keeps at f32 a tensor that f16 would turn to ±inf
    (``convert`` writes the inf)."""
    import numpy as np

    why = policy.small(name, shape)
    floats = policy.quant in FLOATS
    if not why or (floats and why == "precision-critical"):
        return None, None
    if stored != "f32" or floats:
        return why, None
    if values is not None:
        v = np.asarray(values)
        v = v.view("<f4") if v.dtype != np.float32 else v  # an f32 payload's bytes are little-endian f32
        with np.errstate(over="ignore"):
            if not np.array_equal(np.isfinite(v.astype(np.float16)), np.isfinite(v)):
                return why, None
    return why, Choice("f16", {}, why + ", f32 -> f16")


def stored_target(policy: Policy, t: Any, selected: bool = True, values: Any = None) -> tuple[Choice | None, str]:
    """(Choice or None, reason) for one stored tensor ``t`` (a reader's QTensor): what
    ``requant`` writes for it under ``policy`` — None keeps it byte for byte — and why. The one
    rule for ``requant`` and its ``--target-mb`` budget's fixed bytes. ``selected``: the tensor
    passed ``--include``/``--exclude``; ``values``: its stored payload, for the f16 range check of
    :func:`kept_small`."""
    from ..format.constants import RESERVED_DTYPES

    if not selected:
        return None, "not selected"
    if t.dtype in RESERVED_DTYPES:
        return None, f"reserved dtype {t.dtype.label}"
    if t.name.endswith(".tid2eid"):
        return None, "token->expert table"
    shape = tuple(t.shape)
    why, small = kept_small(policy, t.name, shape, t.dtype.label, values)
    if why is not None:  # kept out of the quantizers: as stored, or f32 -> f16 as convert writes it
        return (small, small.reason) if small is not None else (None, why)
    choice = policy.choose(t.name, shape)
    if choice.dtype == t.dtype.label:
        return None, "already " + choice.dtype
    return choice, choice.reason


def is_expert(name: str) -> bool:
    """A routed expert matrix ``...mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    return EXPERT.search(name) is not None
