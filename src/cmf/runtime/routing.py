"""Skill selection by reconstruction error (recon-argmin) and soft-blend weights (spec §9,
REFERENCE_NOTES §1.12 and §3 "Skills").

Each routable skill stores an affine subspace of the prompt representation φ (the mean over the
prompt's tokens of the residual stream after layer ``phi_layer``): a mean and a rank-R
orthonormal basis B. A prompt's error against a skill is

    r = φ − mean,   E = max(‖r‖² − Σₖ (bₖ·r)², 0) / ‖φ‖²

(metric ``mse_unit`` first scales φ to unit length). The skill with the smallest E wins. The
division is by ‖φ‖², not ‖r‖²: the notes record that this is what the reference code does.

This module is numeric only: :func:`fit_selection` builds the registry's ``selection`` object,
:func:`recon_error` scores one φ, :func:`auto_blend` turns scores into blend weights. Running the
model to obtain φ is :meth:`cmf.runtime.model.Model.route`.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..format.errors import CmfError

METRICS = ("mse", "mse_unit")
POWER_STEPS = 50  # power-iteration steps per basis vector (notes §1.12)
MAX_RANK = 8
DEFAULT_RANK = 2
BLEND_TEMPERATURE = 0.4  # --blend auto: w ∝ exp(−E/0.4) over the top two (notes §3)
BLEND_TOP = 2
BLEND_ROUTE_TOKENS = 128  # blend auto routes on at most this many prompt tokens (notes §3)


class SelectionError(CmfError):
    """A skill's ``selection`` object cannot be used (bad base64, wrong sizes, unknown metric)."""


