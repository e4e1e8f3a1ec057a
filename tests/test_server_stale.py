"""A model file truncated, modified or replaced while the server has it mapped (issue 28).

Truncated or modified in place: every request that runs the model gets a 503
``model_file_changed`` in OpenAI's shape and ``/health`` answers 503, instead of the process dying
of SIGBUS on the next page it touches. Replaced by rename: the mapping keeps the old inode, so the
loaded version is served on and ``/health`` says ``file: replaced``.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from server_fixtures import tiny_qwen3_cmf  # noqa: E402

import cmf  # noqa: E402
from cmf.server.app import ServerThread, create_app  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return tiny_qwen3_cmf(tmp_path_factory.mktemp("stale"))


def call(s: ServerThread, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


_CUT_CODE = {"truncated": "os.truncate(sys.argv[1], os.path.getsize(sys.argv[1]) // 2)",
             "modified": "open(sys.argv[1], 'ab').write(bytes(4096))"}


def _cut(path: Path, change: str) -> None:
    """Truncate ``path`` to half, or append to it (an in-place append's footprint: same inode, new
    size), from another process, as a writer would: the server's read lease (cmf/server/lease.py)
    makes it wait until the engine stopped reading the mapping."""
    subprocess.run([sys.executable, "-c", "import os, sys; " + _CUT_CODE[change], str(path)], check=True, timeout=60)


def _cutter(path: Path, change: str) -> subprocess.Popen:
    """A process that makes :func:`_cut`'s change as soon as a line arrives on its stdin: started
    beforehand, so the change lands within a millisecond of the trigger, not after an
    interpreter's start-up (a fast host generates the whole test stream in a fraction of a second)."""
    code = "import os, sys; sys.stdin.readline(); " + _CUT_CODE[change]
    return subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE)


def serve(path: Path):
    model = cmf.load(path)
    eng = Engine(model, max_queue=4)
    return model, eng, ServerThread(create_app(eng, model_id="tiny", static_dir=None))


@pytest.mark.parametrize("change", ["truncated", "modified"])
def test_changed_in_place_is_refused_with_503(tmp_path: Path, built: Path, change: str) -> None:
    path = tmp_path / "m.cmf"
    shutil.copy(built, path)
    model, eng, srv = serve(path)
    try:
        with srv as s:
            assert call(s, "POST", "/v1/chat/completions", CHAT)[0] == 200
            _cut(path, change)
            for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                                ("/v1/tokenize", CHAT), ("/v1/embeddings", {"input": "a"})):
                status, err = call(s, "POST", route, body)
                assert status == 503, route
                assert err["error"]["code"] == "model_file_changed" and err["error"]["type"] == "server_error"
                assert change in err["error"]["message"]
            status, health = call(s, "GET", "/health")
            assert status == 503 and health["status"] == "unavailable" and health["file"] == change
            assert health["error"]["code"] == "model_file_changed"
            assert eng.snapshot()["completed"] == 1  # nothing else reached the model
    finally:
        eng.close()
        model.close()


def test_replaced_by_rename_keeps_serving_the_loaded_version(tmp_path: Path, built: Path) -> None:
    path = tmp_path / "m.cmf"
    shutil.copy(built, path)
    model, eng, srv = serve(path)
    try:
        with srv as s:
            first = call(s, "POST", "/v1/chat/completions", CHAT)
            new = tmp_path / "new.cmf"
            new.write_bytes(b"not a model at all")
            os.replace(new, path)  # what every cmf writer does: the old inode lives on in the mapping
            again = call(s, "POST", "/v1/chat/completions", CHAT)
            assert again[0] == 200
            assert again[1]["choices"][0]["message"]["content"] == first[1]["choices"][0]["message"]["content"]
            status, health = call(s, "GET", "/health")
            assert status == 200 and health["status"] == "ok" and health["file"] == "replaced"
    finally:
        eng.close()
        model.close()


# ----------------------------------------------------------------------------------- in flight


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stream_lines(port: int, out: list[bytes], started) -> None:  # noqa: ANN001
    body = {"prompt": "a", "max_tokens": 4000, "stream": True, "temperature": 1.0, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    while True:
        line = r.readline()
        if not line:
            break
        if line.strip():
            out.append(line.strip())
            started.set()
    conn.close()


@pytest.mark.parametrize("change", ["truncated", "modified"])
def test_cut_while_a_request_generates_does_not_kill_the_server(tmp_path: Path, built: Path, change: str) -> None:
    """Another process truncates (or opens for writing) the file while a stream is generating:
    the server's read lease makes it wait for the engine's step, the stream ends with the 503
    error object, and the server lives on, refusing model requests (was: SIGBUS, exit -7)."""
    import threading
    import time

    path = tmp_path / "m.cmf"
    shutil.copy(built, path)
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cmf", "serve", str(path), "--port", str(port)],
                            stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300  # the start's warm-up may compile kernels first
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        lines: list[bytes] = []
        started = threading.Event()
        cutter = _cutter(path, change)
        reader = threading.Thread(target=_stream_lines, args=(port, lines, started), daemon=True)
        reader.start()
        assert started.wait(30)  # the first token is out: the engine is generating
        cutter.communicate(b"cut\n", timeout=60)
        assert cutter.returncode == 0
        reader.join(60)
        assert not reader.is_alive()
        time.sleep(0.2)
        assert proc.poll() is None, f"the server died (exit {proc.returncode})"
        last = json.loads(lines[-1][len(b"data: "):])
        assert last["error"]["code"] == "model_file_changed", lines[-3:]
        status, health = _get(port, "/health")
        assert status == 503 and health["file"] == change
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 503 and json.loads(r.read())["error"]["code"] == "model_file_changed"
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _get(port: int, route: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", route)
    r = conn.getresponse()
    return r.status, json.loads(r.read())
