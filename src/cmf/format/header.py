"""Typed, read-only views of the header JSON (spec §2, §6.1, §9, §10; REFERENCE_NOTES §1.2, §1.12).

The parsed dict is the truth: every view keeps the dict it was built from in ``.raw``, so keys
this module does not know (``mla``, ``g3n``, ``calibration``, tool-specific provenance, ...)
survive a read → write round trip byte for byte. The typed fields are a validated projection of
that dict: a header the Rust reference would refuse (missing required key, wrong JSON type,
unknown enum string) raises :class:`ParseError` here too, naming the key path.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .constants import LAYER_TYPES, NORM_STYLES, QUANT_TYPES
from .errors import ParseError
from .json_fields import (_any, _bad, _bool, _build, _f, _num, _obj, _one_of, _raw, _str, _tuple_of, _type_name, _u32,
                          _usize, _view, parse_json, serialize_header)

__all__ = [
    "MTP", "Arch", "Header", "LinearCore", "MoE", "Shard", "SkillRecord", "TokenizerConfig", "Yarn",
    "as_arch", "parse_header", "parse_json", "serialize_header",
]


# ----------------------------------------------------------------------------- views


@dataclass(frozen=True)
class Yarn:
    """Global YaRN RoPE profile (``arch.yarn``)."""

    factor: float = _f(_num)
    original_max_position_embeddings: int = _f(_usize)
    beta_fast: float = _f(_num, 32.0)
    beta_slow: float = _f(_num, 1.0)
    attention_factor: float = _f(_num, 1.0)
    mscale_all_dim: float | None = _f(_num, None)
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True)
class MoE:
    """Mixture-of-experts FFN descriptor (``arch.moe``, spec §2.2)."""

    num_experts: int = _f(_usize)
    top_k: int = _f(_usize)
    moe_intermediate_size: int = _f(_usize)
    norm_topk_prob: bool = _f(_bool, False)
    shared_expert_intermediate_size: int | None = _f(_usize, None)
    router_sigmoid: bool = _f(_bool, False)
    routed_scaling_factor: float | None = _f(_num, None)  # None means 1.0
    router_resonance: bool = _f(_bool, False)
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True)
class MTP:
    """Multi-token-prediction head descriptor (``arch.mtp``, spec §2.1)."""

    num_layers: int = _f(_usize)
    share_lm_head: bool = _f(_bool, True)
    share_embed: bool = _f(_bool, True)
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True)
class LinearCore:
    """Linear-attention operator selector (``arch.linear_core``)."""

    kind: str = _f(_str)  # "gated_delta_net" | "vmf_phase"; open-ended, the runtime decides
    num_heads: int = _f(_usize)
    value_head_dim: int = _f(_usize)
    nphase: int | None = _f(_usize, None)
    raw: dict[str, Any] = _raw()


_opt_usize = (_usize, None)
_opt_num = (_num, None)


@dataclass(frozen=True)
class Arch:
    """The ``arch`` block: required geometry, defaults per REFERENCE_NOTES §1.2, optional extras."""

    arch_name: str = _f(_str)
    hidden_size: int = _f(_usize)
    intermediate_size: int = _f(_usize)
    num_layers: int = _f(_usize)
    num_attention_heads: int = _f(_usize)
    num_kv_heads: int = _f(_usize)
    head_dim: int = _f(_usize)
    vocab_size: int = _f(_usize)
    layer_types: tuple[str, ...] = _f(_tuple_of(_one_of(LAYER_TYPES)))
    rms_norm_eps: float = _f(_num)
    max_position_embeddings: int = _f(_usize)
    norm_style: str = _f(_one_of(NORM_STYLES), "qwen")
    rope_theta: float = _f(_num, 10000.0)
    partial_rotary_factor: float = _f(_num, 1.0)
    hidden_act: str = _f(_str, "silu")
    embed_multiplier: float = _f(_num, 1.0)
    num_loops: int = _f(_usize, 1)
    tie_word_embeddings: bool = _f(_bool, False)
    loop_final_norm: bool = _f(_bool, False)
    attn_v_norm: bool = _f(_bool, False)
    qk_norm_after_rope: bool = _f(_bool, False)
    yarn: Yarn | None = _f(_view(Yarn), None)
    moe: MoE | None = _f(_view(MoE), None)
    mtp: MTP | None = _f(_view(MTP), None)
    linear_core: LinearCore | None = _f(_view(LinearCore), None)
    mla: dict[str, Any] | None = _f(_obj, None)
    g3n: dict[str, Any] | None = _f(_obj, None)
    attention_heads_per_layer: tuple[int, ...] | None = _f(_tuple_of(_usize), None)
    sliding_window: int | None = _f(*_opt_usize)
    sliding_window_pattern: int | None = _f(*_opt_usize)
    rope_local_base_freq: float | None = _f(*_opt_num)
    local_partial_rotary_factor: float | None = _f(*_opt_num)
    query_pre_attn_scalar: float | None = _f(*_opt_num)
    final_logit_softcapping: float | None = _f(*_opt_num)
    attn_logit_softcapping: float | None = _f(*_opt_num)
    global_head_dim: int | None = _f(*_opt_usize)
    num_global_kv_heads: int | None = _f(*_opt_usize)
    global_partial_rotary_factor: float | None = _f(*_opt_num)
    linear_conv_kernel_dim: int | None = _f(*_opt_usize)
    linear_num_key_heads: int | None = _f(*_opt_usize)
    linear_num_value_heads: int | None = _f(*_opt_usize)
    linear_key_head_dim: int | None = _f(*_opt_usize)
    linear_value_head_dim: int | None = _f(*_opt_usize)
    rope_freq_factors: tuple[float, ...] | None = _f(_tuple_of(_num), None)
    logit_multiplier: float | None = _f(*_opt_num)
    head_clusters: int | None = _f(*_opt_usize)
    kda_gate_lower_bound: float | None = _f(*_opt_num)
    activation_situ_beta: float | None = _f(*_opt_num)
    activation_situ_linear_beta: float | None = _f(*_opt_num)
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Arch:
        """Validate and view an ``arch`` dict; raises :class:`ParseError`."""
        return _build(cls, d if isinstance(d, dict) else dict(d), "arch")

    def __post_init__(self) -> None:
        n, got = self.num_layers, len(self.layer_types)
        # [] is "no per-layer tags" (see layer_kinds); any other length cannot say which layer is
        # which, and silently filling the gap would run wrong operators.
        if got and got != n:
            raise ParseError(f"header: arch.layer_types lists {got} entries but arch.num_layers is {n}; "
                             f"give one per layer (or [] for untagged layers)")

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return self.moe.num_experts if self.moe is not None else 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The kind of every layer, as the runtime runs it (REFERENCE_NOTES §3).

        ``layer_types`` as written, ``[]`` meaning all FullAttention. When no layer is tagged
        SlidingAttention and ``sliding_window_pattern`` (P) is set, the Gemma-3 schedule applies to
        the attention layers: layer i is global iff (i + 1) % P == 0, else sliding. Writers that
        store only the pattern rely on this; tags, when present, always win.
        """
        kinds = self.layer_types or ("FullAttention",) * self.num_layers
        pattern = self.sliding_window_pattern
        if not pattern or "SlidingAttention" in kinds:
            return kinds
        return tuple("SlidingAttention" if k == "FullAttention" and (i + 1) % pattern else k
                     for i, k in enumerate(kinds))


