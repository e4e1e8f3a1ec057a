"""The server's start warm-up (cmf/server/warmup.py): it runs, leaves no trace, and fails clearly."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("starlette")

from server_fixtures import tiny_qwen3_cmf  # noqa: E402

import cmf  # noqa: E402
from cmf.format.errors import CmfError  # noqa: E402
from cmf.format.growth import append  # noqa: E402
from cmf.server import warmup  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402
from cmf.server.jobs import Delta, Failed, Finished, Job  # noqa: E402
from cmf.server.schemas import Sampling  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 8]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return tiny_qwen3_cmf(tmp_path_factory.mktemp("warmup"))


def _answer(engine: Engine, ids: list[int], tokens: int = 12) -> tuple[str, Finished]:
    """A greedy answer of ``tokens`` tokens to ``ids``: its text and its Finished event."""
    events: queue.Queue = queue.Queue()
    engine.submit(Job(list(ids), Sampling(temperature=0.0, ignore_eos=True), tokens, events.put))
    text = []
    while True:
        ev = events.get(timeout=120)
        if isinstance(ev, Delta):
            text.append(ev.text)
        elif isinstance(ev, Failed):
            raise ev.error
        else:
            return "".join(text), ev


def test_warm_up_runs_the_jobs_and_leaves_no_trace(model_path: Path) -> None:
    cold_model, warm_model = cmf.load(model_path), cmf.load(model_path)
    cold, warm = Engine(cold_model, parallel=4), Engine(warm_model, parallel=4)
    try:
        done = warmup.warm_up(warm)
        assert done.seconds > 0 and done.compile_seconds >= 0 and done.kernels >= 0
        # the counters and the prefix cache start empty, as on an engine that never ran
        assert all(v == 0 for v in warm.stats.values()), warm.stats
        assert len(warm.prefix) == 0
        assert warm.retry_after() == 1
        # and the first request's answer is the one an engine without a warm-up gives
        text, fin = _answer(warm, PROMPT)
        assert (text, fin.completion_tokens) == _answer(cold, PROMPT)[0:1] + (12,)
        assert fin.cached_tokens == 0
        assert warm.stats["submitted"] == warm.stats["completed"] == 1
        assert warm.stats["prompt_tokens"] == len(PROMPT) and warm.stats["completion_tokens"] == 12
    finally:
        cold.close()
        warm.close()
        cold_model.close()
        warm_model.close()


@pytest.mark.parametrize("ctx", [2, 5, 12])
def test_warm_up_fits_a_small_context(model_path: Path, ctx: int) -> None:
    model = cmf.load(model_path, ctx_size=ctx)
    eng = Engine(model, parallel=4)
    try:
        assert eng.max_sequence_tokens == ctx
        done = warmup.warm_up(eng)
        assert done.seconds > 0
        assert all(v == 0 for v in eng.stats.values()), eng.stats
        text, fin = _answer(eng, PROMPT[:1], ctx - 1)  # the server still answers within the context
        assert fin.completion_tokens == ctx - 1
    finally:
        eng.close()
        model.close()


@pytest.mark.parametrize("max_queue", [0, 4])
def test_warm_up_with_one_sequence_at_a_time(model_path: Path, max_queue: int) -> None:
    model = cmf.load(model_path)
    eng = Engine(model, parallel=1, max_queue=max_queue)
    try:
        assert warmup.warm_up(eng).seconds > 0
        assert all(v == 0 for v in eng.stats.values()), eng.stats
    finally:
        eng.close()
        model.close()


def test_warm_up_runs_the_default_skill(model_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "skilled.cmf"
    path.write_bytes(model_path.read_bytes())
    plain = cmf.load(model_path)
    vocab = plain.plan.vocab
    plain.close()
    head = (np.random.default_rng(7).standard_normal((vocab, 64)) * 0.3).astype("<f4")
    append(path, [("skill.terse.lm_head.weight", "f32", head.shape, head.tobytes())],
           {"skills": [{"id": "terse", "name": "Terse", "layers": []}]})
    model = cmf.load(path)
    eng = Engine(model, default_skill="terse")
    submitted: list[Job] = []
    submit = eng.submit
    eng.submit = lambda job: submitted.append(job) or submit(job)  # type: ignore[method-assign]
    try:
        warmup.warm_up(eng)
        assert [j.skill for j in submitted] == ["terse", "terse"] and all(j.state == "done" for j in submitted)
    finally:
        eng.close()
        model.close()


class _FakeEngine:
    """An engine whose jobs fail at once (``fail``) or never finish."""

    def __init__(self, fail: BaseException | None) -> None:
        self.model = SimpleNamespace(plan=SimpleNamespace(vocab=50))
        self.max_sequence_tokens = 100
        self.default_task, self.default_skill = None, "auto"
        self.parallel = 4
        self.fail = fail
        self.jobs: list[Job] = []

    def submit(self, job: Job) -> Job:
        self.jobs.append(job)
        if self.fail is not None:
            threading.Thread(target=job.sink, args=(Failed(self.fail),)).start()
        return job


def test_a_failed_warm_up_names_the_error_and_cancels_the_jobs() -> None:
    eng = _FakeEngine(RuntimeError("kernel exploded"))
    with pytest.raises(warmup.WarmUpFailed, match="warm-up generation failed: RuntimeError: kernel exploded"):
        warmup.warm_up(eng)  # type: ignore[arg-type]
    assert len(eng.jobs) == warmup.JOBS and all(j.cancelled for j in eng.jobs)
    assert all(j.skill is None for j in eng.jobs)  # a default skill of "auto": the backbone
    assert issubclass(warmup.WarmUpFailed, CmfError)  # the CLI prints one line and exits 2


def test_a_warm_up_on_a_closed_engine_fails_clearly(model_path: Path) -> None:
    model = cmf.load(model_path)
    eng = Engine(model)
    eng.close()
    try:
        with pytest.raises(warmup.WarmUpFailed, match="could not start: the engine is shut down"):
            warmup.warm_up(eng)
    finally:
        model.close()


def test_a_warm_up_that_does_not_finish_times_out() -> None:
    eng = _FakeEngine(None)
    with pytest.raises(warmup.WarmUpFailed, match=r"did not finish in 0\.2 s"):
        warmup.warm_up(eng, timeout=0.2)  # type: ignore[arg-type]
    assert all(j.cancelled for j in eng.jobs)


def test_no_warm_up_where_no_request_fits() -> None:
    eng = _FakeEngine(RuntimeError("must not run"))
    eng.max_sequence_tokens = 1
    assert warmup.warm_up(eng) == warmup.WarmUp(0.0, 0.0, 0)  # type: ignore[arg-type]
    assert eng.jobs == []


def test_warm_up_prompts_are_distinct_ids_inside_the_vocabulary() -> None:
    prompts = [warmup._prompt(10, k) for k in range(warmup.JOBS)]
    assert all(len(p) == warmup.PROMPT_TOKENS and all(0 <= t < 10 for t in p) for p in prompts)
    assert prompts[0] != prompts[1]
