"""The engine: one worker thread owns the model and runs queued generation jobs one at a time.

Why one worker: the model's forward pass, its KV cache and its task/skill selection are state of
one object, and the numba kernels already use every core for one sequence. Requests therefore
queue (a bounded FIFO, ``max_queue`` waiting jobs); a full queue is refused at once
(:class:`QueueFull`) instead of piling up latency. The HTTP side never blocks the worker: events
go to a per-job ``sink`` callback that only hands them over (to an asyncio queue), so a slow
client cannot stall the others, and a client that leaves calls :meth:`Job.cancel`, which stops
its generation at the next token (or skips it if it has not started).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np

from ..runtime.generate import stream_generate
from .schemas import Sampling, TokenLogprob

log = logging.getLogger(__name__)


def _byte_level_table() -> dict[str, int]:
    """The inverse of the byte → printable-character map of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, NBSP,
    soft hyphen) are shifted, in byte order, to U+0100 onwards.
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    inv: dict[str, int] = {}
    shift = 0
    for b in range(256):
        if b in keep:
            inv[chr(b)] = b
        else:
            inv[chr(0x100 + shift)] = b
            shift += 1
    return inv


_BYTE_LEVEL_INV = _byte_level_table()


def _vocab_kind(tok: Any) -> tuple[bool, set[int]]:
    """(whether the tokenizer's decoder is byte-level, the ids of its added tokens)."""
    if tok.backend is None:
        return False, set()
    try:
        spec = json.loads(tok.backend.to_str())
    except (ValueError, AttributeError):
        return False, set()
    dec = spec.get("decoder") or {}
    kinds = [d.get("type") for d in dec.get("decoders", [])] if dec.get("type") == "Sequence" else [dec.get("type")]
    added = {int(a["id"]) for a in spec.get("added_tokens") or () if isinstance(a, dict) and "id" in a}
    return "ByteLevel" in kinds, added


class QueueFull(Exception):
    """The request queue holds ``max_queue`` waiting jobs already."""


class EngineClosed(Exception):
    """The engine has been shut down."""


class _Cancelled(Exception):
    """Raised inside the generation loop when the job's client has gone."""


@dataclass
class Delta:
    """New text of a running job, with the logprobs of the tokens that produced it (if asked)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Finished:
    """The job ended: ``finish_reason`` is "stop", "length" or "cancelled"."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    task: str | None = None
    skill: str | None = None
    spec_drafted: int = 0  # MTP drafts proposed / accepted (speculative decoding)
    spec_accepted: int = 0
    blend: dict[str, float] | None = None  # the blend that ran ("none" = the backbone)
    route: dict[str, Any] | None = None  # the routing decision, under an "auto" skill or blend


@dataclass
class Failed:
    """The job raised; the error is logged by the engine, the client gets a generic message."""

    error: BaseException


Event = Union[Delta, Finished, Failed]


@dataclass
class Job:
    """One generation request: prompt ids, sampling, logprobs wish, task/skill, and where events go."""

    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    sink: Callable[[Event], None]
    logprobs: bool = False
    top_logprobs: int = 0
    task: str | None = None
    skill: str | None = None  # an id, None (the backbone) or "auto" (routed on route_prompt)
    blend: dict[str, float] | str | None = None  # {id or "none": weight} or "auto"; replaces skill
    route_prompt: Any = None  # what "auto" routes on: the chat messages, or the completion prompt
    id: int = 0
    state: str = "new"  # new → queued → running → done | cancelled | failed
    generated: int = 0
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop this job (its client left); a no-op once it has finished."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


