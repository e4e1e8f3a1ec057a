"""Warming the engine up before ``cmf serve`` answers (``--no-warmup`` skips it).

numba compiles each kernel on its first use after an install or an upgrade. Without a warm-up the
first request pays for it: SmolLM2-135M on 2 cores, with the server's int8 activations, compiles
~60 s (q8) to ~100 s (q4tp) for its prefill, batched and one-sequence steps — long enough for a
client's timeout to fire first.
llama.cpp's server runs one generation at start for the same reason. :func:`warm_up` submits two
short greedy jobs at once — both run batched, then the longer one alone — so the prefill, the
two-sequence step and the one-sequence step all compile; it waits for them, and then removes their
traces: the prefix cache is emptied and the engine's counters are reset, so ``/health`` counts
clients' requests only. With numba's cache warm it costs
what the first request would otherwise pay: loading the compiled kernels (1–2 s for that model).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from ..format.errors import CmfError
from ..kernels import compiling
from .engine import Engine
from .jobs import EngineClosed, Failed, Finished, Job, QueueFull
from .schemas import Sampling

log = logging.getLogger(__name__)

PROMPT_TOKENS = 8  # a short prompt: one prefill chunk, long enough for the block products
# Tokens each job generates (EOS ignored, so all run): the two start together, so the batched
# step runs with two sequences, and the second goes on alone, so the one-sequence step runs too.
MAX_TOKENS = (3, 8)
JOBS = len(MAX_TOKENS)
TIMEOUT = 1800.0  # seconds: compiling a large MoE model's kernels on a slow machine, and margin


class WarmUpFailed(CmfError):
    """The warm-up generation failed or did not finish: the server would not serve either."""


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up took: wall seconds, of which ``compile_seconds`` compiling ``kernels`` kernels
    (both zero on a warm numba cache)."""

    seconds: float
    compile_seconds: float
    kernels: int


def _prompt(vocab: int, k: int) -> list[int]:
    """Job ``k``'s prompt: ordinary ids, different for each job (so none reuses another's prefix)."""
    return [(1 + k * PROMPT_TOKENS + i) % vocab for i in range(PROMPT_TOKENS)]


def _run(engine: Engine, jobs: list[Job], events: queue.Queue, deadline: float, timeout: float) -> None:
    """Submit ``jobs`` and wait until each has finished; on a failure or past ``deadline`` cancel
    them and raise :class:`WarmUpFailed`."""
    left = len(jobs)
    try:
        for job in jobs:
            try:
                engine.submit(job)
            except (QueueFull, EngineClosed) as exc:
                raise WarmUpFailed(f"the warm-up generation could not start: {exc}") from exc
        while left:
            try:
                ev = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise WarmUpFailed(f"the warm-up generation did not finish in {timeout:g} s") from None
            if isinstance(ev, Failed):
                raise WarmUpFailed(f"the warm-up generation failed: {type(ev.error).__name__}: {ev.error}") from ev.error
            if isinstance(ev, Finished):
                left -= 1
    finally:
        if left:
            for job in jobs:
                job.cancel()


def warm_up(engine: Engine, timeout: float = TIMEOUT) -> WarmUp:
    """Run :data:`JOBS` greedy jobs through ``engine`` and wait for them; then empty its prefix cache
    and reset its counters and the model's routing statistics. Raises :class:`WarmUpFailed` when a
    job fails or they are not done within ``timeout`` seconds."""
    compiling.install()
    before = compiling.totals()
    start = time.perf_counter()
    # A sequence holds at most ``limit`` positions (the context, or less under --kv-budget): the
    # jobs shrink to fit it, as a request must; below 2 no request can run, so nothing to warm.
    limit = engine.max_sequence_tokens
    if limit < 2:
        return WarmUp(0.0, 0.0, 0)
    n_prompt = min(PROMPT_TOKENS, max(1, limit - max(MAX_TOKENS)))
    events: queue.Queue = queue.Queue()
    vocab = engine.model.plan.vocab
    # The server's default selection, as a request that names none runs ("auto" routes on a prompt
    # the warm-up does not have: the backbone then).
    skill = None if engine.default_skill == "auto" else engine.default_skill
    jobs = [Job(_prompt(vocab, k)[:n_prompt], Sampling(temperature=0.0, ignore_eos=True), min(n, limit - n_prompt),
                events.put, task=engine.default_task, skill=skill) for k, n in enumerate(MAX_TOKENS)]
    deadline = time.monotonic() + timeout
    # Together where two sequences may run at once; one after the other under --parallel 1 (where
    # the second could not even queue with --max-queue 0, and no step batches two anyway).
    rounds = [jobs] if engine.parallel >= 2 else [[job] for job in jobs]
    for batch in rounds:
        _run(engine, batch, events, deadline, timeout)
    engine.wait_idle(timeout=max(1.0, deadline - time.monotonic()))
    engine.call(lambda model: model.reset_route_stats()).result(timeout=60)
    engine.prefix.clear()
    engine.reset_counters()
    spent = compiling.totals() - before
    result = WarmUp(time.perf_counter() - start, spent.seconds, spent.kernels)
    log.debug("warmed up in %.1f s (%d kernels compiled in %.1f s)", result.seconds, result.kernels,
             result.compile_seconds)
    return result


__all__ = ["JOBS", "MAX_TOKENS", "PROMPT_TOKENS", "WarmUp", "WarmUpFailed", "warm_up"]
