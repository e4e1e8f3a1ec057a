"""MTP speculative decoding whose output equals plain greedy decoding (spec §2.1).

Reading order (gpt-fast style):

- :class:`MtpHead` drafts: ``x = eh_proj·[enorm(embed(t_{p+1})); hnorm(h_p)]`` (embedding first)
  → the MTP block(s) → norm → the shared lm_head gives a draft of ``t_{p+2}``. It keeps its own
  cache: one entry per pair (t_{p+1}, h_p) of the accepted sequence. Further drafts feed the
  head its own output hidden state.
- :func:`speculative_generate_step` runs rounds: draft k tokens, verify ``[last, d_1..d_k]`` in
  one forward of the main model, emit the verified tokens up to and including the first
  disagreement (plus the bonus token when all agree), and roll the main cache — KV entries and
  linear-attention state — back to the accepted length.

Every emitted token is the main model's own greedy choice at its position, given exactly the
tokens plain decoding would have fed, so the text is the same. (The only difference is the batch
shape of the verify products: with kernels whose rows do not depend on the batch, the logits are
bit-identical; with BLAS float32 products they may differ in the last bits, which can only matter
on an exact tie.) ``h_p`` is the final-normed hidden state, as transformers' ``MtpModel`` gets it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..format.errors import CmfError
from .blocks import Block
from .cache import Cache, LinearState
from .ops.norm import prepare_norm_weight
from .ops.rowwise import rms_norm_rows
from .sampling import Processor, Sampler

log = logging.getLogger(__name__)

AUTO_LOSING_ROUNDS = 4  # consecutive rounds without an accepted draft before `auto` pauses drafting
AUTO_PAUSE_TOKENS = 32  # plain tokens before `auto` tries drafting again


class NoMtpHead(CmfError):
    """Speculative decoding was requested but the file carries no MTP head (``arch.mtp``)."""


@dataclass
class SpecStats:
    """Counters of a speculative run."""

    rounds: int = 0  # verify forwards that carried at least one draft
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by those rounds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0


class MtpHead:
    """The file's MTP head as a draft model (built from ``plan.mtp``)."""

    def __init__(self, model) -> None:
        plan = model.plan
        mp = plan.mtp
        if mp is None:
            raise NoMtpHead(f"{model.file.path}: the model has no MTP head (arch.mtp); speculative decoding "
                            f"needs one")
        if len(mp.layers) > 1:
            log.info("MTP head with %d layers: drafting chains layer 0 only", len(mp.layers))
        w = model.weights
        self.model = model
        self.eps = plan.eps
        norm = lambda n: prepare_norm_weight(w.vector(n), plan.gemma_norm) if n else None  # noqa: E731
        self.enorm, self.hnorm, self.norm = norm(mp.enorm), norm(mp.hnorm), norm(mp.norm)
        self.eh_proj = w.linear(mp.eh_proj)
        self.embed = mp.embed
        self.lm_head = w.linear(mp.lm_head)
        self.block = Block(mp.layers[0], w, plan.gemma_norm, plan.eps)

    def new_cache(self) -> Cache:
        return Cache([self.block.new_state()])

    def step(self, tokens: Sequence[int], hidden: np.ndarray, cache: Cache) -> tuple[np.ndarray, np.ndarray]:
        """Add the pairs (tokens[i], hidden[i]) to the head's cache; returns (its output hidden
        states [T, hidden], draft logits [T, vocab]): row i predicts the token after tokens[i]."""
        plan = self.model.plan
        e = self.model.weights.rows(self.embed, np.asarray(tokens, dtype=np.int64))
        if plan.embed_multiplier != 1.0:
            e *= np.float32(plan.embed_multiplier)
        x = np.concatenate([rms_norm_rows(e, self.enorm, self.eps),
                            rms_norm_rows(np.asarray(hidden, np.float32), self.hnorm, self.eps)], axis=-1)
        x = self.block(self.eh_proj(x), cache.layers[0], cache.pos)
        cache.pos += len(tokens)
        h = rms_norm_rows(x, self.norm, self.eps) if self.norm is not None else x
        logits = self._lm(h)
        return h, logits

    def _lm(self, h: np.ndarray) -> np.ndarray:
        plan = self.model.plan
        logits = self.lm_head(h)
        if plan.logit_multiplier != 1.0:
            logits *= np.float32(plan.logit_multiplier)
        if plan.final_softcap:
            c = np.float32(plan.final_softcap)
            logits = np.tanh(logits / c) * c
        return logits.astype(np.float32, copy=False)

    def draft(self, tokens: Sequence[int], hidden: np.ndarray, cache: Cache, k: int) -> list[int]:
        """Feed the pending pairs, then draft ``k`` tokens greedily. Only the pending pairs stay in
        the cache: later entries were built from the head's own hidden states."""
        h, logits = self.step(tokens, hidden, cache)
        keep = cache.pos
        st = cache.layers[0]
        # A linear-attention MTP block: keep its state (its arrays are replaced, never mutated).
        saved = (st.conv, st.S) if isinstance(st, LinearState) else None
        drafts = [int(np.argmax(logits[-1]))]
        g = h[-1:]
        while len(drafts) < k:
            g, logits = self.step(drafts[-1:], g, cache)
            drafts.append(int(np.argmax(logits[-1])))
        if saved is not None:
            st.conv, st.S = saved
            st.pos = cache.pos = keep
        else:
            cache.truncate(keep)
        return drafts