class Engine:
    """Runs :class:`Job` s on ``model`` in one worker thread; ``submit`` is safe from any thread."""

    def __init__(self, model: Any, *, max_queue: int = 64, default_task: str | None = None,
                 default_skill: str | None = None, speculative: bool = True) -> None:
        """``speculative``: greedy requests decode with the file's MTP head when it has one
        (the same tokens, fewer forward passes; see cmf.runtime.speculative)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.model = model
        self.max_queue = max_queue
        self.default_task = default_task
        self.default_skill = default_skill
        self.speculative = speculative
        self.tokenizer = model.tokenizer  # loaded here, once: the property is not thread-safe
        # A deque under one condition rather than queue.Queue: pause() must keep jobs *in* the
        # queue (counted against max_queue), which a worker blocked in Queue.get() would not.
        self._queue: collections.deque[Job] = collections.deque()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._paused = False
        self._closed = False
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self._byte_level, self._added = _vocab_kind(self.tokenizer)
        self.stats: dict[str, int] = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                                      "prompt_tokens": 0, "completion_tokens": 0}
        # Select the server defaults now, so a wrong --task/--skill fails at start, not on a request.
        model.select(task=default_task, skill=default_skill)
        self._worker = threading.Thread(target=self._loop, name="cmf-engine", daemon=True)
        self._worker.start()

    # -- public ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue ``job``; raises QueueFull at once when ``max_queue`` jobs are waiting."""
        if self._closed:
            raise EngineClosed("the engine is shut down")
        with self._lock:
            job.id = next(self._ids)
            if len(self._queue) >= self.max_queue:
                job.state = "rejected"
                self.stats["rejected"] += 1
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            job.state = "queued"
            self._queue.append(job)
            self.stats["submitted"] += 1
            self._lock.notify_all()
        return job

    @property
    def waiting(self) -> int:
        """Jobs queued and not yet started."""
        return len(self._queue)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._worker.is_alive()

    @property
    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._running is not None

    def snapshot(self) -> dict[str, Any]:
        """Counters and queue state, for /health and logs."""
        with self._lock:
            return dict(self.stats, waiting=self.waiting, busy=self.busy, max_queue=self.max_queue,
                        paused=self._paused)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until no job runs and none waits (True), or ``timeout`` seconds pass (False)."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._running is not None or self.waiting:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    def pause(self) -> None:
        """Start no new job (the running one finishes); requests still queue up to ``max_queue``."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Start queued jobs again."""
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what waits and what runs, stop the worker."""
        with self._lock:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            if self._running is not None:
                self._running.cancel()
            self._lock.notify_all()
        for job in left:
            job.cancel()
            job.state = "cancelled"
            self._emit(job, Finished("cancelled", len(job.prompt_ids), 0))
        self._worker.join(timeout)

    # -- worker ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._paused or not self._queue):
                    self._lock.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                if job.cancelled:  # its client left while it waited
                    job.state = "cancelled"
                    self.stats["cancelled"] += 1
                    self._lock.notify_all()
                    continue
                self._running = job
            job.state = "running"
            try:
                self._run(job)
            except _Cancelled:
                job.state = "cancelled"
                with self._lock:
                    self.stats["cancelled"] += 1
                log.info("job %d cancelled after %d tokens", job.id, job.generated)
                self._emit(job, Finished("cancelled", len(job.prompt_ids), job.generated))
            except Exception as exc:  # noqa: BLE001 - the worker must survive any one job
                job.state = "failed"
                with self._lock:
                    self.stats["failed"] += 1
                log.exception("job %d failed", job.id)
                self._emit(job, Failed(exc))
            finally:
                with self._lock:
                    self.stats["completion_tokens"] += job.generated
                    self._running = None
                    self._lock.notify_all()

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a dead sink (loop closed) means the client is gone
            log.debug("job %d: event dropped", job.id, exc_info=True)
            job.cancel()

    def _token(self, tid: int) -> tuple[str, list[int]]:
        """A token's text and bytes, cached (logprobs name every token they report)."""
        hit = self._token_text.get(tid)
        if hit is None:
            raw = self._bytes_of(tid)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_text) < 1 << 18:
                self._token_text[tid] = hit
        return hit

    def _bytes_of(self, tid: int) -> bytes:
        # A token may hold part of a UTF-8 character, which decode() turns into U+FFFD; logprobs
        # promise the real bytes, so read them off the vocabulary where its encoding is known.
        tok = self.tokenizer
        if tok.backend is None:
            return bytes([tid]) if tid < 256 else b""
        piece = tok.id_to_token(tid)
        if piece is not None:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self._byte_level and tid not in self._added:
                try:
                    return bytes(_BYTE_LEVEL_INV[c] for c in piece)
                except KeyError:
                    pass
        return tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def _logprob(self, job: Job, token: int, logits: np.ndarray) -> TokenLogprob:
        # Log-probabilities of the distribution the token was drawn from, before temperature
        # (after logit bias and penalties), as OpenAI reports them.
        x = logits.astype(np.float64, copy=False)
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m).sum()))
        text, raw = self._token(token)
        top: list[tuple[str, float, list[int]]] = []
        if job.top_logprobs:
            k = min(job.top_logprobs, x.size)
            idx = np.argpartition(-x, k - 1)[:k]
            idx = idx[np.lexsort((idx, -x[idx]))]  # highest first, lower id on ties
            for i in idx:
                t, b = self._token(int(i))
                top.append((t, float(x[i]) - lse, b))
        return TokenLogprob(text, float(x[token]) - lse, raw, top)

    def _run(self, job: Job) -> None:
        model = self.model
        if job.blend is not None:
            route = model.select(task=job.task, skill=None, blend=job.blend, route_prompt=job.route_prompt)
        else:
            route = model.select(task=job.task, skill=job.skill, route_prompt=job.route_prompt)
        eos = self.tokenizer.eos_ids
        pending: list[TokenLogprob] = []

        def on_token(token: int, logits: np.ndarray) -> None:
            if job.cancelled:
                raise _Cancelled()
            job.generated += 1
            if job.logprobs and (job.sampling.ignore_eos or token not in eos):
                pending.append(self._logprob(job, token, logits))

        # "auto" drafts only for greedy requests on a file with an MTP head, and stops drafting on
        # prompts where drafts keep failing; a sampled request always decodes plainly.
        spec = "auto" if self.speculative and job.sampling.temperature < 1e-6 else "off"
        last = None
        # stream_generate, not model.stream: an "auto" selection was routed above, on the user's
        # text rather than on the templated ids model.stream would route on again.
        for r in stream_generate(model, job.prompt_ids, max_tokens=job.max_tokens, on_token=on_token, spec=spec,
                                 **job.sampling.kwargs()):
            last = r
            if r.text:
                self._emit(job, Delta(r.text, pending[:]))
                pending.clear()
        assert last is not None and last.finish_reason is not None
        job.state = "done"
        with self._lock:
            self.stats["completed"] += 1
            self.stats["prompt_tokens"] += len(job.prompt_ids)
        # Tokens still pending produced no content (the stop string they completed is cut): OpenAI
        # reports logprobs for the content only, so they are dropped.
        self._emit(job, Finished(last.finish_reason, len(job.prompt_ids), last.generation_tokens,
                                 last.time_to_first_token, last.prompt_tps, last.generation_tps,
                                 model.task, model.skill, getattr(last, "spec_drafted", 0),
                                 getattr(last, "spec_accepted", 0),
                                 {k or "none": w for k, w in model.blend.items()} if model.blend else None,
                                 route.to_dict() if route is not None else None))
