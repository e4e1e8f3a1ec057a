"""The decoder, assembled from LayerPlans: forward(tokens, cache) → logits.

Model is the decoder itself (set-up, ``hidden``/``forward``/``prefill``, ``project``) plus mixins:
selection of tasks, skills and blends (selection.py), routing prompts to skills (router.py), MoE
statistics and expert masks (experts.py) and the release of pages it no longer needs (memory.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

import numba
import numpy as np

from ..format.errors import CmfError, NotRunnable
from ..format.reader import CmfFile
from ..format.reader import open as cmf_open
from .blocks import Block
from .cache import Cache
from .experts import MoeStats, keep_counts
from .features import check_runnable
from .layer_stack import LayerStack
from .load_checks import moe_keep, verify_or_refuse
from .memory import EMBED_RELEASE_EVERY, ModelMemory
from .ops.decode import rms_norm_into
from .ops.kv_values import check_supported as check_kv_cache
from .ops.norm import prepare_norm_weight
from .ops.rowwise import rms_norm_rows
from .plan import ModelPlan, build_plan
from .router import Router
from .selection import Selection, UnknownSkill, UnknownTask
from .weights import Weights

__all__ = ["DEFAULT_BATCH", "EMBED_RELEASE_EVERY", "ContextOverflow", "Model", "UnknownSkill", "UnknownTask",
           "load"]

log = logging.getLogger(__name__)
# Prefill chunk (tokens per forward). 256 prefills as fast as 512 here (BLAS is saturated from
# ~128 rows) with a lower peak: 512-token chunks held ~75 MB more activations on the f16
# benchmark model (630 against 553 MB peak), 16 MB more on q4_tiled.
DEFAULT_BATCH = 256


class ContextOverflow(CmfError):
    """The sequence would exceed the context limit."""


class Model(Selection, Router, MoeStats, ModelMemory):
    """A runnable model over one open CMF file. Create with :func:`cmf.load`."""

    def __init__(self, file: CmfFile, *, skill: str | None = None, task: str | None = None,
                 ctx_size: int | None = None, reference_kernels: bool = False, batch_size: int | None = DEFAULT_BATCH,
                 moe_mask: "str | os.PathLike | dict | None" = None, moe_mask_cover: float | None = None,
                 blend: "Mapping[str, float] | str | None" = None, int8_activations: bool = False,
                 kv_cache: str = "f32") -> None:
        if file.is_skill_file:
            raise NotRunnable(f"{file.path} is a standalone skill file (SKILL_FILE): a partial tensor set, "
                              f"not a model. Attach it first: cmf skill apply BASE {file.path.name} -o OUT.cmf")
        # A key this runtime does not model is refused here, never ignored (runtime/features.py).
        check_runnable(file.header, file.keys(), file.path)
        self.file = file
        self.arch = file.arch
        self._reference = reference_kernels
        self.int8_activations = bool(int8_activations)
        check_kv_cache(kv_cache)
        self.kv_cache = kv_cache  # storage of the GQA layers' KV caches: "f32" or "f16"
        self._check_skill(skill)
        self._auto: str | None = None  # "skill" / "blend": route every prompt (see select)
        self.last_route = None  # the latest routing.Route, when a prompt was routed
        # changes to what the decode step binds so far: task masks (task_masks.apply_task_mask) and
        # layers rebuilt (_replace_block); layer_stack.py redoes its checks when it moves
        self.step_epoch = 0
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
        self._init_release()
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

    def _replace_block(self, i: int, block: Block) -> None:
        """Layer ``i`` is now ``block`` (a skill switch, a re-preparation)."""
        self._blocks[i] = block
        self.step_epoch += 1

    def _prepare(self) -> None:
        w, plan = self.weights, self.plan
        old = getattr(self, "_blocks", None)
        self._blocks = [self._make_block(lp) for lp in plan.layers]
        self._final_norm = self._norm(plan.final_norm)
        self._lm_head = w.linear(plan.lm_head)
        self._head_step = None  # the lm_head as a one-token MatvecGroup (project)
        self._stack = LayerStack(self._blocks)  # the decoder's layers as one call per token
        self._embed_pages = self._embed_release_view()
        self._mtp = None  # the MTP head is built on first use (speculative.py)
        if old is not None:
            for o, b in zip(old, self._blocks):
                keep_counts(o, b)  # statistics survive a skill switch
        self._apply_expert_masks()

    def _make_block(self, lp, weights: Weights | None = None) -> Block:
        """The executable layer of LayerPlan ``lp`` over ``weights`` (default: the current ones)."""
        self._new_blocks = True  # the next forward gives back what packing its products maps (memory.py)
        return Block(lp, weights or self.weights, self.plan.gemma_norm, self.plan.eps)

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
        return Cache([b.new_state(self.kv_cache) for b in self._blocks])

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
        # Give back looked-up embedding pages; on watched forwards, the mapped pages of freshly
        # repacked 4-bit tiles and the compiler's code pages, layer by layer (memory.py).
        watch = self._count_forward(t)
        if t == 1:  # decode: the fused one-token step over per-layer buffers (runtime/step.py)
            nt = numba.get_num_threads()  # read once: numba's accessor costs ~2 us a call
            if watch or not self._stack.run(x, cache, pos0, nt, self.step_epoch):  # every layer in one call, or:
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
            self._give_back_head()
        cache.pos += t
        if self._final_norm is None:
            return x
        if t == 1:  # the kernel itself: no row split to set up for one row
            h = np.empty_like(x)
            rms_norm_into(x, self._final_norm, plan.eps, h)
            return h
        return rms_norm_rows(x, self._final_norm, plan.eps)

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

    # -- one layer at a time (measurements: cmf.calib.sensitivity) ---------------------------------
    def layer_inputs(self, token_ids: list[int] | np.ndarray) -> list[np.ndarray]:
        """What each layer receives for ``token_ids`` run as one chunk from position 0 (copies)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        cache = self.new_cache()
        x = self.weights.rows(self.plan.embed, ids)
        if self.plan.embed_multiplier != 1.0:
            x *= np.float32(self.plan.embed_multiplier)
        out = []
        for block, state in zip(self._blocks, cache.layers):
            out.append(np.array(x, dtype=np.float32, copy=True))
            x = block(x, state, 0)
        return out

    def logits_from(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Logits of every position when layer ``layer`` receives ``x`` (a chunk from position 0):
        the layers before it are not run."""
        cache = self.new_cache()
        x = np.array(x, dtype=np.float32, copy=True)
        for block, state in zip(self._blocks[layer:], cache.layers[layer:]):
            x = block(x, state, 0)
        if self._final_norm is not None:
            x = rms_norm_rows(x, self._final_norm, self.plan.eps)
        return self.project(x)

    def rebuild_layer(self, layer: int) -> set[str]:
        """Rebuild layer ``layer`` from what ``weights.linear`` returns now (a caller may have
        replaced it); returns the names of the matrices it took."""
        w = self.weights
        hooked = "linear" in vars(w)  # a caller's replacement, to put back as it was
        take = w.linear
        names: set[str] = set()

        def linear(name: str):  # noqa: ANN202 - a LinearOp
            names.add(name)
            return take(name)

        w.linear = linear
        try:
            self._replace_block(layer, self._make_block(self.plan.layers[layer]))
        finally:
            if hooked:
                w.linear = take
            else:
                del w.linear
        return names

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
         int8_activations: bool | None = None, verify: bool = False, kv_cache: str | None = None) -> Model:
    """Open a .cmf (or any shard of a set) and build a runnable Model.

    ``verify``: check the whole hash chain first (spec §1.2 "a loader flag": envelope header and
    directory hashes, section hashes, every tensor's hash64, over all shards); any mismatch raises
    :class:`HashMismatch` and nothing runs. Off by default: it reads every byte of the file.

    ``task``: a mask name, ``"none"`` (unmasked) or None (the default rule, :meth:`Model.select`).

    ``int8_activations``: decode the 4-bit family (q4_block, q4_tiled, q4tp, q2tp) and q1t with
    input vectors quantized to one int8 piece per group of 32, as llama.cpp does for Q4_0,
    instead of exact mode's three: ~1.1× decode and ~1.6× prefill on CPUs with VNNI, at ~1e-2
    relative error per product (without VNNI prefill stays exact). q8_row / q8_2f matrices then
    run integer products too (``kernels/q8i.py``: ~2× batched decode and prefill).
    Unset, it comes from ``CMF_INT8_ACT`` (1/true/on); off by default, so outputs match the
    f32-decoded reference.

    ``kv_cache``: how the attention layers' KV caches store keys and values: "f32" (default) or
    "f16" (half the memory and the bytes a decode step reads; values rounded to f16, ~1e-3
    relative, as llama.cpp's and vLLM's default caches). Unset, it comes from ``CMF_KV_CACHE``.

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
    if kv_cache is None:  # Model checks it
        kv_cache = os.environ.get("CMF_KV_CACHE", "").strip().lower() or "f32"
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
                     int8_activations=int8_activations, kv_cache=kv_cache)
    except BaseException:
        file.close()
        raise

