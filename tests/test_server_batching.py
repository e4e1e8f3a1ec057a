"""`cmf serve` under concurrency: continuous batching, the prefix cache, limits and disconnects.

The tiny numpy-built qwen3 of tests/test_server.py (q8, plus a task mask and a skill) serves over
real HTTP through the official ``openai`` client. The batched decode step is checked at the
runtime level first: a sequence's logits must not depend on what else is in the batch.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import hf_fixtures as H  # noqa: E402
from server_fixtures import tiny_qwen3  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.format.growth import append  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask  # noqa: E402
from cmf.runtime.batched import clone_prefix, decoder  # noqa: E402
from cmf.runtime.generate import prompt_ids_for  # noqa: E402
from cmf.server.app import ServerThread, create_app  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402

MODEL_ID = "tiny"
WORDS = ["tensor", "weight", "layer", "model", "hello", "token", "cache", "batch"]
PROMPTS = [[{"role": "user", "content": f"{WORDS[i % 8]} {WORDS[(3 * i + 1) % 8]} {i}"}] for i in range(16)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batching")
    out = root / "tiny.cmf"
    convert(tiny_qwen3(root / "hf"), out, quant="q8")
    rng = np.random.default_rng(7)
    head = (rng.standard_normal((H.VOCAB, 64)) * 0.3).astype("<f4")
    masks = MaskSet(default_task="general", masks=[
        TaskMask(task_id=0, name="general", ffn=np.ones((2, 96), bool), heads=np.ones((2, 4), bool),
                 gates=np.ones(2, bool), priority="Fallback"),
        TaskMask(task_id=1, name="half", ffn=rng.random((2, 96)) < 0.5, heads=np.array([[1, 0, 1, 1]] * 2, bool),
                 gates=np.ones(2, bool), priority="Normal")])
    append(out, [("skill.terse.lm_head.weight", "f32", head.shape, head.tobytes())],
           {"skills": [{"id": "terse", "name": "Terse", "layers": []}]}, masks=masks)
    return out


def _serve(model_path: Path, **engine_kw):
    model = cmf.load(model_path)
    eng = Engine(model, **engine_kw)
    srv = ServerThread(create_app(eng, model_id=MODEL_ID)).start()
    return model, eng, srv


def _close(model, eng, srv) -> None:
    srv.stop()
    eng.close()
    model.close()


@pytest.fixture(scope="module")
def served(model_path):
    parts = _serve(model_path, max_queue=64, parallel=16)
    yield parts
    _close(*parts)


def _client(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _stream_text(client, messages, **kw) -> tuple[str, object]:
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, stream=True, temperature=0,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


# ----------------------------------------------------------------------------------- the runtime


@pytest.mark.parametrize("task,skill,kv_cache", [(None, None, "f32"), ("half", None, "f32"), (None, "terse", "f32"),
                                                 (None, None, "f16")])
def test_batched_decode_logits_do_not_depend_on_the_batch(model_path, task, skill, kv_cache):
    """Each row of a batched decode step equals the one-token forward of that sequence alone
    (within 1e-5; for q8 the kernels make it exact), whatever the batch holds — with an f16 KV
    cache too (the server's default)."""
    model = cmf.load(model_path, task=task, skill=skill, kv_cache=kv_cache)
    try:
        tok = model.tokenizer
        prompts = [tok.encode(f"{w} {WORDS[(i + 3) % 8]} {w}") for i, w in enumerate(WORDS[:6])]
        caches, nxt = [], []
        for ids in prompts:
            c = model.new_cache()
            nxt.append(int(np.argmax(model.prefill(ids, c)[-1])))
            caches.append(c)
        alone = [clone_prefix(c, c.pos, 32) for c in caches]
        bd = decoder(model)
        solo_tok, batch_tok = list(nxt), list(nxt)
        for step in range(12):
            # the batch changes shape every step: 6, 5, 4, ... rows, in a rotating order
            k = 6 - step % 4
            rows = [(step + j) % 6 for j in range(k)]
            out = bd.step([batch_tok[r] for r in rows], [caches[r] for r in rows])
            for j, r in enumerate(rows):
                ref = model.forward([solo_tok[r]], alone[r])[-1]
                assert np.max(np.abs(ref - out[j])) <= 1e-5
                assert np.array_equal(ref, out[j])  # q8 products are row-exact
                solo_tok[r] = batch_tok[r] = int(np.argmax(ref))
            for r in set(range(6)) - set(rows):  # rows left out this step catch up alone
                for c_, t_ in ((caches, batch_tok), (alone, solo_tok)):
                    lg = model.forward([t_[r]], c_[r])[-1]
                    t_[r] = int(np.argmax(lg))
    finally:
        model.close()


def test_batch_sizes_past_the_kept_buffers_stay_exact(model_path):
    """Steps of ten different batch sizes (more than the decoder keeps arrays for) with int8
    activations and an f16 cache: every row still equals its sequence alone, bit for bit, and
    the kept arrays stay bounded."""
    from cmf.runtime.batched import MAX_BATCH_SIZES

    model = cmf.load(model_path, int8_activations=True, kv_cache="f16")
    try:
        tok = model.tokenizer
        n = MAX_BATCH_SIZES + 2
        caches, alone, nxt = [], [], []
        for i in range(n):
            c = model.new_cache()
            nxt.append(int(np.argmax(model.prefill(tok.encode(f"{WORDS[i % 8]} {i} {WORDS[(i + 5) % 8]}"), c)[-1])))
            caches.append(c)
            alone.append(clone_prefix(c, c.pos, 32))
        bd = decoder(model)
        for size in list(range(1, n + 1)) + [3, 1]:
            rows = list(range(size))
            out = bd.step([nxt[r] for r in rows], [caches[r] for r in rows])
            for j, r in enumerate(rows):
                ref = model.forward([nxt[r]], alone[r])[-1]
                assert np.array_equal(ref, out[j]), (size, r)
            for r in range(size, n):  # the others catch up alone, on both copies
                model.forward([nxt[r]], caches[r])
                model.forward([nxt[r]], alone[r])
            assert len(bd._bufs) <= MAX_BATCH_SIZES
    finally:
        model.close()


def test_kept_cache_addresses_follow_growth_rollback_and_moves(model_path):
    """The batched step keeps each layer's cache addresses while the same caches come back
    (batch_attend.StepCaches): over 80 steps (past the room it reserves ahead), after one cache is
    rolled back between steps and after another's arrays are replaced between steps (shrink),
    every row still equals its sequence alone, bit for bit."""
    from cmf.runtime.batched import shrink

    model = cmf.load(model_path, int8_activations=True, kv_cache="f16")
    try:
        tok = model.tokenizer
        caches, alone, nxt = [], [], []
        for i in range(3):
            c = model.new_cache()
            nxt.append(int(np.argmax(model.prefill(tok.encode(f"{WORDS[i]} {WORDS[i + 2]} {i}"), c)[-1])))
            caches.append(c)
            alone.append(clone_prefix(c, c.pos, 0))
        bd = decoder(model)
        for step in range(80):
            if step == 30:
                for c in (caches[1], alone[1]):
                    c.truncate(c.pos - 5)
            if step == 50:
                shrink(caches[2])
            out = bd.step(nxt, caches)
            for r in range(3):
                ref = model.forward([nxt[r]], alone[r])[-1]
                assert np.array_equal(ref, out[r]), (step, r)
                nxt[r] = int(np.argmax(ref))
        assert caches[0].pos > 64
        kept = dict(bd._kv._rows)
        assert kept and all(c.pos < f for c, f in zip(caches, bd._kv._floor))  # room left: nothing to move
        bd.step(nxt, caches)
        assert all(bd._kv._rows[i] is kept[i] for i in kept)  # gathered once, read again
    finally:
        model.close()


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """One file with matrices of the batch-exact families (and one 4-bit) at a few shapes."""
    import cmf.quant as q
    from cmf.format.reader import open as cmf_open
    from cmf.format.writer import CmfWriter

    from _builders import header

    path = tmp_path_factory.mktemp("batch-kernels") / "m.cmf"
    rng = np.random.default_rng(2)
    with CmfWriter(path, header()) as w:
        for rows, cols in ((200, 96), (64, 64), (576, 1024)):
            for dt in ("f32", "f16", "bf16", "q8_row", "q8_2f", "q4_tiled"):
                for k in range(2):  # two of each: a gate/up pair
                    m = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
                    w.add(f"{dt}.{rows}x{cols}.{k}", dt, m.shape, q.encode(m, dt))
        odd = (rng.standard_normal((37, 50)) * 0.05).astype(np.float32)  # f32 rows of 50: a scalar tail
        w.add("f32.37x50.0", "f32", odd.shape, q.encode(odd, "f32"))
    f = cmf_open(path)
    yield f
    f.close()


@pytest.mark.parametrize("paired", [True, False])
def test_batch_group_rows_equal_the_one_token_products(matrices, paired):
    from cmf.kernels import prepare
    from cmf.kernels.gemv import MatvecGroup
    from cmf.kernels.gemv_batch import BatchGroup

    rng = np.random.default_rng(4)
    names = sorted({n.rsplit(".", 1)[0] for n in matrices.keys()})
    for base in names:
        ops = [prepare(matrices.tensor(f"{base}.{k}")) for k in range(2) if f"{base}.{k}" in matrices]
        for group, act in ((ops[:1], None), (ops, "silu") if len(ops) == 2 else (ops[:1], None)):
            bg = BatchGroup(group, act)
            if not paired:
                bg.paired = False
            one = MatvecGroup(group, act)
            for t in (1, 2, 3, 7, 9, 12):
                X = rng.standard_normal((t, group[0].in_features)).astype(np.float32)
                Y = bg(X)
                for r in range(t):
                    y = one(X[r:r + 1], np.empty((1, one.out_features), np.float32))[0]
                    if bg.direct:  # q8, f16/bf16, f32: bit for bit
                        assert np.array_equal(y, Y[r]), (base, act, t, r)
                    else:
                        assert np.max(np.abs(y - Y[r])) <= 1e-5 * max(1.0, float(np.abs(y).max())), (base, t)
            if paired and bg.direct and group[0].in_features % 16 == 0:
                # (rows whose length leaves a scalar tail may fall back: the check decides)
                assert bg.paired, f"{base}: the paired kernel fell back on this CPU"


# ----------------------------------------------------------------------------------- batching


def test_concurrent_greedy_streams_equal_sequential(served):
    model, eng, srv = served
    client = _client(srv)
    kw = dict(max_tokens=24, extra_body={"ignore_eos": True})
    expected = [_stream_text(client, p, **kw)[0] for p in PROMPTS]  # one at a time
    assert len(set(expected)) > 8  # distinct answers: a mix-up between sequences would show
    before = eng.snapshot()

    def one(i: int) -> str:
        return _stream_text(_client(srv), PROMPTS[i], **kw)[0]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == expected
    after = eng.snapshot()
    assert after["max_batch"] >= 4, after  # the streams did run together
    assert after["completed"] - before["completed"] == 16 and after["failed"] == before["failed"]
    # sampled requests keep their own seeded sampler inside a batch
    skw = dict(max_tokens=12, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(model=MODEL_ID, messages=PROMPTS[0], **skw).choices[0].message.content
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: _client(srv).chat.completions.create(
            model=MODEL_ID, messages=PROMPTS[0], **skw).choices[0].message.content, range(8)))
    assert texts == [alone] * 8