def _hidden_prefill(model, ids: Sequence[int], cache: Cache) -> np.ndarray:
    """The final-normed hidden states of the prompt, fed in ``batch_size`` chunks."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.concatenate([model.hidden(ids[s:s + model.batch_size], cache)
                           for s in range(0, ids.size, model.batch_size)])


def speculative_generate_step(model, prompt_ids: Sequence[int], *, sampler: Sampler,
                              processors: Sequence[Processor] = (), max_tokens: int = 256, k: int = 3,
                              mode: str = "on", cache: Cache | None = None,
                              stats: SpecStats | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Like :func:`~cmf.runtime.generate.generate_step` (same tokens), drafting ``k`` tokens per
    round with the MTP head. ``mode="auto"`` pauses drafting after several rounds in a row without
    an accepted draft and retries later. ``sampler`` must be deterministic (greedy)."""
    if mode not in ("on", "auto"):
        raise ValueError(f"speculative mode must be 'on' or 'auto', not {mode!r}")
    head = model.mtp_head()
    k = max(1, int(k))
    stats = stats if stats is not None else SpecStats()
    cache = cache if cache is not None else model.new_cache()
    mcache = head.new_cache()
    seen: list[int] = list(prompt_ids)
    h = _hidden_prefill(model, prompt_ids, cache)
    nxt, prev = list(prompt_ids[1:]), h[:-1]  # the head's entries for the prompt: pairs (t_{i+1}, h_i)
    for s in range(0, len(nxt), model.batch_size):
        head.step(nxt[s:s + model.batch_size], prev[s:s + model.batch_size], mcache)
    logits = model.project(h[-1:])[-1]
    for proc in processors:
        logits = proc(logits, seen)
    token = sampler(logits)
    yield token, logits
    seen.append(token)
    n = 1
    pend_t, pend_h = [token], h[-1:]  # (token, hidden before it) pairs not yet in the head's cache
    losing = pause = 0
    valid = cache.pos  # the cache holds exactly the accepted sequence up to here
    try:
        while max_tokens < 0 or n < max_tokens:
            budget = min(k, model.ctx_size - cache.pos - 1, (max_tokens - n - 1) if max_tokens >= 0 else k)
            drafts: list[int] = []
            if budget > 0 and pause == 0:
                drafts = head.draft(pend_t, pend_h, mcache, budget)
                pend_t, pend_h = [], pend_h[:0]
            elif pause:
                pause -= 1
            x = [token] + drafts
            pos0 = cache.pos
            cache.record(bool(drafts))  # per-position linear-attention snapshots, for the rollback
            hv = model.hidden(x, cache)
            lv = model.project(hv)
            accepted = 0
            finished = False
            for i in range(len(x)):
                valid = pos0 + i + 1  # x[0..i] are the tokens plain decoding would have fed
                logits = lv[i]
                for proc in processors:
                    logits = proc(logits, seen)
                token = sampler(logits)
                yield token, logits
                seen.append(token)
                n += 1
                finished = max_tokens >= 0 and n >= max_tokens
                if not finished and i < len(drafts) and token == drafts[i]:
                    accepted += 1
                    continue
                break
            if drafts:
                stats.rounds += 1
                stats.drafted += len(drafts)
                stats.accepted += accepted
                stats.emitted += accepted + 1
            if finished:
                return
            cache.truncate(valid)
            pend_t += drafts[:accepted] + [token]
            pend_h = np.concatenate([pend_h, hv[:accepted + 1]])
            if drafts:
                losing = losing + 1 if accepted == 0 else 0
                if mode == "auto" and losing >= AUTO_LOSING_ROUNDS:
                    log.debug("speculative auto: %d rounds without an accepted draft; plain decoding for %d "
                              "tokens", losing, AUTO_PAUSE_TOKENS)
                    losing, pause = 0, AUTO_PAUSE_TOKENS
    finally:  # also when the caller stops early (EOS, stop string): the cache keeps the accepted sequence
        cache.truncate(valid)
        cache.record(False)
