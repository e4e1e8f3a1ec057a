"""The decoder, assembled from LayerPlans: forward(tokens, cache) → logits."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import numba
import numpy as np

from ..format.errors import CmfError, NotRunnable
from ..format.masks import TaskMask
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .blocks import Block, MoeFfn
from .cache import Cache
from .features import check_runnable
from .load_checks import moe_keep, verify_or_refuse
from .memory import PackedSourceReleaser, release_compiler_pages, release_pages
from .ops.decode import rms_norm_into
from .ops.norm import prepare_norm_weight, rms_norm_prepared
from .plan import ModelPlan, build_plan
from .task_masks import NO_TASK, resolve_task
from .weights import Weights

log = logging.getLogger(__name__)
# Prefill chunk (tokens per forward). 256 prefills as fast as 512 here (BLAS is saturated from
# ~128 rows) with a lower peak: 512-token chunks held ~75 MB more activations on the f16
# benchmark model (630 against 553 MB peak), 16 MB more on q4_tiled.
DEFAULT_BATCH = 256
# Decode looks up one embedding row a token; its pages (and the kernel's fault-around neighbours)
# are given back every this many forwards, so a long generation does not map the whole table.
EMBED_RELEASE_EVERY = 64


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
                 ctx_size: int | None = None, reference_kernels: bool = False, batch_size: int | None = DEFAULT_BATCH,
                 moe_mask: "str | os.PathLike | dict | None" = None, moe_mask_cover: float | None = None,
                 blend: "Mapping[str, float] | str | None" = None, int8_activations: bool = False) -> None:
        if file.is_skill_file:
            raise NotRunnable(f"{file.path} is a standalone skill file (SKILL_FILE): a partial tensor set, "
                              f"not a model. Attach it first: cmf skill apply BASE {file.path.name} -o OUT.cmf")
        # A key this runtime does not model is refused here, never ignored (runtime/features.py).
        check_runnable(file.header, file.keys(), file.path)
        self.file = file
        self.arch = file.arch
        self._reference = reference_kernels
        self.int8_activations = bool(int8_activations)
        self._check_skill(skill)
        self._auto: str | None = None  # "skill" / "blend": route every prompt (see select)
        self.last_route = None  # the latest routing.Route, when a prompt was routed
        self._bb_weights: Weights | None = None  # backbone view for routing while a skill is active
        self.weights = Weights(file, None if skill in ("auto", "none") else skill,
                               reference_kernels=reference_kernels, int8_activations=self.int8_activations)
        self.task: str | None = None  # the active task mask's name (None: unmasked)
        self._task_request: str | None = task  # what the caller asked: a name, NO_TASK or None (the rule)
        self.plan: ModelPlan = build_plan(self.arch, self.weights.shape)
        self.ctx_size = int(ctx_size or self.plan.max_positions)
        self.batch_size = max(1, int(DEFAULT_BATCH if batch_size is None else batch_size))
        self._tokenizer = None
        self._route_counts = False
        self._forwards = 0
        self._releaser = PackedSourceReleaser(file)
        self._moe_keep = moe_keep(moe_mask, moe_mask_cover, self.plan) if moe_mask is not None else {}
        self._prepare()
        self.select(task=task)
        if blend is not None:
            self.select(task=task, blend=blend)
        elif skill == "auto":
            self.select(task=task, skill="auto")

    # -- set-up ----------------------------------------------------------------------------------
    def _norm(self, name: str | None) -> np.ndarray | None:
        return prepare_norm_weight(self.weights.vector(name), self.plan.gemma_norm) if name else None

    def _prepare(self) -> None:
        w, plan = self.weights, self.plan
        old = getattr(self, "_blocks", None)
        self._blocks = [self._make_block(lp) for lp in plan.layers]
        self._final_norm = self._norm(plan.final_norm)
        self._lm_head = w.linear(plan.lm_head)
        self._head_step = None  # the lm_head as a one-token MatvecGroup (project)
        # The embedding's mapped bytes, given back after lookups (memory.release_pages) unless a
        # head reads the whole matrix every token (tied weights).
        heads = {plan.lm_head} | ({plan.mtp.lm_head} if plan.mtp is not None else set())
        self._embed_pages = None if plan.embed in heads or plan.embed in w._mixed else w.qtensor(plan.embed).numpy()
        self._mtp = None  # the MTP head is built on first use (speculative.py)
        for i, b in enumerate(self._blocks):
            if isinstance(b.ffn, MoeFfn) and old is not None and isinstance(old[i].ffn, MoeFfn):
                b.ffn.counts = old[i].ffn.counts  # statistics survive a skill switch
        self._apply_expert_masks()

    # -- MoE: routing statistics and expert restriction ----------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i, b in enumerate(self._blocks) if isinstance(b.ffn, MoeFfn)]

    def collect_route_stats(self, on: bool = True) -> None:
        """Count, per MoE layer, how often each expert is selected (see :meth:`route_stats`)."""
        for b in self._blocks:
            if isinstance(b.ffn, MoeFfn):
                b.ffn.counts = (b.ffn.counts if b.ffn.counts is not None else
                                np.zeros(b.ffn.m.n_experts, np.int64)) if on else None

    def route_stats(self) -> dict[str, list[int]]:
        """{layer: [selections per expert]} since :meth:`collect_route_stats` (the JSON that
        ``cmf convert --route-stats`` and ``moe-defrag`` read, spec §11.1)."""
        return {str(i): b.ffn.counts.tolist() for i, b in enumerate(self._blocks)
                if isinstance(b.ffn, MoeFfn) and b.ffn.counts is not None}

    def reset_route_stats(self) -> None:
        for b in self._blocks:
            if isinstance(b.ffn, MoeFfn) and b.ffn.counts is not None:
                b.ffn.counts[:] = 0

    def _apply_expert_masks(self) -> None:
        """Apply the active task mask (spec §5): FFN neurons, heads and layer gates per layer (see
        runtime/task_masks.py), and the admitted experts per MoE layer: the runtime mask
        (CMF_MOE_MASK) ∧ the task mask's row. Called after every selection change."""
        mask = getattr(self, "_adhoc_mask", None)
        if mask is None:
            # The default rule depends on the active skill (its input_mask_task), so it is resolved
            # after every selection change, routed prompts included.
            self.task = resolve_task(self.file, self._task_request, self.weights.skill)
            mask = self.file.masks.get(self.task) if (self.file.masks is not None and self.task) else None
        from .task_masks import apply_task_mask

        apply_task_mask(self, mask)
        for i, b in enumerate(self._blocks):
            if not isinstance(b.ffn, MoeFfn):
                continue
            n = b.ffn.m.n_experts
            allowed = self._moe_keep.get(i)
            if mask is not None and mask.experts is not None and i < mask.experts.shape[0]:
                row = np.asarray(mask.experts[i][:n], dtype=bool)
                if row.size == n and row.any():  # an empty row means "unrestricted"
                    allowed = row if allowed is None else (allowed & row)
            if allowed is not None and not allowed.any():
                raise CmfError(f"layer {i}: the expert masks admit no expert")
            b.ffn.allowed = None if allowed is None or allowed.all() else allowed

    def use_mask(self, mask: "TaskMask | None") -> None:
        """Activate an in-memory task mask that is not (yet) in the file, as ``cmf mask create``
        does to measure a candidate; None runs unmasked. The next :meth:`select` returns to the
        file's masks."""
        self._adhoc_mask = mask
        self.task = mask.name if mask is not None else None
        self._mask_applied = self.task  # a candidate being measured: no "unmeasured" warning
        self._apply_expert_masks()

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
        if skill not in (None, "none", "auto") and skill not in [s.id for s in self.file.skills]:
            known = ", ".join(s.id for s in self.file.skills) or "none"
            raise UnknownSkill(f"{self.file.path}: no skill {skill!r} (skills: {known})")

    @property
    def blend(self) -> dict[str | None, float] | None:
        """The active soft blend {skill id or None (backbone): weight}, or None."""
        return self.weights.blend

    @property
    def auto(self) -> str | None:
        """"skill" or "blend" when every prompt is routed (``skill="auto"`` / ``blend="auto"``)."""
        return self._auto

    def select(self, *, task: str | None = None, skill: str | None = ...,  # type: ignore[assignment]
               blend: "Mapping[str, float] | str | None" = None, route_prompt: Any = None):
        """Switch the active task mask, skill or blend without reloading.

        ``skill``: an id, None or "none" (the backbone), or "auto" (route each prompt by
        recon-argmin; no routable skill → the backbone); left out, the current selection stays.
        ``blend``: {id: weight} (normalized to sum 1; "none" names the backbone) or "auto" (the two
        skills with the smallest E, w ∝ exp(−E/0.4)); it replaces the skill. With an "auto"
        selection the prompt is routed now when ``route_prompt`` (text, messages or token ids) is
        given, else by the next :meth:`stream`/:meth:`generate`. Returns the routing.Route made
        here, or None.

        ``task``: a mask name, ``"none"`` (:data:`NO_TASK`: run unmasked) or None: the default
        rule (:func:`resolve_task`: the selected skill's ``input_mask_task``, else the file's
        ``default_task``, else its Fallback-priority mask, else its first mask).

        Unknown names raise UnknownTask / UnknownSkill. Switching re-prepares only the layers
        whose tensors change (the others keep their prepared operators).
        """
        self._adhoc_mask = None  # back to the file's masks (see use_mask)
        if task is not None and task != NO_TASK and task not in self.tasks:
            raise UnknownTask(f"{self.file.path}: no task {task!r} (tasks: {', '.join(self.tasks) or 'none'}; "
                              f"'{NO_TASK}' runs unmasked)")
        self._task_request = task
        if blend is not None:
            if skill not in (..., None, "none"):
                raise ValueError("give a skill or a blend, not both")
            if isinstance(blend, str):
                if blend != "auto":
                    from .routing import parse_blend

                    blend = parse_blend(blend)
            if blend == "auto":
                self._auto = "blend"
            else:
                from .routing import normalize_blend

                for sid in blend:  # type: ignore[union-attr]
                    if sid not in (None, "none"):
                        self._check_skill(sid)  # UnknownSkill, as for skill=
                self._auto = None
                self._switch(None, normalize_blend(blend, self.skills))  # type: ignore[arg-type]
        elif skill is not ...:
            self._check_skill(skill)
            if skill == "auto":
                self._auto = "skill"
            else:
                self._auto = None
                self._switch(None if skill == "none" else skill, None)
        self._apply_expert_masks()
        if self._auto and route_prompt is not None:
            return self.route_select(route_prompt)
        return None

    def _make_block(self, lp, weights: Weights | None = None) -> Block:
        """The executable layer of LayerPlan ``lp`` over ``weights`` (default: the current ones)."""
        return Block(lp, weights or self.weights, self.plan.gemma_norm, self.plan.eps)

    def _switch(self, skill: str | None, blend: "Mapping[str | None, float] | None") -> None:
        """Point the weights at a skill/blend and re-prepare only what reads a changed tensor."""
        changed = self.weights.configure(skill, blend)
        if not changed:
            return
        plan = self.plan
        rebuilt = 0
        for i, lp in enumerate(plan.layers):
            if _plan_names(lp) & changed:
                old = self._blocks[i]
                self._blocks[i] = self._make_block(lp)
                if isinstance(old.ffn, MoeFfn) and isinstance(self._blocks[i].ffn, MoeFfn):
                    self._blocks[i].ffn.counts = old.ffn.counts  # statistics survive a switch
                rebuilt += 1
        if plan.final_norm in changed:
            self._final_norm = self._norm(plan.final_norm)
        if plan.lm_head in changed:
            self._lm_head = self.weights.linear(plan.lm_head)
        if plan.mtp is not None:
            self._mtp = None  # rebuilt on first use over the new sources
        log.debug("selection skill=%s blend=%s: %d tensors changed, %d of %d layers re-prepared",
                  self.weights.skill, self.weights.blend, len(changed), rebuilt, len(plan.layers))

    # -- routing (spec §9: recon-argmin) -------------------------------------------------------------
    def subspaces(self) -> list:
        """The routable skills' decoded selections (routing.Subspace), in registry order."""
        from .routing import Subspace

        return [Subspace.from_record(s.id, s.selection, self.plan.hidden, len(self.plan.layers))
                for s in self.file.skills if s.selection is not None]

    def residual(self, ids: np.ndarray | list[int], layer: int) -> np.ndarray:
        """The backbone's residual stream after layer ``layer`` (inclusive, no final norm) for
        ``ids`` from a fresh state: [T, hidden]. Layers the active skill or blend replaces run
        with backbone operators built for the call, so φ never depends on the selection."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("routing needs at least one prompt token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.plan.vocab:
            raise ValueError(f"token id out of range [0, {self.plan.vocab})")
        w = self.weights
        changed = set().union(*(w.replaced(s) for s in ([w.skill] if w.blend is None else list(w.blend))))
        if changed and self._bb_weights is None:
            self._bb_weights = Weights(self.file, reference_kernels=self._reference,
                                       int8_activations=self.int8_activations)
        blocks = []
        for lp, b in zip(self.plan.layers[:layer + 1], self._blocks):
            if _plan_names(lp) & changed:
                b = self._make_block(lp, self._bb_weights)
            blocks.append(b)
        src = self._bb_weights if changed else w
        states = [b.new_state() for b in blocks]
        outs = []
        for s0 in range(0, ids.size, self.batch_size):
            chunk = ids[s0:s0 + self.batch_size]
            x = src.rows(self.plan.embed, chunk)
            if self.plan.embed_multiplier != 1.0:
                x *= np.float32(self.plan.embed_multiplier)
            for b, st in zip(blocks, states):
                x = b(x, st, s0)
            outs.append(x)
        return np.concatenate(outs)

    def route(self, prompt: Any, *, max_tokens: int | None = None):
        """Score ``prompt`` (text, chat messages or token ids) against every routable skill:
        routing.Route with E per skill, the winner (None when no skill is routable)."""
        from .routing import Route, recon_error, routing_ids

        ids = routing_ids(self.tokenizer, prompt)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        subs = self.subspaces()
        scores: dict[str, float] = {}
        phis: dict[int, np.ndarray] = {}
        # φ is the unmasked backbone's, as the reference routes on a fresh pipeline (main.rs
        # cmd_run → router::route over Pipeline::from_model): an active task mask is lifted.
        from .task_masks import apply_task_mask

        apply_task_mask(self, None)
        try:
            for sub in subs:
                if sub.phi_layer not in phis:
                    phis[sub.phi_layer] = self.residual(ids, sub.phi_layer).astype(np.float64).mean(axis=0)
                scores[sub.skill] = recon_error(phis[sub.phi_layer], sub)
        finally:
            self._apply_expert_masks()
        ranked = dict(sorted(scores.items(), key=lambda kv: kv[1]))
        return Route(ranked, next(iter(ranked), None), len(ids))

    def route_select(self, prompt: Any):
        """Route ``prompt`` under the active "auto" mode and switch to the result; returns the Route."""
        from .routing import BLEND_ROUTE_TOKENS, auto_blend

        if self._auto == "blend":
            r = self.route(prompt, max_tokens=BLEND_ROUTE_TOKENS)
            r.blend = auto_blend(r.scores)
            self._switch(None, r.blend or None)
        else:
            r = self.route(prompt)
            self._switch(r.winner, None)
        self._apply_expert_masks()
        self.last_route = r
        log.info("routed %d prompt tokens: %s", r.tokens, r.blend if r.blend is not None else r.winner or "backbone")
        return r

    @property
    def has_mtp(self) -> bool:
        """Whether the file carries an MTP head usable for speculative decoding."""
        return self.plan.mtp is not None

    def mtp_head(self):
        """The MTP draft head (runtime/speculative.py), built on first use."""
        if self._mtp is None:
            from .speculative import MtpHead

            self._mtp = MtpHead(self)
        return self._mtp

    @property
    def tokenizer(self):
        """The embedded tokenizer (spec §6), loaded on first use."""
        if self._tokenizer is None:
            from .tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.file)
        return self._tokenizer

    def new_cache(self) -> Cache:
        """Fresh per-sequence state: a KV (or latent) cache per attention layer, conv + recurrent
        state per linear-attention layer."""
        return Cache([b.new_state() for b in self._blocks])

    # -- forward ---------------------------------------------------------------------------------
    def hidden(self, ids: np.ndarray | list[int], cache: Cache) -> np.ndarray:
        """Run ``ids`` (one chunk) after what ``cache`` holds; the final-normed hidden states [T, hidden]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        t = ids.size
        if t == 0:
            raise ValueError("forward() needs at least one token")
        if cache.pos + t > self.ctx_size:
            raise ContextOverflow(f"context limit exceeded: {cache.pos} + {t} tokens > ctx size {self.ctx_size}")
        lo, hi = (int(ids[0]),) * 2 if t == 1 else (int(ids.min()), int(ids.max()))
        if lo < 0 or hi >= self.plan.vocab:
            raise ValueError(f"token id out of range [0, {self.plan.vocab})")
        plan = self.plan
        x = self.weights.row(plan.embed, lo) if t == 1 else self.weights.rows(plan.embed, ids)
        if plan.embed_multiplier != 1.0:
            x *= np.float32(plan.embed_multiplier)
        pos0 = cache.pos
        self._forwards += 1
        if self._embed_pages is not None and (t > 1 or self._forwards % EMBED_RELEASE_EVERY == 0):
            release_pages(self._embed_pages)
        # Give back the mapped pages of freshly repacked 4-bit tiles and the compiler's code pages,
        # layer by layer (memory.py): after every prefill and after decode forwards 1, 2, 4, 8, ...
        # (tiles are packed once; kernels load from numba's cache at a layer's first call).
        watch = t > 1 or not self._forwards & (self._forwards - 1)
        if t == 1:  # decode: the fused one-token step over per-layer buffers (runtime/step.py)
            nt = numba.get_num_threads()  # read once: numba's accessor costs ~2 us a call
            for i, (block, state) in enumerate(zip(self._blocks, cache.layers)):
                block.step(x, state, pos0, nt)
                if watch:
                    self._give_back(i)
        else:
            for i, (block, state) in enumerate(zip(self._blocks, cache.layers)):
                x = block(x, state, pos0)
                if watch:
                    self._give_back(i)
        if watch:
            self._releaser.release([self._lm_head])
        cache.pos += t
        if self._final_norm is None:
            return x
        if t == 1:  # one compiled call (rms_norm_prepared's numpy steps cost ~0.1 ms cold)
            h = np.empty_like(x)
            rms_norm_into(x, self._final_norm, plan.eps, h)
            return h
        return rms_norm_prepared(x, self._final_norm, plan.eps)

    def _give_back(self, i: int) -> None:
        """After layer ``i``: drop the mapped sources of its newly packed tiles, and LLVM's pages
        (touched if the layer loaded kernels) before the next layer's weights come in."""
        lin = self.weights._linears
        self._releaser.release([lin[n] for n in _plan_names(self.plan.layers[i]) if n in lin])
        release_compiler_pages()

    def project(self, h: np.ndarray) -> np.ndarray:
        """Logits of final-normed hidden states (lm_head, logit multiplier, final soft-cap)."""
        plan = self.plan
        if h.ndim == 2 and h.shape[0] == 1:  # one token: one parallel region, no BLAS thread pool
            if self._head_step is None or self._head_step.ops[0] is not self._lm_head:
                from ..kernels.gemv import MatvecGroup

                self._head_step = MatvecGroup([self._lm_head])
            logits = self._head_step(np.ascontiguousarray(h, dtype=np.float32),
                                     np.empty((1, self._lm_head.out_features), np.float32))
        else:
            logits = self._lm_head(h)
        if plan.logit_multiplier != 1.0:
            logits *= np.float32(plan.logit_multiplier)
        if plan.final_softcap:
            c = np.float32(plan.final_softcap)
            logits = np.tanh(logits / c) * c
        return logits.astype(np.float32, copy=False)

    def forward(self, ids: np.ndarray | list[int], cache: Cache, *, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` (one chunk) after what ``cache`` holds; logits of the last token, or of all."""
        h = self.hidden(ids, cache)
        return self.project(h if all_logits else h[-1:])

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
        """Yield GenerationResponse deltas (see cmf.runtime.generate.stream_generate). Under an
        "auto" skill or blend the prompt is routed first."""
        from .generate import stream_generate

        if self._auto:
            self.route_select(prompt)

        return stream_generate(self, prompt, **kwargs)

    def generate(self, prompt, **kwargs) -> str:
        """Generate and return the text (see cmf.runtime.generate.generate). Under an "auto"
        skill or blend the prompt is routed first."""
        from .generate import generate

        if self._auto:
            self.route_select(prompt)

        return generate(self, prompt, **kwargs)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(path: str | os.PathLike, *, task: str | None = None, skill: str | None = None,
         threads: int | None = None, ctx_size: int | None = None, reference_kernels: bool = False,
         batch_size: int | None = DEFAULT_BATCH, moe_mask: "str | os.PathLike | dict | None" = None,
         moe_mask_cover: float | None = None, blend: "Mapping[str, float] | str | None" = None,
         int8_activations: bool | None = None, verify: bool = False) -> Model:
    """Open a .cmf (or any shard of a set) and build a runnable Model.

    ``verify``: check the whole hash chain first (spec §1.2 "a loader flag": envelope header and
    directory hashes, section hashes, every tensor's hash64, over all shards); any mismatch raises
    :class:`HashMismatch` and nothing runs. Off by default: it reads every byte of the file.

    ``task``: a mask name, ``"none"`` (unmasked) or None (the default rule, :meth:`Model.select`).

    ``int8_activations``: decode the 4-bit family (q4_block, q4_tiled, q4tp, q2tp) and q1t with
    input vectors quantized to one int8 piece per group of 32, as llama.cpp does for Q4_0,
    instead of exact mode's three: ~1.1× decode and ~1.6× prefill on CPUs with VNNI, at ~1e-2
    relative error per product (without VNNI prefill stays exact).
    Unset, it comes from ``CMF_INT8_ACT`` (1/true/on); off by default, so outputs match the
    f32-decoded reference.

    ``skill``: an id, "none" or "auto"; ``blend``: {id: weight} or "auto" (see :meth:`Model.select`).

    ``moe_mask`` (route statistics, a path or ``{layer: [counts]}``) restricts each MoE layer to
    the smallest top expert set holding ``moe_mask_cover`` (default 0.95) of the recorded routing
    mass (spec §11.1). Unset, they come from ``CMF_MOE_MASK`` / ``CMF_MOE_MASK_COVER``.
    """
    if moe_mask is None and os.environ.get("CMF_MOE_MASK"):
        moe_mask = os.environ["CMF_MOE_MASK"]
    if moe_mask_cover is None and os.environ.get("CMF_MOE_MASK_COVER"):
        moe_mask_cover = float(os.environ["CMF_MOE_MASK_COVER"])
    if int8_activations is None:
        int8_activations = os.environ.get("CMF_INT8_ACT", "").strip().lower() in ("1", "true", "on", "yes")
    if threads:
        try:
            import numba

            numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        except ImportError:  # pragma: no cover
            pass
    file = cmf_open(Path(path))
    try:
        if verify:
            verify_or_refuse(file)
        return Model(file, skill=skill, task=task, ctx_size=ctx_size, reference_kernels=reference_kernels,
                     batch_size=batch_size, moe_mask=moe_mask, moe_mask_cover=moe_mask_cover, blend=blend,
                     int8_activations=int8_activations)
    except BaseException:
        file.close()
        raise


def _plan_names(obj: Any) -> set[str]:
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