def test_mixed_selections_queue_behind_each_other(served):
    """A batch runs one task/skill; requests under others wait for it and still get their answers."""
    model, eng, srv = served
    client = _client(srv)
    sels = [None, {"skill": "terse"}, {"task": "half"}, None, {"skill": "terse"}, {"task": "half"}]
    kw = dict(max_tokens=10, temperature=0)

    def one(i: int) -> tuple[str, str | None, str | None]:
        extra = {"ignore_eos": True, **({"cmf": sels[i]} if sels[i] else {})}
        r = _client(srv).chat.completions.create(model=MODEL_ID, messages=PROMPTS[i], extra_body=extra, **kw)
        return r.choices[0].message.content, r.model_extra["cmf"]["task"], r.model_extra["cmf"]["skill"]

    expected = [one(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(6)))
    assert got == expected
    assert [e[2] for e in expected] == [None, "terse", None] * 2
    assert [e[1] for e in expected] == ["general", "general", "half"] * 2
    assert client.chat.completions.create(model=MODEL_ID, messages=PROMPTS[1], **kw).choices[0].message.content


# ----------------------------------------------------------------------------------- prefix cache


def test_second_turn_reuses_the_first_turns_cache(served, model_path):
    model, eng, srv = served
    client = _client(srv)
    history = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hello model tensor"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and the layer weight?"}]
    text, usage = _stream_text(client, history, max_tokens=16)
    n_first = first.usage.prompt_tokens
    assert usage.prompt_tokens > n_first
    # the whole first prompt (and usually part of the answer) came from the cache
    assert n_first <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert eng.snapshot()["prefix_cache"]["hits"] >= 1
    # the same answer as a server without a prefix cache
    cold = _serve(model_path, prefix_cache_mb=0)
    try:
        ref, ref_usage = _stream_text(_client(cold[2]), history, max_tokens=16)
    finally:
        _close(*cold)
    assert text == ref and ref_usage.prompt_tokens_details.cached_tokens == 0
    # a skill runs under its own key: nothing of the backbone's KV is reused
    skilled = client.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=2, temperature=0,
                                             extra_body={"cmf": {"skill": "terse"}})
    assert skilled.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_report_cached_tokens(served):
    model, eng, srv = served
    client = _client(srv)
    prompt = "tensor weight layer model " * 8
    client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL_ID, prompt=prompt + "cache", max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(model.tokenizer.encode(prompt)) - 1


