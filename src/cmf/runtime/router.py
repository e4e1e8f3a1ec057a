"""Routing prompts to skills (spec §9, recon-argmin): the Model's side (a mixin of
runtime.model.Model). The numerics — subspaces, errors, blend weights — are runtime/routing.py;
this module runs the backbone to get a prompt's representation φ and switches the selection.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .plan import plan_names
from .routing import BLEND_ROUTE_TOKENS, Route, Subspace, auto_blend, recon_error, routing_ids
from .task_masks import apply_task_mask
from .weights import Weights

log = logging.getLogger("cmf.runtime.model")  # the messages Model has always logged under


class Router:
    """Mixin: ``subspaces``, ``residual``, ``route`` and ``route_select`` of a Model."""

    def subspaces(self) -> list:
        """The routable skills' decoded selections (routing.Subspace), in registry order."""
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
            if plan_names(lp) & changed:
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

    def route(self, prompt: Any, *, max_tokens: int | None = None) -> Route:
        """Score ``prompt`` (text, chat messages or token ids) against every routable skill:
        routing.Route with E per skill, the winner (None when no skill is routable)."""
        ids = routing_ids(self.tokenizer, prompt)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        subs = self.subspaces()
        scores: dict[str, float] = {}
        phis: dict[int, np.ndarray] = {}
        # φ is the unmasked backbone's, as the reference routes on a fresh pipeline (main.rs
        # cmd_run → router::route over Pipeline::from_model): an active task mask is lifted.
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

    def route_select(self, prompt: Any) -> Route:
        """Route ``prompt`` under the active "auto" mode and switch to the result; returns the Route."""
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
