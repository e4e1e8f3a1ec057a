"""Which dtype each tensor of a pipeline gets (FORMATS.md "What the packer decides for you").

Every tensor has a *role*:

- ``te`` / ``dit``: a 2-D matrix of the text encoder / denoiser — the main ``--quant``;
- ``token_table``: the text encoder's embedding table — q8 (a lookup table: no later layer
  averages its error out);
- ``modulation``: the adaLN / timestep projections (recipe ``modulation``) — f16: a map of one
  number whose error lands in every token's normalization;
- ``vae``: every VAE decoder tensor — f16 (convolutions and norms; nothing here is large);
- ``vector``: 1-D tensors and tensors under 32 elements (norm weights, biases, pad tokens) — f16;
- ``other``: te/dit tensors of another rank — f16.

These defaults hold for a quantized ``--quant``. With a float ``--quant`` (f32, f16, bf16)
every role takes it, so ``--quant f32`` is the lossless pack. ``overrides`` ({role: quant})
replace any default. A quantized dtype only ever goes to a 2-D tensor (others get f16), and
formats needing ``in % 32 == 0`` fall back to q8 for a matrix that does not have it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from .errors import ImageError
from .recipes import Recipe

# --quant spelling -> spec dtype label
QUANTS: dict[str, str] = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8": "q8_row", "q8_2f": "q8_2f",
                          "q4": "q4_block", "q4t": "q4_tiled", "q4tp": "q4tp", "q2tp": "q2tp"}
ALIASES = {"q8_row": "q8", "q4_block": "q4", "q4_tiled": "q4t"}
FLOATS = frozenset({"f32", "f16", "bf16"})
QUANT_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8": "Q8_ROW", "q8_2f": "Q8_2F", "q4": "Q4_BLOCK",
              "q4t": "Q4_BLOCK", "q4tp": "Q4_BLOCK", "q2tp": "Q4_BLOCK"}
NEED_IN32 = frozenset({"q4_tiled", "q4tp", "q2tp"})
ROLES = ("te", "dit", "vae", "token_table", "modulation", "vector", "other")
# The default of each role under a quantized --quant ("main" = the --quant itself).
QUANTIZED_DEFAULTS = {"te": "main", "dit": "main", "vae": "f16", "token_table": "q8", "modulation": "f16",
                      "vector": "f16", "other": "f16"}


def quant_name(q: str) -> str:
    """Normalise a quant spelling; :class:`ImageError` for one the packer does not write."""
    key = ALIASES.get(str(q).strip().lower(), str(q).strip().lower())
    if key not in QUANTS:
        raise ImageError(f"unknown quant {q!r} for a pipeline; choose one of {', '.join(QUANTS)}")
    return key


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """``["modulation=q8", "vae=f32"]`` -> {role: quant}; :class:`ImageError` naming a bad item."""
    out: dict[str, str] = {}
    for item in items or ():
        role, sep, q = item.partition("=")
        role = role.strip()
        if not sep or role not in ROLES:
            raise ImageError(f"--policy {item!r}: expected ROLE=QUANT with ROLE one of {', '.join(ROLES)}")
        out[role] = quant_name(q)
    return out


@dataclass(frozen=True)
class Pick:
    """The dtype label of one tensor, its role and why."""

    dtype: str
    role: str
    reason: str


@dataclass(frozen=True)
class ImagePolicy:
    """The dtype policy of one pack."""

    quant: str
    overrides: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def make(cls, quant: str, overrides: Mapping[str, str] | None = None) -> ImagePolicy:
        return cls(quant_name(quant), {r: quant_name(q) for r, q in (overrides or {}).items()})

    @property
    def quant_type(self) -> str:
        """The header's informational ``quant_type`` (the directory is the truth)."""
        return QUANT_TYPE[self.quant]

    def role_quant(self, role: str) -> str:
        """The quant a role gets (after overrides)."""
        if role in self.overrides:
            return self.overrides[role]
        if self.quant in FLOATS:
            return self.quant
        rule = QUANTIZED_DEFAULTS[role]
        return self.quant if rule == "main" else rule

    def table(self) -> dict[str, str]:
        """{role: quant} as this pack applies it (recorded in provenance)."""
        return {r: self.role_quant(r) for r in ROLES}

    def role_of(self, recipe: Recipe, prefix: str, name: str, shape: tuple[int, ...]) -> str:
        """The role of tensor ``name`` (within-component name) of component ``prefix``."""
        numel = 1
        for d in shape:
            numel *= d
        if prefix == "vae":
            return "vae"
        if len(shape) <= 1 or numel < 32:
            return "vector"
        if re.match(recipe.modulation, name):
            return "modulation"
        if prefix == recipe.text_encoder and re.match(recipe.token_table, name):
            return "token_table"
        if len(shape) != 2:
            return "other"
        return prefix if prefix in ("te", "dit") else "other"

    def choose(self, recipe: Recipe, prefix: str, name: str, shape: tuple[int, ...]) -> Pick:
        """The dtype of tensor ``name`` of component ``prefix``."""
        role = self.role_of(recipe, prefix, name, shape)
        q = self.role_quant(role)
        label = QUANTS[q]
        reason = "override" if role in self.overrides else ("main quant" if q == self.quant else "role default")
        if q not in FLOATS and len(shape) != 2:
            return Pick("f16", role, f"{q} needs a 2-D tensor")
        if label in NEED_IN32 and shape[1] % 32:
            return Pick("q8_row", role, f"in % 32 = {shape[1] % 32}")
        return Pick(label, role, reason)
