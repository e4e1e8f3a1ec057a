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
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from server_fixtures import tiny_qwen3  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.server.app import ServerThread, create_app  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stale")
    out = root / "built.cmf"
    convert(tiny_qwen3(root / "hf"), out, quant="q8")
    return out


def call(s: ServerThread, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


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
            if change == "truncated":
                os.truncate(path, path.stat().st_size // 2)
            else:
                with open(path, "ab") as fh:  # an in-place append's footprint: same inode, new size
                    fh.write(b"\0" * 4096)
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
