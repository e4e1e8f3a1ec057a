"""The decoder, assembled from LayerPlans: forward(tokens, cache) → logits."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..format.errors import CmfError, NotRunnable
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .cache import Cache, LayerKV
from .ops.activations import activation
from .ops.attention import attend
from .ops.norm import prepare_norm_weight, rms_norm_prepared
from .ops.rope import apply_rope
from .plan import LayerPlan, ModelPlan, build_plan
from .weights import Weights

log = logging.getLogger(__name__)


class ContextOverflow(CmfError):
    """The sequence would exceed the context limit."""


class UnknownTask(CmfError, KeyError):
    """No task mask of that name in the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown task"


class UnknownSkill(CmfError, KeyError):
    """No skill of that id in the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown skill"


class Model:
    """A runnable model over one open CMF file. Create with :func:`cmf.load`."""

    def __init__(self, file: CmfFile, *, skill: str | None = None, task: str | None = None,
                 ctx_size: int | None = None, reference_kernels: bool = False, batch_size: int = 512) -> None:
        if file.is_skill_file:
            raise NotRunnable(f"{file.path} is a standalone skill file (SKILL_FILE): a partial tensor set, "
                              f"not a model. Attach it first: cmf skill apply BASE {file.path.name} -o OUT.cmf")
        self.file = file
        self.arch = file.arch
        self._reference = reference_kernels
        self._check_skill(skill)
        self.weights = Weights(file, skill, reference_kernels=reference_kernels)
        self.task: str | None = None
        self.plan: ModelPlan = build_plan(self.arch, self.weights.shape)
        self.ctx_size = int(ctx_size or self.plan.max_positions)
        self.batch_size = max(1, int(batch_size))
        self._tokenizer = None
        self._prepare()
        self.select(task=task)

    # -- set-up ----------------------------------------------------------------------------------
    def _norm(self, name: str | None) -> np.ndarray | None:
        return prepare_norm_weight(self.weights.vector(name), self.plan.gemma_norm) if name else None

    def _prepare(self) -> None:
        w = self.weights
        self._layers = []
        for lp in self.plan.layers:
            a = lp.attn
            self._layers.append({
                "in": self._norm(lp.input_norm), "post_attn": self._norm(lp.post_attn_norm),
                "pre_ffn": self._norm(lp.pre_ffn_norm), "post_ffn": self._norm(lp.post_ffn_norm),
                "q": w.linear(a.q), "k": w.linear(a.k), "v": w.linear(a.v), "o": w.linear(a.o),
                "qb": w.vector(a.q_bias), "kb": w.vector(a.k_bias), "vb": w.vector(a.v_bias),
                "ob": w.vector(a.o_bias), "qn": self._norm(a.q_norm), "kn": self._norm(a.k_norm),
                "g": w.linear(a.g_proj) if a.g_proj else None,
                "gate": w.linear(lp.ffn.gate), "up": w.linear(lp.ffn.up), "down": w.linear(lp.ffn.down),
                "act": activation(lp.ffn.act),
            })
        self._final_norm = self._norm(self.plan.final_norm)
        self._lm_head = w.linear(self.plan.lm_head)

    # -- tasks and skills --------------------------------------------------------------------------
    @property
    def skills(self) -> list[str]:
        """Skill ids of the file's registry."""
        return [s.id for s in self.file.skills]

    @property
    def tasks(self) -> list[str]:
        """Task mask names of the file (empty without a masks section)."""
        return self.file.masks.names() if self.file.masks is not None else []

    @property
    def skill(self) -> str | None:
        return self.weights.skill

    def _check_skill(self, skill: str | None) -> None:
        if skill not in (None, "none") and skill not in [s.id for s in self.file.skills]:
            known = ", ".join(s.id for s in self.file.skills) or "none"
            raise UnknownSkill(f"{self.file.path}: no skill {skill!r} (skills: {known})")

    def select(self, *, task: str | None = None, skill: str | None = ...) -> None:  # type: ignore[assignment]
        """Switch the active task mask and/or skill without reloading (``skill=None``: the backbone).

        Unknown names raise UnknownTask / UnknownSkill. Switching a skill re-prepares only the
        layers whose tensors the skill replaces (the others keep their prepared operators).
        """
        if task is not None and task not in self.tasks:
            raise UnknownTask(f"{self.file.path}: no task {task!r} (tasks: {', '.join(self.tasks) or 'none'})")
        if task is None and self.file.masks is not None:
            task = self.file.masks.default_task
        self.task = task
        if skill is not ...:
            skill = None if skill == "none" else skill
            if skill != self.weights.skill:
                self._check_skill(skill)
                self.weights = Weights(self.file, skill, reference_kernels=self._reference)
                self._prepare()

    @property
    def tokenizer(self):
        """The embedded tokenizer (spec §6), loaded on first use."""
        if self._tokenizer is None:
            from .tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.file)
        return self._tokenizer

    def new_cache(self) -> Cache:
        return Cache([LayerKV(lp.attn.kv_heads, lp.attn.head_dim, lp.attn.window, lp.attn.v_head_dim)
                      for lp in self.plan.layers])

    # -- forward ---------------------------------------------------------------------------------
    def _attention(self, lp: LayerPlan, L: dict, h: np.ndarray, kv: LayerKV, pos0: int) -> np.ndarray:
        a = lp.attn
        t = h.shape[0]
        q = L["q"](h)
        if L["qb"] is not None:
            q += L["qb"]
        gate = None
        if a.output_gate:
            q = q.reshape(t, a.heads, 2 * a.head_dim)
            q, gate = np.ascontiguousarray(q[..., :a.head_dim]), q[..., a.head_dim:]
        else:
            q = q.reshape(t, a.heads, a.head_dim)
        k = L["k"](h)
        if L["kb"] is not None:
            k += L["kb"]
        k = k.reshape(t, a.kv_heads, a.head_dim)
        v = L["v"](h)
        if L["vb"] is not None:
            v += L["vb"]
        v = v.reshape(t, a.kv_heads, a.v_head_dim)
        eps = self.plan.eps
        if L["qn"] is not None:
            q = rms_norm_prepared(q, L["qn"], eps)
        if L["kn"] is not None:
            k = rms_norm_prepared(k, L["kn"], eps)
        cos, sin = a.rope.cos_sin(np.arange(pos0, pos0 + t))
        q = apply_rope(np.array(q, dtype=np.float32), cos, sin)
        k = apply_rope(np.array(k, dtype=np.float32), cos, sin)
        keys, vals, k0 = kv.append(k, v)
        out = attend(q, keys, vals, pos0, k0, scale=a.scale, window=a.window, softcap=a.softcap)
        if gate is not None:
            out = out * (1.0 / (1.0 + np.exp(-gate)))
        if L["g"] is not None:
            g = L["g"](h)
            g = np.logaddexp(0, g).astype(np.float32)  # softplus
            out = out * (g[:, :, None] if g.shape[-1] == a.heads else g.reshape(out.shape))
        y = L["o"](out.reshape(t, -1))
        if L["ob"] is not None:
            y += L["ob"]
        return y

    def _mlp(self, L: dict, h: np.ndarray) -> np.ndarray:
        return L["down"](L["act"](L["gate"](h)) * L["up"](h))

    def forward(self, ids: np.ndarray | list[int], cache: Cache, *, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` (one chunk) after what ``cache`` holds; logits of the last token, or of all."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        t = ids.size
        if t == 0:
            raise ValueError("forward() needs at least one token")
        if cache.pos + t > self.ctx_size:
            raise ContextOverflow(f"context limit exceeded: {cache.pos} + {t} tokens > ctx size {self.ctx_size}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.plan.vocab:
            raise ValueError(f"token id out of range [0, {self.plan.vocab})")
        plan, eps = self.plan, self.plan.eps
        x = self.weights.rows(plan.embed, ids)
        if plan.embed_multiplier != 1.0:
            x *= np.float32(plan.embed_multiplier)
        pos0 = cache.pos
        for lp, L, kv in zip(plan.layers, self._layers, cache.layers):
            h = rms_norm_prepared(x, L["in"], eps) if L["in"] is not None else x
            a = self._attention(lp, L, h, kv, pos0)
            if lp.sandwich:
                if L["post_attn"] is not None:
                    a = rms_norm_prepared(a, L["post_attn"], eps)
                x = x + a
                f = self._mlp(L, rms_norm_prepared(x, L["pre_ffn"], eps))
                if L["post_ffn"] is not None:
                    f = rms_norm_prepared(f, L["post_ffn"], eps)
                x = x + f
            else:
                x = x + a
                h = rms_norm_prepared(x, L["post_attn"], eps) if L["post_attn"] is not None else x
                x = x + self._mlp(L, h)
        cache.pos += t
        if not all_logits:
            x = x[-1:]
        if self._final_norm is not None:
            x = rms_norm_prepared(x, self._final_norm, eps)
        logits = self._lm_head(x)
        if plan.logit_multiplier != 1.0:
            logits *= np.float32(plan.logit_multiplier)
        if plan.final_softcap:
            c = np.float32(plan.final_softcap)
            logits = np.tanh(logits / c) * c
        return logits.astype(np.float32, copy=False)

    def prefill(self, ids: list[int] | np.ndarray, cache: Cache, *, all_logits: bool = False) -> np.ndarray:
        """Feed ``ids`` in chunks of ``batch_size``; logits of the last token (or of all tokens)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if cache.pos + ids.size > self.ctx_size:
            raise ContextOverflow(f"context limit exceeded: {cache.pos} + {ids.size} tokens > ctx size "
                                  f"{self.ctx_size} (raise it with --ctx-size if the model allows)")
        outs = []
        for s in range(0, ids.size, self.batch_size):
            outs.append(self.forward(ids[s:s + self.batch_size], cache, all_logits=all_logits))
        return np.concatenate(outs) if all_logits else outs[-1]

    def logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Full-sequence logits [len, vocab] (float32) from a fresh cache."""
        return self.prefill(token_ids, self.new_cache(), all_logits=True)

    # -- generation ------------------------------------------------------------------------------
    def stream(self, prompt, **kwargs):
        """Yield GenerationResponse deltas (see cmf.runtime.generate.stream_generate)."""
        from .generate import stream_generate

        return stream_generate(self, prompt, **kwargs)

    def generate(self, prompt, **kwargs) -> str:
        """Generate and return the text (see cmf.runtime.generate.generate)."""
        from .generate import generate

        return generate(self, prompt, **kwargs)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(path: str | os.PathLike, *, task: str | None = None, skill: str | None = None,
         threads: int | None = None, ctx_size: int | None = None, reference_kernels: bool = False,
         batch_size: int = 512) -> Model:
    """Open a .cmf (or any shard of a set) and build a runnable Model."""
    if threads:
        try:
            import numba

            numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        except ImportError:  # pragma: no cover
            pass
    file = cmf_open(Path(path))
    try:
        return Model(file, skill=skill, task=task, ctx_size=ctx_size, reference_kernels=reference_kernels,
                     batch_size=batch_size)
    except BaseException:
        file.close()
        raise
