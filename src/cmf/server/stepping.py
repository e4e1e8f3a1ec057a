"""The per-iteration work of the engine: decode steps, prompt chunks, speculative tokens,
preemption, and the end of a sequence. A mixin of :class:`~cmf.server.engine.Engine` (split off to
keep each module short); everything here runs on the worker thread."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from ..runtime.batched import BatchDecoder, cache_nbytes, can_cut, clone_prefix, reserve
from .jobs import Event, Failed, Job
from .prefix_cache import PrefixCache
from .sequence import Sequence

log = logging.getLogger("cmf.server.engine")

RESERVE_AHEAD = 256  # KV positions reserved beyond the prompt at admission (fewer regrowth copies)


class Stepping:
    """Engine's stepping methods (see the module docstring); the attributes are Engine's."""

    model: Any
    prefix: PrefixCache
    prefill_chunk: int
    kv_budget: int
    stats: dict[str, int]
    _running: list[Sequence]
    _preempted: collections.deque[Sequence]
    _lock: threading.Condition
    _batch: BatchDecoder
    _step_rate: float
    _kv_used: int

    def _emit(self, job: Job, event: Event) -> None:  # Engine's
        raise NotImplementedError

    def _kv_in_use(self) -> int:
        return sum(self._seq_bytes(s) for s in self._running if s.cache is not None)

    @staticmethod
    def _seq_bytes(s: Sequence) -> int:
        """cache_nbytes of the sequence's cache, recounted only when its first layer's arrays
        changed (they grow together: a count per step of every layer of every sequence cost
        ~0.1 ms an iteration)."""
        first = s.cache.layers[0] if s.cache.layers else None
        mark = (id(s.cache), id(getattr(first, "k", first)))
        if s.kv_mark != mark:
            s.kv_mark, s.kv_bytes = mark, cache_nbytes(s.cache)
        return s.kv_bytes

    def _sweep(self) -> None:
        """End the sequences whose client has gone (before the next step computes for them)."""
        for s in [s for s in self._running if s.job.cancelled]:
            log.info("job %d cancelled after %d tokens", s.job.id, s.generated)
            self._end(s, "cancelled")
        with self._lock:
            gone = [s for s in self._preempted if s.job.cancelled]
            for s in gone:
                self._preempted.remove(s)
        for s in gone:
            self._end(s, "cancelled")

    def _iterate(self) -> None:
        decoding = [s for s in self._running if s.driver is None and not s.prefilling]
        if decoding:
            t0 = time.perf_counter()
            self._decode(decoding)
            rate = 1.0 / max(time.perf_counter() - t0, 1e-6)
            self._step_rate = rate if not self._step_rate else 0.8 * self._step_rate + 0.2 * rate
            self.stats["steps"] += 1
            self.stats["max_batch"] = max(self.stats["max_batch"], len(decoding))
        for s in [s for s in self._running if s.driver is not None]:
            self._spec_token(s)
        budget = self.prefill_chunk
        for s in [s for s in self._running if s.driver is None and s.prefilling]:
            if s.cache.pos == 0 and s.pending is None and not s.preempted:
                self._late_take(s)
            n = min(self.prefill_chunk, self.model.batch_size, s.target - s.cache.pos)
            if budget < self.prefill_chunk and n > budget:
                break  # its next chunk waits for the next iteration: chunks never depend on the batch
            budget -= n
            self._prefill(s, n)
        self._kv_used = self._kv_in_use()
        if self._kv_used > self.kv_budget:
            self._preempt()

    def _decode(self, seqs: list[Sequence]) -> None:
        tokens = [s.pending for s in seqs]
        if len(seqs) == 1:  # the fused one-token step: the same logits as the batch's row
            logits = self.model.forward(tokens, seqs[0].cache)
        else:
            logits = self._batch.step(tokens, [s.cache for s in seqs])
        for s, row in zip(seqs, logits):
            self._take(s, row)

    def _prefill(self, s: Sequence, n: int) -> None:
        try:
            pos = s.cache.pos
            logits = self.model.forward(s.tokens[pos:pos + n], s.cache)
        except Exception as exc:  # noqa: BLE001 - one prompt's failure ends that request only
            log.exception("job %d: prefill failed", s.job.id)
            self._fail(s, exc)
            return
        s.computed += n
        if s.cache.pos < s.target:
            return
        s.t_prefill_end = time.perf_counter()
        if s.pending is None:  # a new prompt: its first token (a resumed one decodes on with its own)
            if self.prefix.enabled and not s.preempted and can_cut(s.cache, s.cache.pos):
                # the prompt's KV for the requests that arrive meanwhile (a shared system prompt);
                # the finished sequence's longer cache replaces it
                self.prefix.put(s.key, s.tokens, clone_prefix(s.cache, s.cache.pos))
            self._take(s, logits[-1])

    def _late_take(self, s: Sequence) -> None:
        """A prompt about to be prefilled takes what the prefix cache holds now: prompts that came
        in together find the earlier ones' prefixes (the take at admission found none then)."""
        cache, n, _ = self.prefix.take(s.key, s.tokens, s.target - 1, reserve=s.target + RESERVE_AHEAD)
        if cache is not None:
            reserve(cache, s.target - n + min(s.remaining, RESERVE_AHEAD))
            s.cache, s.cached_tokens = cache, n

    def _take(self, s: Sequence, logits: np.ndarray) -> None:
        """Choose and emit the next token of ``s`` from its last position's logits."""
        try:
            token, used = s.choose(logits)
            ended = s.accept(token, used, lambda ev: self._emit(s.job, ev))
        except Exception as exc:  # noqa: BLE001 - a request's own hook (processor, mask) failed
            log.exception("job %d: choosing a token failed", s.job.id)
            self._fail(s, exc)
            return
        if ended:
            self._end(s, s.finish)

    def _spec_token(self, s: Sequence) -> None:
        try:
            token, logits = next(s.driver)
            ended = s.accept(token, logits, lambda ev: self._emit(s.job, ev))
        except StopIteration:
            ended = True
            s.finish = s.finish or "length"
        except Exception as exc:  # noqa: BLE001
            log.exception("job %d: speculative decoding failed", s.job.id)
            self._fail(s, exc)
            return
        if not s.t_prefill_end:
            s.t_prefill_end = s.t_first
            s.computed = s.prompt_len
        if ended:
            s.driver.close()
            self._end(s, s.finish)

    def _preempt(self) -> None:
        """Over the KV budget: the prefix cache goes first, then the newest sequences (their KV is
        dropped and recomputed when they resume at the front of the queue), never the oldest one."""
        over = self._kv_used - self.kv_budget
        self.prefix.evict(over)
        while self._kv_used > self.kv_budget and len(self._running) > 1:
            s = self._running.pop()
            size = cache_nbytes(s.cache) if s.cache is not None else 0
            if s.driver is not None:  # a speculative generator cannot resume: it starts over
                s.driver.close()
                s.driver = None
            s.cache = None  # recomputed when it resumes (what its prompt shares may come from the prefix cache)
            s.preempted += 1
            s.target = len(s.tokens) - 1 if s.pending is not None else s.prompt_len
            self._kv_used -= size
            self.stats["preempted"] += 1
            log.info("job %d preempted at %d tokens (KV budget %d MB)", s.job.id, len(s.tokens), self.kv_budget >> 20)
            with self._lock:
                self._preempted.appendleft(s)

    def _end(self, s: Sequence, reason: str | None) -> None:
        """Remove a finished or cancelled sequence, report it, keep its cache for later prompts."""
        if s in self._running:
            self._running.remove(s)
        reason = reason or "cancelled"
        job = s.job
        if s.driver is not None:
            s.driver.close()
        elif s.cache is not None:
            self.prefix.put(s.key, s.tokens, s.cache)
        s.cache = None
        with self._lock:
            job.state = "cancelled" if reason == "cancelled" else "done"
            self.stats["cancelled" if reason == "cancelled" else "completed"] += 1
            self.stats["completion_tokens"] += s.generated
            self.stats["cached_tokens"] += s.cached_tokens
            if reason != "cancelled":
                self.stats["prompt_tokens"] += s.prompt_len
            self._lock.notify_all()
        self._emit(job, s.finished_event(reason))

    def _fail(self, s: Sequence, exc: BaseException) -> None:
        if s in self._running:
            self._running.remove(s)
        if s.driver is not None:
            s.driver.close()
        s.cache = None
        with self._lock:
            s.job.state = "failed"
            self.stats["failed"] += 1
            self.stats["completion_tokens"] += s.generated
            self._lock.notify_all()
        self._emit(s.job, Failed(exc))