def default_phi_layer(num_layers: int) -> int:
    """2/3 of the depth (notes §1.12), as a layer index."""
    return max(0, min(num_layers - 1, (2 * num_layers) // 3))


def f16_b64(a: np.ndarray) -> str:
    """Base64 of the little-endian f16 bytes of ``a`` (the registry's encoding of mean and basis)."""
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f2").tobytes()).decode("ascii")


def f16_unb64(s: str, what: str) -> np.ndarray:
    """The float32 array of a base64 LE-f16 string."""
    try:
        raw = base64.b64decode(s.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise SelectionError(f"{what} is not valid base64") from None
    if len(raw) % 2:
        raise SelectionError(f"{what} has an odd number of bytes ({len(raw)}), not f16 values")
    return np.frombuffer(raw, dtype="<f2").astype(np.float32)


@dataclass(frozen=True)
class Subspace:
    """A decoded ``selection``: metric, phi layer, mean [H] and orthonormal basis [rank, H]."""

    skill: str
    metric: str
    phi_layer: int
    mean: np.ndarray
    basis: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, skill: str, sel: Mapping[str, Any], hidden: int, num_layers: int) -> "Subspace":
        """Decode and check a registry ``selection`` against the model's width and depth."""
        where = f"skill {skill!r} selection"
        metric = sel.get("metric")
        if metric not in METRICS:
            raise SelectionError(f"{where}: unknown metric {metric!r} (known: {', '.join(METRICS)})")
        layer = int(sel["phi_layer"])
        if not 0 <= layer < num_layers:
            raise SelectionError(f"{where}: phi_layer {layer} is outside the model's {num_layers} layers")
        rank = int(sel["rank"])
        mean = f16_unb64(sel["mean"], f"{where}.mean")
        basis = f16_unb64(sel["basis"], f"{where}.basis") if sel["basis"] else np.zeros(0, np.float32)
        if mean.size != hidden:
            raise SelectionError(f"{where}: mean has {mean.size} values, the model's hidden size is {hidden}")
        if basis.size != rank * hidden:
            raise SelectionError(f"{where}: basis has {basis.size} values, rank {rank} × hidden {hidden} "
                                 f"= {rank * hidden}")
        if not (np.isfinite(mean).all() and np.isfinite(basis).all()):
            raise SelectionError(f"{where}: mean or basis holds a non-finite value")
        extra = {k: sel[k] for k in ("err_mean", "err_std") if isinstance(sel.get(k), (int, float))}
        return cls(skill, metric, layer, mean, basis.reshape(rank, hidden), extra)

    @property
    def rank(self) -> int:
        return int(self.basis.shape[0])


def recon_error(phi: np.ndarray, sub: Subspace) -> float:
    """E of one prompt representation against one skill's subspace (see the module docstring)."""
    phi = np.asarray(phi, dtype=np.float64)
    n2 = float(phi @ phi)
    if n2 == 0.0 or not math.isfinite(n2):
        return math.inf
    if sub.metric == "mse_unit":
        phi = phi / math.sqrt(n2)
        n2 = 1.0
    r = phi - sub.mean.astype(np.float64)
    proj = sub.basis.astype(np.float64) @ r
    raw = max(float(r @ r) - float(proj @ proj), 0.0)
    return raw / n2


def _power_basis(centered: np.ndarray, rank: int, steps: int = POWER_STEPS) -> np.ndarray:
    """The top ``rank`` principal directions of the rows of ``centered``: power iteration from an
    all-ones start, each found direction deflated out of the data before the next."""
    x = np.array(centered, dtype=np.float64)
    h = x.shape[1]
    out = []
    for _ in range(rank):
        v = np.full(h, 1.0 / math.sqrt(h))
        n = 0.0
        for _ in range(steps):
            w = x.T @ (x @ v)
            n = float(np.linalg.norm(w))
            if n == 0.0:
                break
            v = w / n
        if n == 0.0:
            break  # the data has no variance left: a lower rank than asked
        out.append(v)
        x = x - np.outer(x @ v, v)  # deflation
    return np.array(out, dtype=np.float64).reshape(len(out), h)


def fit_selection(phis: np.ndarray, *, phi_layer: int, rank: int = DEFAULT_RANK, metric: str = "mse",
                  skill: str = "?") -> dict[str, Any]:
    """The registry ``selection`` object for prompts whose representations are the rows of ``phis``.

    mean = average φ; basis = min(rank, N−1, 8) principal directions (notes §1.12). ``err_mean``/
    ``err_std`` are the training prompts' own errors (computed with the stored f16 values).
    """
    if metric not in METRICS:
        raise SelectionError(f"unknown selection metric {metric!r} (known: {', '.join(METRICS)})")
    x = np.asarray(phis, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1:
        raise SelectionError("fitting a selection needs at least one prompt representation")
    if metric == "mse_unit":
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    mean = x.mean(axis=0)
    k = max(0, min(int(rank), x.shape[0] - 1, MAX_RANK))
    basis = _power_basis(x - mean, k) if k else np.zeros((0, x.shape[1]))
    sel: dict[str, Any] = {"metric": metric, "phi_layer": int(phi_layer), "mean": f16_b64(mean),
                           "basis": f16_b64(basis) if basis.size else "", "rank": int(basis.shape[0])}
    sub = Subspace.from_record(skill, sel, x.shape[1], int(phi_layer) + 1)
    errs = np.array([recon_error(p, sub) for p in np.asarray(phis, dtype=np.float64)])
    sel["err_mean"] = round(float(errs.mean()), 6)
    sel["err_std"] = round(float(errs.std()), 6)
    return sel


def auto_blend(scores: Mapping[str, float], top: int = BLEND_TOP,
               temperature: float = BLEND_TEMPERATURE) -> dict[str, float]:
    """Blend weights from routing errors: the ``top`` smallest E, w ∝ exp(−E/T), summing to 1."""
    best = sorted(((e, s) for s, e in scores.items() if math.isfinite(e)))[:top]
    if not best:
        return {}
    e0 = best[0][0]
    ws = {s: math.exp(-(e - e0) / temperature) for e, s in best}  # shifted: same ratios, no underflow
    total = sum(ws.values())
    return {s: w / total for s, w in ws.items()}


def normalize_blend(weights: Mapping[str | None, float], known: Sequence[str]) -> dict[str | None, float]:
    """Check a user blend {skill id, or None/"none" for the backbone: weight} and scale it to sum 1."""
    out: dict[str | None, float] = {}
    for k, w in weights.items():
        sid = None if k in (None, "none") else str(k)
        if sid is not None and sid not in known:
            raise CmfError(f"blend: no skill {sid!r} (skills: {', '.join(known) or 'none'})")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise CmfError(f"blend: the weight of {k!r} must be a finite number >= 0, got {w}")
        out[sid] = out.get(sid, 0.0) + w
    total = sum(out.values())
    if not out or total <= 0:
        raise CmfError("blend: the weights must name at least one skill and sum to more than 0")
    return {k: w / total for k, w in out.items()}


def parse_blend(spec: str) -> dict[str, float] | str:
    """``"auto"`` or ``"id:w,id:w,..."`` (the CLI's ``--blend``) → "auto" or {id: weight}."""
    spec = spec.strip()
    if spec == "auto":
        return "auto"
    out: dict[str, float] = {}
    for part in spec.split(","):
        sid, sep, w = part.strip().rpartition(":")
        if not sep or not sid:
            raise CmfError(f"--blend: {part.strip()!r} is not ID:WEIGHT (use auto or id:w,id:w)")
        try:
            out[sid] = out.get(sid, 0.0) + float(w)
        except ValueError:
            raise CmfError(f"--blend: weight {w!r} of {sid!r} is not a number") from None
    return out


@dataclass
class Route:
    """One routing decision: E per routable skill (ascending), the winner (None: the backbone)
    and, for a blend, its weights."""

    scores: dict[str, float]
    winner: str | None
    tokens: int
    blend: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``cmf route --json``)."""
        return {"winner": self.winner, "tokens": self.tokens,
                "scores": {k: (None if not math.isfinite(v) else v) for k, v in self.scores.items()},
                "blend": self.blend}


def routing_ids(tokenizer, prompt: Any) -> list[int]:
    """The tokens a prompt is routed on: ids as given; text tokenized without template or special
    tokens (notes §1.12); for chat messages, the last user message."""
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], (int, np.integer))):
        return [int(t) for t in prompt]
    if not isinstance(prompt, str):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        content = users[-1].get("content", "") if users else ""
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        prompt = str(content)
    return tokenizer.encode(prompt, add_special_tokens=False)