@dataclass(frozen=True)
class SkillRecord:
    """One ``skills[]`` registry record (spec §9, §9.1; REFERENCE_NOTES §1.12)."""

    id: str = _f(_str)
    name: str | None = _f(_str, None)
    layers: tuple[int, ...] = _f(_tuple_of(_usize), ())
    selection: dict[str, Any] | None = _f(_obj, None)  # checked in _check_selection
    input_mask_task: str | None = _f(_str, None)
    quality: Any = _f(_any, None)  # free JSON (claim-16 contract)
    base_dir_hash: str | None = _f(_str, None)  # present => standalone SKILL_FILE record
    base_arch: str | None = _f(_str, None)
    task: str | None = _f(_str, None)
    provenance: Any = _f(_any, None)
    raw: dict[str, Any] = _raw()


_SELECTION_REQUIRED = {"metric": _str, "phi_layer": _usize, "mean": _str, "basis": _str,
                       "rank": _usize}  # `rank` is required by the Rust parser (notes §1.12)


def _check_selection(sel: dict[str, Any], path: str) -> None:
    for key, check in _SELECTION_REQUIRED.items():
        if key not in sel:
            raise ParseError(f"header: {path} is missing required key '{key}'")
        check(sel[key], f"{path}.{key}")


@dataclass(frozen=True)
class TokenizerConfig:
    """The chat bundle ``tokenizer_config`` (spec §6.1)."""

    chat_template: str | None = _f(_str, None)
    eos_token_ids: tuple[int, ...] = _f(_tuple_of(_u32), ())
    bos_token_id: int | None = _f(_u32, None)
    pad_token_id: int | None = _f(_u32, None)
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True)
class Shard:
    """Shard coordinates (spec §10), 1-based."""

    no: int = _f(_usize)
    count: int = _f(_usize)
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True)
class Header:
    """The whole header. ``raw`` is the parsed dict; views are built from it at parse time."""

    raw: dict[str, Any] = field(repr=False)
    format: str
    version: int
    quant_type: str
    arch: Arch
    skills: list[SkillRecord]
    tokenizer_config: TokenizerConfig | None
    shard: Shard | None
    section_hashes: dict[str, str]
    provenance: Any

    @property
    def moe(self) -> MoE | None:
        """``arch.moe``."""
        return self.arch.moe

    @property
    def mtp(self) -> MTP | None:
        """``arch.mtp``."""
        return self.arch.mtp

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Header:
        """Validate a header dict (e.g. one a writer assembled) and view it."""
        return _parse_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the header dict, unknown keys and key order included."""
        return copy.deepcopy(self.raw)

    def replace(self, changes: Mapping[str, Any] | None = None, *, remove: Iterable[str] = ()) -> Header:
        """A new, re-validated header with top-level keys set (appended if new) or removed."""
        d = self.to_dict()
        for k in remove:
            d.pop(k, None)
        d.update(copy.deepcopy(dict(changes or {})))
        return _parse_dict(d)

    def to_bytes(self) -> bytes:
        """:func:`serialize_header` of this header."""
        return serialize_header(self.raw)


def _parse_dict(d: Any) -> Header:
    if not isinstance(d, dict):
        raise ParseError(f"header: JSON must be an object, got {_type_name(d)}")
    for key in ("version", "arch", "quant_type"):
        if key not in d:
            raise ParseError(f"header: missing required key '{key}'")
    fmt = _str(d["format"], "format") if "format" in d else "cmf"
    version = _u32(d["version"], "version")
    quant_type = _one_of(QUANT_TYPES)(d["quant_type"], "quant_type")
    arch = _build(Arch, d["arch"], "arch")

    skills_raw = d.get("skills")
    if skills_raw is None:  # absent, or `null` from a lenient writer: no skills
        skills_raw = []
    elif not isinstance(skills_raw, list):
        raise _bad("skills", "an array", skills_raw)
    skills = []
    for i, rec in enumerate(skills_raw):
        skill = _build(SkillRecord, rec, f"skills[{i}]")
        if skill.selection is not None:
            _check_selection(skill.selection, f"skills[{i}].selection")
        skills.append(skill)

    tok = d.get("tokenizer_config")
    tokenizer_config = None if tok is None else _build(TokenizerConfig, tok, "tokenizer_config")
    sh = d.get("shard")
    shard = None if sh is None else _build(Shard, sh, "shard")
    if shard is not None and not 1 <= shard.no <= shard.count:
        raise ParseError(f"header: shard.no = {shard.no} is not in 1..count ({shard.count})")

    hashes: dict[str, str] = {}
    sh_raw = d.get("section_hashes")
    if sh_raw is not None:
        for k, v in _obj(sh_raw, "section_hashes").items():
            if k in ("masks", "vocab", "index") and v is not None:
                # Hex validity is a verify() problem (notes §1.11), not an open() error.
                hashes[k] = _str(v, f"section_hashes.{k}")
    return Header(raw=d, format=fmt, version=version, quant_type=quant_type, arch=arch,
                  skills=skills, tokenizer_config=tokenizer_config, shard=shard,
                  section_hashes=hashes, provenance=d.get("provenance"))


def as_arch(obj: Arch | Header | Mapping[str, Any]) -> Arch:
    """An :class:`Arch` from an Arch, a Header, or a raw ``arch`` dict (validated)."""
    if isinstance(obj, Arch):
        return obj
    if isinstance(obj, Header):
        return obj.arch
    return Arch.from_dict(obj)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse and validate header JSON bytes; every problem raises :class:`ParseError`."""
    return _parse_dict(parse_json(raw, "header"))