# ----------------------------------------------------------------------------------- limits


def _open_stream(srv, body: dict) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


LONG = {"model": MODEL_ID, "messages": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "stream": True,
        "ignore_eos": True}


def test_over_the_limits_is_429_with_retry_after(model_path):
    parts = _serve(model_path, parallel=1, max_queue=0)
    model, eng, srv = parts
    try:
        sock = _open_stream(srv, LONG)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": MODEL_ID, "messages": PROMPTS[1], "max_tokens": 4}), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        assert time.perf_counter() - t0 < 5.0  # at once, while the long answer runs
        assert r.status == 429 and int(r.getheader("Retry-After")) >= 1
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "--parallel 1" in err["message"]
        with pytest.raises(openai.RateLimitError):
            _client(srv).chat.completions.create(model=MODEL_ID, messages=PROMPTS[1], max_tokens=4)
        sock.close()
        assert eng.wait_idle(10)
        # the server stays up and serves the next request
        r = _client(srv).chat.completions.create(model=MODEL_ID, messages=PROMPTS[1], max_tokens=4)
        assert r.usage.completion_tokens >= 1
        assert eng.snapshot()["rejected"] == 2
    finally:
        _close(*parts)


def test_disconnect_frees_the_slot_within_a_step(model_path):
    parts = _serve(model_path, parallel=1, max_queue=4)
    model, eng, srv = parts
    try:
        before = eng.snapshot()
        sock = _open_stream(srv, LONG)
        got = b""
        while got.count(b"data: ") < 4:
            got += sock.recv(65536)
        # a second request queues behind the long one; the long one's client leaves
        client = _client(srv)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: client.chat.completions.create(model=MODEL_ID, messages=PROMPTS[2],
                                                                         max_tokens=4, temperature=0))
            deadline = time.monotonic() + 10
            while eng.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            t0 = time.perf_counter()
            at_close = eng.snapshot()["steps"]
            sock.close()
            r = waiting.result(timeout=30)
            served_after = time.perf_counter() - t0
        assert r.usage.completion_tokens >= 1
        assert served_after < 20.0, served_after
        after = eng.snapshot()
        assert after["cancelled"] == before["cancelled"] + 1  # it left before its 3000 tokens
        # the long answer stopped where its client left: counted in decode steps after the close
        # (the short request's few included), not in tokens since the start, which grow with the
        # decode speed while the second client sets itself up
        assert after["steps"] - at_close < 300, (after["steps"] - at_close, at_close - before["steps"])
    finally:
        _close(*parts)


