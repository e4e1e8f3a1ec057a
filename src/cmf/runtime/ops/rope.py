"""Rotary position embeddings: default, linear, llama3 and YaRN profiles, partial rotary.

Frequencies are computed in float32 as Hugging Face does; rotation pairs dimension i with
i + d/2 (the "half split"), over the first ``rotary_dim`` dimensions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class RopeProfile:
    """One rope profile: inverse frequencies (rotary_dim/2), rotary_dim and the cos/sin scale."""

    inv_freq: np.ndarray
    rotary_dim: int
    attention_factor: float = 1.0

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape [T, rotary_dim] for integer positions."""
        freqs = np.asarray(positions, dtype=np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb), np.sin(emb)
        if self.attention_factor != 1.0:
            f = np.float32(self.attention_factor)
            cos, sin = cos * f, sin * f
        return cos.astype(np.float32), sin.astype(np.float32)

    def cos_sin_at(self, pos0: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`cos_sin` of positions pos0 .. pos0 + t − 1, shared: callers only read them. The
        last range asked for is kept, because every layer of a forward asks for the same one (30
        computations of a 30-token prompt's rows were 3% of its prefill on SmolLM2-135M)."""
        last = getattr(self, "_last", None)
        if last is not None and last[0] == pos0 and last[1] == t:
            return last[2], last[3]
        cos, sin = self.cos_sin(np.arange(pos0, pos0 + t))
        object.__setattr__(self, "_last", (pos0, t, cos, sin))  # one assignment: a reader sees all or none
        return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, head_dim] in place of its first cos.shape[-1] dims; returns x.

    The numpy reference: the runtime rotates with one kernel, ``ops/decode.rope_into`` (the
    decode step, and blocks of tokens through ``rowwise.qk_norm_rope_rows`` / ``rope_rows``),
    which computes the same float32 operations and is tested equal to this to the bit."""
    d = cos.shape[-1]
    if d == 0:
        return x
    half = d // 2
    rot = x[..., :d]
    x1 = rot[..., :half].copy()
    x2 = rot[..., half:d].copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    rot[..., :half] = x1 * c[..., :half] - x2 * s[..., :half]
    rot[..., half:d] = x2 * c[..., half:] + x1 * s[..., half:]
    return x


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def _yarn(theta: float, dim: int, p: Mapping[str, Any]) -> tuple[np.ndarray, float]:
    factor = float(p["factor"])
    orig = float(p["original_max_position_embeddings"])
    beta_fast = float(p.get("beta_fast") or 32.0)
    beta_slow = float(p.get("beta_slow") or 1.0)
    att = p.get("attention_factor")
    if att is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, mall = p.get("mscale"), p.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, mall) if m and mall else mscale(factor)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)
    inv = inter * (1 - keep) + extra * keep
    return inv.astype(np.float32), float(att)


def _llama3(inv: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor = float(p["factor"])
    low_f, high_f = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    low_wl, high_wl = old / low_f, old / high_f
    wavelen = (2 * math.pi / inv).astype(np.float32)
    out = np.where(wavelen > low_wl, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old / wavelen - low_f) / (high_f - low_f)).astype(np.float32)
    smoothed = (1 - smooth) * out / np.float32(factor) + smooth * out
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, out).astype(np.float32)


def build_rope(theta: float, head_dim: int, partial: float = 1.0,
               scaling: Mapping[str, Any] | None = None, freq_factors: list[float] | None = None) -> RopeProfile:
    """A rope profile from header values. ``scaling`` is a yarn block, or an HF-style
    ``{"rope_type": "linear"|"llama3"|"yarn", ...}`` dict; ``freq_factors`` divide the frequencies."""
    dim = int(head_dim * partial)
    att = 1.0
    kind = (scaling or {}).get("rope_type", "yarn" if scaling and "beta_fast" in scaling else None)
    if scaling and (kind == "yarn" or (kind is None and "original_max_position_embeddings" in scaling
                                       and "factor" in scaling and "low_freq_factor" not in scaling)):
        inv, att = _yarn(theta, dim, scaling)
    else:
        inv = _base_inv_freq(theta, dim)
        if kind == "linear":
            inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors:
        inv = (inv / np.asarray(freq_factors, dtype=np.float32)[: inv.size]).astype(np.float32)
    return RopeProfile(inv_freq=inv, rotary_dim=dim - dim % 2, attention_factor=att)
