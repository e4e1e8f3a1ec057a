"""The engine: one worker thread owns the model and steps every running request together.

Continuous batching. Each iteration of the worker's loop (1) admits waiting jobs — up to
``parallel`` sequences, while their KV fits ``kv_budget`` bytes — (2) drops sequences whose
client left, (3) runs one decode step for every sequence past its prompt (one pass over the
weights for all of them, :mod:`cmf.runtime.batched`), and (4) feeds prompts chunk by chunk, up to
``prefill_chunk`` tokens per iteration, so that a long prompt delays the running streams by one
chunk at a time. Requests join and leave between steps. Each sequence has its own cache,
position, sampler, processors, stop rules (:mod:`.sequence`); a finished one leaves its cache to
the prefix cache (:mod:`.prefix_cache`) for the prompts that follow.

Why one worker: the model's forward pass and its task/skill selection are state of one object,
and the kernels already use every core. A batch runs one selection; a request under another
waits until the running ones finish (FIFO: it also holds back the requests behind it).

The HTTP side never blocks the worker: events go to a per-job ``sink`` that only hands them over,
so a slow client cannot stall the others, and :meth:`Job.cancel` (a client that left) frees the
sequence before the next step. Past ``max_queue`` waiting requests :meth:`submit` raises
:class:`QueueFull` with a ``retry_after`` estimate.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numba
import numpy as np

from ..runtime.batched import bytes_per_token, cache_nbytes, decoder, reserve
from ..runtime.generate import generate_step
from ..runtime.speculative import SpecStats
from . import selection
from .defaults import DEFAULT_KV_BUDGET_MB, DEFAULT_PARALLEL, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB
from .jobs import Delta, EngineClosed, Event, Failed, Finished, Job, QueueFull
from .prefix_cache import PrefixCache
from .sequence import Sequence
from .stepping import RESERVE_AHEAD, Stepping
from .tokens import TokenText

__all__ = ["Engine", "Job", "Delta", "Finished", "Failed", "QueueFull", "EngineClosed"]

log = logging.getLogger(__name__)


class Engine(Stepping):
    """Runs :class:`Job` s on ``model`` in one worker thread; ``submit`` is safe from any thread.

    ``parallel``: sequences decoded together; ``max_queue``: jobs allowed to wait for a slot;
    ``kv_budget_mb``: bytes of KV cache for the running sequences and the prefix cache together;
    ``prefix_cache_mb``: what the prefix cache may keep (0: off); ``prefill_chunk``: prompt tokens
    fed between two decode steps; ``speculative``: greedy requests decode with the file's MTP
    head when it has one (the same tokens, fewer forward passes; one sequence at a time).
    """

    def __init__(self, model: Any, *, max_queue: int = 64, parallel: int = DEFAULT_PARALLEL,
                 kv_budget_mb: float = DEFAULT_KV_BUDGET_MB, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, default_task: str | None = None,
                 default_skill: str | None = None, speculative: bool = True) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if kv_budget_mb <= 0 or prefix_cache_mb < 0 or prefill_chunk < 1:
            raise ValueError("kv_budget_mb must be > 0, prefix_cache_mb >= 0 and prefill_chunk >= 1")
        self.model = model
        self.max_queue = max_queue
        self.parallel = parallel
        self.kv_budget = int(kv_budget_mb * 2**20)
        self.prefill_chunk = prefill_chunk
        self.default_task = default_task
        self.default_skill = default_skill
        self.speculative = speculative
        self.tokenizer = model.tokenizer  # loaded here, once: the property is not thread-safe
        self.text = TokenText(self.tokenizer)
        self.bytes_per_token = bytes_per_token(model)
        self.prefix = PrefixCache(min(int(prefix_cache_mb * 2**20), self.kv_budget))
        # numba's thread count is per thread: the worker takes the one the model was loaded with
        self._threads = numba.get_num_threads()
        # A deque under one condition rather than queue.Queue: pause() keeps jobs *in* the queue
        # (counted against max_queue), which a worker blocked in Queue.get() would not.
        self._queue: collections.deque[Job] = collections.deque()
        self._preempted: collections.deque[Sequence] = collections.deque()  # re-admitted first
        self._running: list[Sequence] = []
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._paused = False
        self._closed = False
        self._active: tuple | None = None  # the selection key the model has now
        self._calls: collections.deque[tuple[Callable[[Any], Any], Future]] = collections.deque()
        self._batch = decoder(model)
        self._step_rate = 0.0  # decode steps per second (moving average), for Retry-After
        self._kv_used = 0
        # Held by the worker around every step that may read the mapping: revoke() takes it to know
        # that none runs (a lease break waits on it before the file may be cut; see lease.py).
        self._mapping = threading.Lock()
        self._revoked: BaseException | None = None
        self._close_hooks: list[Callable[[], None]] = []
        self.stats: dict[str, int] = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                                      "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                                      "preempted": 0, "steps": 0, "max_batch": 0}
        # Select the server defaults now, so a wrong --task/--skill fails at start, not on a request.
        model.select(task=default_task, skill=default_skill)
        self._worker = threading.Thread(target=self._loop, name="cmf-engine", daemon=True)
        self._worker.start()

    # -- public ----------------------------------------------------------------------------------
    @property
    def max_sequence_tokens(self) -> int:
        """Positions one sequence may hold: the context, or less when the KV budget is smaller."""
        return min(self.model.ctx_size, self.kv_budget // self.bytes_per_token)

    def submit(self, job: Job) -> Job:
        """Queue ``job``; raises QueueFull at once when ``max_queue`` jobs wait beyond the free slots."""
        if self._closed:
            raise EngineClosed("the engine is shut down")
        with self._lock:
            job.id = next(self._ids)
            free = 0 if self._paused else max(0, self.parallel - len(self._running) - len(self._preempted))
            if len(self._queue) >= self.max_queue + free:
                job.state = "rejected"
                self.stats["rejected"] += 1
                raise QueueFull(f"{len(self._running)} requests are running and {len(self._queue)} waiting "
                                f"(--parallel {self.parallel}, --max-queue {self.max_queue})", self.retry_after())
            job.state = "queued"
            job.submitted_at = time.perf_counter()
            self._queue.append(job)
            self.stats["submitted"] += 1
            self._lock.notify_all()
        return job

    def retry_after(self) -> int:
        """Seconds until a running sequence is expected to finish (1 when unknown), at most 60."""
        running = list(self._running)
        if not running or self._step_rate <= 0:
            return 1
        soonest = min(s.remaining for s in running) / self._step_rate
        return int(min(60, max(1, np.ceil(soonest))))

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
        """Whether a sequence is running now."""
        return bool(self._running)

    def snapshot(self) -> dict[str, Any]:
        """Counters, queue and memory state, for /health and logs."""
        with self._lock:
            return dict(self.stats, waiting=self.waiting, busy=self.busy, running=len(self._running),
                        max_queue=self.max_queue, parallel=self.parallel, paused=self._paused,
                        kv_used_mb=round(self._kv_used / 2**20, 1), kv_budget_mb=round(self.kv_budget / 2**20, 1),
                        prefix_cache=self.prefix.stats())

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until no job runs and none waits (True), or ``timeout`` seconds pass (False)."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._running or self._queue or self._preempted:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    def reset_counters(self) -> None:
        """Zero the request counters and the step rate (after the start's warm-up, so ``/health``
        and Retry-After see clients' requests only)."""
        with self._lock:
            for key in self.stats:
                self.stats[key] = 0
            self._step_rate = 0.0

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(model)`` on the worker between two steps (the model is one thread's): the
        hook of work that is not generation (embeddings). ``fn`` may change the selection; the
        running batch's is restored after it. Returns a Future of its result."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._calls.append((fn, fut))
            self._lock.notify_all()
        return fut

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.model))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                if self._running and self._active is not None:
                    selection.select(self.model, self._active)
                else:
                    self._active = None

    def pause(self) -> None:
        """Admit no new job (the running ones go on); requests still queue up to ``max_queue``."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Admit queued jobs again."""
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def revoke(self, error: BaseException) -> None:
        """The mapped file is about to change: wait for the current step, then fail every running
        sequence, queued job and call with ``error`` (and every later one). On return no step
        reads the mapping again."""
        with self._mapping:
            self._revoked = error
        with self._lock:
            self._lock.notify_all()  # the worker fails what is left

    @property
    def revoked(self) -> BaseException | None:
        """The error of :meth:`revoke`, once called."""
        return self._revoked

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` when the engine closes (the server's lease guard is released there)."""
        self._close_hooks.append(hook)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what waits and what runs, stop the worker."""
        for hook in self._close_hooks:
            hook()
        with self._lock:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            for s in self._running:
                s.job.cancel()
            self._lock.notify_all()
        for job in left:
            job.cancel()
            job.state = "cancelled"
            self._emit(job, Finished("cancelled", len(job.prompt_ids), 0))
        self._worker.join(timeout)

    # -- worker ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        numba.set_num_threads(self._threads)
        while True:
            with self._lock:
                while not self._closed and not self._running and not self._calls and (
                        self._paused or not (self._queue or self._preempted)):
                    self._lock.wait()
                if self._closed:
                    break
            with self._mapping:
                if self._revoked is not None:
                    self._refuse_all(self._revoked)
                    continue
                try:
                    self._run_calls()
                    self._admit()
                    self._sweep()
                    if self._running:
                        self._iterate()
                except Exception as exc:  # noqa: BLE001 - the worker must survive any one step
                    log.exception("engine step failed; failing its %d sequences", len(self._running))
                    for s in list(self._running):
                        self._fail(s, exc)
        for s in list(self._running) + list(self._preempted):
            self._end(s, "cancelled")
        self._preempted.clear()
        with self._lock:  # a job put back at the front while close() emptied the queue
            left = list(self._queue)
            self._queue.clear()
        for job in left:
            job.state = "cancelled"
            self._emit(job, Finished("cancelled", len(job.prompt_ids), 0))
        with self._lock:
            calls = list(self._calls)
            self._calls.clear()
        for _, fut in calls:
            fut.cancel()

    def _refuse_all(self, error: BaseException) -> None:
        """After revoke(): fail what runs, what was preempted, what waits and every call."""
        for s in list(self._running) + list(self._preempted):
            self._fail(s, error)
        self._preempted.clear()
        with self._lock:
            left, calls = list(self._queue), list(self._calls)
            self._queue.clear()
            self._calls.clear()
            for job in left:
                job.state = "failed"
                self.stats["failed"] += 1
            self._lock.notify_all()
        for job in left:
            self._emit(job, Failed(error))
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a dead sink (loop closed) means the client is gone
            log.debug("job %d: event dropped", job.id, exc_info=True)
            job.cancel()

    # -- admission -------------------------------------------------------------------------------
    def _admit(self) -> None:
        while len(self._running) < self.parallel:
            with self._lock:
                if self._paused or self._closed:
                    return
                while self._queue and self._queue[0].cancelled:  # its client left while it waited
                    job = self._queue.popleft()
                    job.state = "cancelled"
                    self.stats["cancelled"] += 1
                    self._lock.notify_all()
                if self._preempted:
                    seq, job = self._preempted[0], None
                elif self._queue:
                    seq, job = None, self._queue[0]
                else:
                    return
            if seq is None:
                seq = self._prepare(job)
                if seq is None:
                    return
            if self._running and seq.key != self._active:
                return  # another selection runs: this one (and those behind it) wait for the batch to drain
            with self._lock:
                head = self._preempted if job is None else self._queue
                if not head or head[0] is not (seq if job is None else job):
                    continue  # close() emptied the queue meanwhile
                head.popleft()
            if not self._start(seq):  # no room in the KV budget yet: back to the front, it waits
                with self._lock:
                    (self._preempted if job is None else self._queue).appendleft(seq if job is None else job)
                return

    def _prepare(self, job: Job) -> Sequence | None:
        """The Sequence of the queue's head, its selection resolved (routing an ``auto`` request
        under its task mask); None while it must wait for the running batch to drain."""
        cached = getattr(job, "_resolved", None)
        if cached is None:
            if selection.needs_routing(job):
                task = selection.task_of(self.model, job)
                if self._running and self._active is not None and self._active[0] != task:
                    return None
                if not self._running:
                    selection.select_task(self.model, task)
                    self._active = None  # the task changed under the selection that ran
            try:
                cached = selection.resolve(self.model, job)
            except Exception as exc:  # noqa: BLE001 - a routing failure fails this request only
                with self._lock:
                    if self._queue and self._queue[0] is job:
                        self._queue.popleft()
                log.exception("job %d: routing failed", job.id)
                job.state = "failed"
                self.stats["failed"] += 1
                self._emit(job, Failed(exc))
                return None
            job._resolved = cached  # type: ignore[attr-defined]
        seq = getattr(job, "_seq", None)  # made once, however many iterations it waits
        if seq is None:
            key, route = cached
            seq = Sequence(job, key, self.tokenizer, self.text)
            if route is not None:
                seq.info["route"] = route.to_dict()
            job._seq = seq  # type: ignore[attr-defined]
        return seq

    def _fits(self, need: int, taken: int = 0) -> bool:
        """Whether ``need`` more bytes (beyond ``taken``, a cache just taken from the prefix cache)
        fit the budget, evicting prefix-cache entries if that helps. A sequence may always start
        when nothing runs (submit checked that it fits alone)."""
        used = self._kv_in_use() + taken
        over = used + self.prefix.nbytes + need - self.kv_budget
        if over > 0:
            self.prefix.evict(over)
        return not self._running or used + self.prefix.nbytes + need <= self.kv_budget

    def _start(self, seq: Sequence) -> bool:
        """Start ``seq`` (its cache from the prefix cache where a prefix matches); False when its
        KV does not fit the budget while others run."""
        job, model = seq.job, self.model
        ahead = min(seq.remaining, RESERVE_AHEAD)
        greedy = job.sampling.temperature < 1e-6
        spec = (self.speculative and greedy and model.has_mtp and not job.logits_processors
                and job.token_mask is None and seq.pending is None)
        cache, n, moved = None, 0, False
        if not spec:
            # a new prompt keeps its last token to compute (its logits give the first token)
            limit = seq.target - 1 if seq.pending is None else seq.target
            cache, n, moved = self.prefix.take(seq.key, seq.tokens, limit, reserve=seq.target + ahead)
        if not self._fits(self.bytes_per_token * (seq.target - n + ahead), cache_nbytes(cache) if cache else 0):
            if moved:  # hand it back; a copy is simply dropped (the entry is still there)
                self.prefix.put(seq.key, seq.tokens, cache)
            return False
        if seq.key != self._active:
            log.debug("selection %s", selection.describe(seq.key))
            selection.select(model, seq.key)
            self._active = seq.key
        seq.info.update(selection.current(model))
        job.state = "running"
        seq.start(time.perf_counter())
        if spec:  # MTP drafts verify several tokens per forward: this sequence runs its own generator
            seq.spec_stats = SpecStats()
            seq.cache = model.new_cache()
            seq.driver = generate_step(model, job.prompt_ids, sampler=seq.sampler, processors=seq.processors,
                                       max_tokens=job.max_tokens, cache=seq.cache, spec="auto",
                                       spec_stats=seq.spec_stats)
        else:
            if cache is None:
                cache = model.new_cache()
            if seq.preempted == 0:
                seq.cached_tokens = n
            reserve(cache, seq.target - n + ahead)
            seq.cache = cache
        self._running.append(seq)
        return True