def test_kv_budget_preempts_and_resumes(model_path):
    """With room for fewer sequences than run, the newest are preempted and resumed later; every
    answer is still complete and the one it gets alone."""
    model = cmf.load(model_path)
    per_token = Engine(model, parallel=1).bytes_per_token
    model.close()
    parts = _serve(model_path, parallel=4, kv_budget_mb=per_token * 700 / 2**20, prefix_cache_mb=0)
    model, eng, srv = parts
    try:
        client = _client(srv)
        kw = dict(max_tokens=300, extra_body={"ignore_eos": True})
        expected = [_stream_text(client, p, **kw)[0] for p in PROMPTS[:3]]
        clients = [_client(srv) for _ in range(3)]
        start = threading.Barrier(3)  # the three requests must run at once for the budget to bind:
        # made one after another (a loaded CI host starting the threads slowly) they fit and none is
        # preempted

        def together(i: int) -> tuple[str, object]:
            start.wait(timeout=30)
            return _stream_text(clients[i], PROMPTS[i], **kw)

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(together, range(3)))
        assert [g[0] for g in got] == expected
        assert all(g[1].completion_tokens == 300 for g in got)
        snap = eng.snapshot()
        assert snap["preempted"] >= 1 and snap["failed"] == 0
        # a request that cannot fit the budget alone is refused up front
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_ID, messages=PROMPTS[0], max_tokens=900)
        assert e.value.body["code"] == "context_length_exceeded" and "--kv-budget" in e.value.body["message"]
    finally:
        _close(*parts)


