"""A running request: its cache and tokens, its own sampler, processors, mask and stop rules, and
the text it has streamed so far.

The engine feeds a sequence (prefill chunks, then one token per decode step) and hands it the
logits of its last position; :meth:`Sequence.choose` turns them into the next token with the
request's own rules and :meth:`Sequence.accept` turns the token into events (text released as soon
as no stop string can still be forming; logprobs when asked), exactly as
``cmf.runtime.generate.stream_generate`` does for one sequence.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Iterator

import numpy as np

from ..runtime.cache import Cache
from ..runtime.sampling import make_logits_processors, make_sampler
from .jobs import Delta, Event, Finished, Job
from .responses import TokenLogprob
from .tokens import TokenText


class MaskError(ValueError):
    """A request's token mask left no token to choose."""


class Sequence:
    """The engine's state of one admitted :class:`Job` (see the module docstring)."""

    def __init__(self, job: Job, key: Hashable, tokenizer: Any, text: TokenText) -> None:
        s = job.sampling
        self.job = job
        self.key = key  # the selection it runs under: (task, skill, blend)
        self.prompt_len = len(job.prompt_ids)
        self.tokens: list[int] = list(job.prompt_ids)  # prompt + generated; the processors' "seen"
        self.cache: Cache | None = None
        self.target = self.prompt_len  # positions the cache must hold before decoding (prefill)
        self.pending: int | None = None  # the last chosen token, not yet fed
        self.sampler = make_sampler(s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed)
        self.processors = make_logits_processors(
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, logit_bias=s.logit_bias or None) + list(job.logits_processors)
        self.eos = tokenizer.eos_ids
        self.stop_ids = job.stop_ids
        self.stops = [x for x in s.stop if x]
        self.hold = max((len(x) for x in self.stops), default=1) - 1  # chars kept while a stop may form
        self.decoder = tokenizer.stream_decoder()
        self.names = text
        self.text = ""
        self.emitted = 0
        self.generated = 0
        self.cached_tokens = 0
        self.computed = 0  # prompt positions prefilled here (not from the prefix cache)
        self.finish: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.driver: Iterator[tuple[int, np.ndarray]] | None = None  # speculative decoding's generator
        self.spec_stats: Any = None
        self.info: dict[str, Any] = {}  # task, skill, blend, route: what ran
        self.t_start = self.t_first = self.t_last = 0.0
        self.t_prefill_end = 0.0
        self.preempted = 0
        self.kv_mark: tuple = ()  # (cache, first layer's array) when kv_bytes was counted
        self.kv_bytes = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        """Whether prompt (or, after a preemption, replay) positions remain to be fed."""
        return self.cache is None or self.cache.pos < self.target

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.job.max_tokens - self.generated

    def start(self, now: float) -> None:
        if not self.t_start:
            self.t_start = now

    # -- choosing and accepting tokens --------------------------------------------------------------
    def choose(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The next token from the last position's logits: processors, the token mask, the sampler.
        Returns it with the logits it was drawn from (for logprobs)."""
        for proc in self.processors:
            logits = proc(logits, self.tokens)
        mask = self.job.token_mask
        if mask is not None:
            allowed = mask(self.tokens[self.prompt_len:])
            if allowed is not None:
                allowed = np.asarray(allowed, dtype=bool)
                if not allowed.any():
                    raise MaskError(f"job {self.job.id}: the token mask allows no token")
                logits = np.where(allowed[:logits.size], logits, np.float32(-np.inf)).astype(np.float32)
        return self.sampler(logits), logits

    def accept(self, token: int, logits: np.ndarray, emit: Callable[[Event], None]) -> bool:
        """Record a chosen token and emit what it releases; True when the sequence has ended
        (``finish`` says why). ``pending`` is set to the token when decoding goes on."""
        now = time.perf_counter()
        if not self.t_first:
            self.t_first = now
        self.t_last = now
        self.generated += 1
        self.job.generated = self.generated
        ignore = self.job.sampling.ignore_eos
        is_stop = (token in self.eos and not ignore) or token in self.stop_ids
        if self.job.logprobs and not is_stop:
            self.logprobs.append(self.names.logprob(token, logits, self.job.top_logprobs))
        self.tokens.append(token)
        if is_stop:
            return self._end("stop")
        self.text += self.decoder.step(token)
        if self.stops:
            cut = min((i for i in (self.text.find(x) for x in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                if cut > self.emitted:
                    self._delta(self.text[self.emitted:cut], emit)
                self.emitted = cut
                return self._end("stop")
            safe = max(self.emitted, len(self.text) - self.hold)
        else:
            safe = len(self.text)
        if safe > self.emitted:
            self._delta(self.text[self.emitted:safe], emit)
            self.emitted = safe
        if self.generated >= self.job.max_tokens:
            if self.emitted < len(self.text):
                self._delta(self.text[self.emitted:], emit)
                self.emitted = len(self.text)
            return self._end("length")
        self.pending = token
        return False

    def _delta(self, text: str, emit: Callable[[Event], None]) -> None:
        emit(Delta(text, self.logprobs))
        self.logprobs = []

    def _end(self, reason: str) -> bool:
        # Logprobs still pending produced no content (the stop string they completed is cut):
        # OpenAI reports logprobs for the content only, so they are dropped.
        self.finish = reason
        self.pending = None
        return True

    def finished_event(self, reason: str | None = None) -> Finished:
        """The Finished event with this sequence's counts and rates."""
        reason = reason or self.finish or "cancelled"
        prefill = (self.t_prefill_end or self.t_first) - self.t_start if self.t_start else 0.0
        gen = self.t_last - self.t_first
        spec = self.spec_stats
        return Finished(
            reason, self.prompt_len, self.generated,
            time_to_first_token=(self.t_first - self.t_start) if self.t_first and self.t_start else 0.0,
            prompt_tps=self.computed / prefill if prefill > 0 and self.computed else 0.0,
            generation_tps=(self.generated - 1) / gen if gen > 0 and self.generated > 1 else 0.0,
            task=self.info.get("task"), skill=self.info.get("skill"),
            spec_drafted=spec.drafted if spec is not None else 0, spec_accepted=spec.accepted if spec is not None else 0,
            blend=self.info.get("blend"), route=self.info.get("route"), cached_tokens=self.cached_tokens,
            queued=max(0.0, self.t_start - self.job.submitted_at) if self.t_start and self.job.submitted_at else 0.0)