def test_long_prompt_is_prefilled_between_decode_steps(model_path):
    """A running stream keeps receiving tokens while a long prompt is prefilled chunk by chunk."""
    model = cmf.load(model_path)
    eng = Engine(model, parallel=4, prefill_chunk=32, prefix_cache_mb=0)
    srv = ServerThread(create_app(eng, model_id=MODEL_ID, stream_interval=0)).start()
    parts = (model, eng, srv)
    try:
        stamps: list[float] = []
        sock = _open_stream(srv, dict(LONG, max_tokens=100000 // 40))
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)

        def read() -> None:
            while True:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                stamps.extend([time.perf_counter()] * data.count(b"data: "))

        import threading

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        long_prompt = [{"role": "user", "content": " ".join(WORDS * 80)}]  # ~650 tokens: 20 chunks
        t0 = time.perf_counter()
        r = _client(srv).chat.completions.create(model=MODEL_ID, messages=long_prompt, max_tokens=1, temperature=0)
        t1 = t0 + r.model_extra["cmf"]["queue_ms"] / 1e3
        t_first = t1 + r.model_extra["cmf"]["time_to_first_token_ms"] / 1e3
        assert r.usage.prompt_tokens > 500
        during = [t for t in stamps if t1 <= t <= t_first]
        assert len(during) >= 5, (len(during), len(stamps))  # about one token per 32-token chunk
        sock.close()
    finally:
        _close(*parts)


def _channel_handovers(interval: float, script: list, expect: int) -> list[tuple[float, list]]:
    """A worker thread puts ``script``'s events into a Channel (a float in it: sleep that long);
    the coroutine's hand-overs until ``expect`` events came: (seconds since start, events)."""
    import asyncio
    import threading

    from cmf.server.plumbing import Channel

    async def main() -> list[tuple[float, list]]:
        chan = Channel(interval=interval)
        t0 = time.perf_counter()

        def worker() -> None:
            for item in script:
                if isinstance(item, float):
                    time.sleep(item)
                else:
                    chan.put(item)

        threading.Thread(target=worker).start()
        got: list[tuple[float, list]] = []
        while sum(len(g) for _, g in got) < expect:
            evs = await chan.get()
            got.append((time.perf_counter() - t0, evs))
        return got

    return asyncio.run(main())


def test_channel_hands_over_at_most_once_per_interval():
    """The first event goes out at once; later ones wait for the interval and go out together."""
    got = _channel_handovers(0.2, ["a", 0.02, "b", "c"], 3)
    assert got[0][1] == ["a"] and got[0][0] < 0.15
    assert [e for _, g in got[1:] for e in g] == ["b", "c"] and got[1][0] >= 0.19


@pytest.mark.parametrize("pair", [False, True])
def test_channel_final_event_cuts_the_interval_short(pair):
    """A job's end (Finished, also as an n > 1 request's (index, event) pair) goes out at once,
    with the deltas that waited for the interval, not after the interval's idle rest."""
    from cmf.server.jobs import Delta, Finished

    wrap = (lambda ev: (0, ev)) if pair else (lambda ev: ev)
    done = Finished("length", 3, 2)
    # the second put comes while the coroutine pauses out its 1 s interval
    got = _channel_handovers(1.0, [wrap(Delta("a", [])), 0.05, wrap(Delta("b", [])), wrap(done)], 3)
    assert got[0][1] == [wrap(Delta("a", []))]
    assert [e for _, g in got[1:] for e in g] == [wrap(Delta("b", [])), wrap(done)]
    assert got[-1][0] < 0.5, got  # not the 1 s interval


@pytest.mark.parametrize("usage", [True, False])
def test_content_frames_are_the_chunks_bytes(usage):
    """The per-token SSE template writes exactly what dumping the chunk dict would."""
    from cmf.server import responses as R
    from cmf.server.plumbing import sse

    frames = R.ContentFrames("chatcmpl-x", 17, 'm"odel\u00e9', with_usage_field=usage)
    for text in ("hi", "", 'quo"te\\ \n\t', "héllo 🙂", "\x00\u2028"):
        assert frames(text) == sse(R.chat_chunk("chatcmpl-x", 17, 'm"odel\u00e9', {"content": text},
                                                with_usage_field=usage))


def test_health_reports_the_engine(served):
    model, eng, srv = served
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    e = body["engine"]
    assert body["status"] == "ok" and e["parallel"] == 16 and e["kv_budget_mb"] > 0
    assert {"entries", "mb", "hits", "misses", "cached_tokens"} <= set(e["prefix_cache"])
    assert prompt_ids_for(model, PROMPTS[0])  # the fixture's prompts render
