"""`cmf serve`: the OpenAI-compatible server, over real HTTP on an ephemeral loopback port.

The model is a tiny qwen3 built with numpy alone (no torch), converted at q8, then grown with a
skill (its own lm_head) and two task masks, so every test here also runs where torch is absent.
The official ``openai`` client is used unchanged; raw HTTP (http.client, sockets) covers what a
client library would not send: malformed bodies, missing keys, a reader that vanishes mid-stream.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import hf_fixtures as H  # noqa: E402  (its tokenizer trainer needs only `tokenizers`)
from server_fixtures import tiny_qwen3 as _tiny_qwen3  # noqa: E402

import cmf  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.format.growth import append  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask  # noqa: E402
from cmf.runtime.generate import prompt_ids_for  # noqa: E402
from cmf.server.app import ServerThread, create_app  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402

MODEL_ID = "tiny"
KEY = "sekrit-key"
HELLO = [{"role": "user", "content": "hello model"}]


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("server")
    out = root / "tiny.cmf"
    convert(_tiny_qwen3(root / "hf"), out, quant="q8")
    rng = np.random.default_rng(5)
    head = (rng.standard_normal((H.VOCAB, 64)) * 0.3).astype("<f4")
    masks = MaskSet(default_task="general", masks=[
        TaskMask(task_id=0, name="general", ffn=np.ones((2, 96), bool), heads=np.ones((2, 4), bool),
                 gates=np.ones(2, bool), priority="Fallback"),
        TaskMask(task_id=1, name="half", ffn=rng.random((2, 96)) < 0.5, heads=np.ones((2, 4), bool),
                 gates=np.ones(2, bool), priority="Normal", quality={"metric": "heldout_ppl_ratio", "value": 1.1})])
    append(out, [("skill.terse.lm_head.weight", "f32", head.shape, head.tobytes())],
           {"skills": [{"id": "terse", "name": "Terse", "layers": [], "quality": {"note": "test"}}]}, masks=masks)
    return out


@pytest.fixture(scope="module")
def engine(model_path):
    model = cmf.load(model_path)
    eng = Engine(model, max_queue=48)
    yield eng
    eng.close()
    model.close()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, model_id=MODEL_ID, max_body=1 << 20)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(engine):
    """A second app over the same engine, with an API key."""
    with ServerThread(create_app(engine, model_id=MODEL_ID, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def request(server, method: str, path: str, body: bytes | str | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw request: (status, headers, body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        data = data.encode() if isinstance(data, str) else data
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]


def chat(client, messages=HELLO, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kw)


# ----------------------------------------------------------------------------------- the surface


def test_models_list_and_card(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL_ID]
    card = client.models.retrieve(MODEL_ID)
    assert card.id == MODEL_ID and card.object == "model" and card.owned_by == "cmf"
    extra = card.model_extra["cmf"]
    assert extra["tasks"] == ["general", "half"] and extra["skills"] == ["terse"] and extra["ctx_size"] == 4096
    assert extra["arch"]["arch_name"] == "qwen3" and extra["parameters"] > 0 and "path" not in extra
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    status, _, body = request(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat_stream_equals_non_stream(client, engine):
    full = chat(client, max_tokens=16)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == MODEL_ID
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason in ("stop", "length")
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    fin = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(fin) == 1 and fin[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump()["total_tokens"] == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_are_real(client, engine):
    n_prompt = len(prompt_ids_for(engine.model, HELLO))
    r = chat(client, max_tokens=9, extra_body={"ignore_eos": True}, logprobs=True)
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == n_prompt + 9
    # one logprob entry per generated token, whose bytes make up the content
    entries = r.choices[0].logprobs.content
    assert len(entries) == 9
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == r.choices[0].message.content


TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello model tensor"},
         {"role": "assistant", "content": "weight layer 12."}, {"role": "user", "content": "héllo wörld 🙂\nnext"}]


def _tokenize(server, body: dict, path: str = "/v1/tokenize") -> tuple[int, dict]:
    status, _, raw = request(server, "POST", path, body)
    return status, json.loads(raw)


def test_tokenize_counts_what_the_template_and_tokenizer_make(server, client, engine, model_path):
    """POST /v1/tokenize: the prompt tokens of a chat body, equal to Hugging Face's own
    apply_chat_template + tokenizer on the source folder, and to what the chat route counts."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_path.parent / "hf"))
    for messages in (HELLO, TURNS):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = hf.encode(text, add_special_tokens=False)
        status, body = _tokenize(server, {"model": MODEL_ID, "messages": messages, "return_ids": True})
        assert status == 200, body
        assert body == {"object": "tokenize", "model": MODEL_ID, "prompt_tokens": len(expected), "ctx_size": 4096,
                        "max_tokens": 4096 - len(expected), "ids": expected}
        assert chat(client, messages=messages, max_tokens=1).usage.prompt_tokens == len(expected)
        # the budget it names is the chat route's: one token more is refused, quoting the same count
        status, _, raw = request(server, "POST", "/v1/chat/completions",
                                 {"model": MODEL_ID, "messages": messages, "max_tokens": body["max_tokens"] + 1})
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded"
        assert f"({len(expected)} in the prompt" in err["message"]
    # without return_ids only the counts; the same body a chat request sends (sampling, stream) is fine
    status, body = _tokenize(server, {"messages": HELLO, "max_tokens": 512, "temperature": 0.8, "stream": True,
                                      "stream_options": {"include_usage": True}, "cmf": {"skill": "terse"}},
                             path="/tokenize")
    assert status == 200 and set(body) == {"object", "model", "prompt_tokens", "ctx_size", "max_tokens"}
    assert body["prompt_tokens"] == len(prompt_ids_for(engine.model, HELLO))


def test_tokenize_completion_prompts_and_refusals(server, client):
    text = "hello model tensor"
    n_text = client.completions.create(model=MODEL_ID, prompt=text, max_tokens=1, temperature=0).usage.prompt_tokens
    status, body = _tokenize(server, {"prompt": text, "return_ids": True})
    assert status == 200 and body["prompt_tokens"] == n_text == len(body["ids"])
    assert _tokenize(server, {"prompt": [5, 6, 7]})[1]["prompt_tokens"] == 3
    # a prompt past the context is counted, not refused: max_tokens 0 says it cannot run
    status, body = _tokenize(server, {"messages": [{"role": "user", "content": LONG}]})
    assert status == 200 and body["prompt_tokens"] > 4096 and body["max_tokens"] == 0
    for bad_body, code, param in (({"messages": []}, "invalid_value", "messages"),
                                  ({"messages": HELLO, "return_ids": 1}, "invalid_type", "return_ids"),
                                  ({"prompt": [10**9]}, "invalid_value", "prompt"),
                                  ({}, "missing_field", "messages")):
        status, body = _tokenize(server, bad_body)
        assert status == 400 and body["error"]["code"] == code and body["error"]["param"] == param, body
    status, body = _tokenize(server, {"model": "other", "messages": HELLO})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_sse_wire_format_ends_with_done(server):
    status, headers, raw = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL_ID, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-2]["choices"][0]["finish_reason"] is not None and objs[-2]["choices"][0]["delta"] == {}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] >= 1
    assert all("usage" in o and o["usage"] is None for o in objs[:-1])


def test_completions_stream_and_echo(client):
    full = client.completions.create(model=MODEL_ID, prompt="tensor weight", max_tokens=10, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text and full.usage.prompt_tokens == 2
    parts = list(client.completions.create(model=MODEL_ID, prompt="tensor weight", max_tokens=10, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    echo = client.completions.create(model=MODEL_ID, prompt="tensor weight", max_tokens=10, temperature=0, echo=True,
                                     logprobs=2)
    assert echo.choices[0].text == "tensor weight" + full.choices[0].text
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 10
    assert lp.text_offset[0] == len("tensor weight") and all(len(t) <= 2 for t in lp.top_logprobs)
    ids = client.completions.create(model=MODEL_ID, prompt=[[5, 6, 7]], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_stop_sequences(client):
    base = chat(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    cut = next(i for i in range(4, len(base)) if base[i].strip() and base[i] != "\ufffd")
    stop = base[cut:cut + 2]
    r = chat(client, max_tokens=24, stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == base[:base.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=24, stop=stop, stream=True,
                                                                    extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].message.content


def test_seed_reproducible(client):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = chat(client, seed=1234, **kw).choices[0].message.content
    b = chat(client, seed=1234, **kw).choices[0].message.content
    c = chat(client, seed=99, **kw).choices[0].message.content
    assert a == b and a != c


def test_logprobs_and_logit_bias(client, engine):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    for e in r.choices[0].logprobs.content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the most likely
        assert sum(np.exp(tops)) <= 1 + 1e-6
    forced = engine.tokenizer.encode(" tensor", add_special_tokens=False)
    assert len(forced) == 1
    r = chat(client, max_tokens=4, logit_bias={str(forced[0]): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == " tensor" * 4
    r = chat(client, max_tokens=6, frequency_penalty=2.0, presence_penalty=2.0, logit_bias={str(forced[0]): 5},
             extra_body={"repeat_penalty": 1.3, "ignore_eos": True})
    assert r.choices[0].message.content.count(" tensor") <= 2  # the penalties beat a mild bias


def test_max_completion_tokens_and_message_forms(client):
    r = chat(client, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    parts = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "model"}]},
             {"role": "assistant", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "c1"},
             {"role": "user", "content": "again"}]
    assert chat(client, messages=parts, max_tokens=3).choices[0].message.content is not None


def test_api_key(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL_ID]
    assert chat(good, max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(bad, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, headers, body = request(keyed, "POST", "/v1/chat/completions", {"messages": HELLO})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["www-authenticate"] == "Bearer"
    status, _, _ = request(keyed, "POST", "/v1/chat/completions", {"messages": HELLO},
                        {"Authorization": "Basic " + KEY})
    assert status == 401
    for path in ("/v1/models/" + MODEL_ID, "/models/" + MODEL_ID, "/models", "/v1/unknown"):
        assert request(keyed, "GET", path)[0] == 401, path
    assert request(keyed, "GET", "/models", headers={"Authorization": "Bearer " + KEY})[0] == 200
    assert request(keyed, "GET", "/health")[0] == 200  # health stays public
    assert request(keyed, "GET", "/")[0] == 200  # and so does the chat page, which asks for the key
    assert request(keyed, "GET", "/static/app.css")[0] == 200


def test_task_and_skill_per_request(client, server):
    base = chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    assert base.model_extra["cmf"]["task"] == "general" and base.model_extra["cmf"]["skill"] is None
    skilled = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"skill": "terse"}})
    assert skilled.model_extra["cmf"]["skill"] == "terse"
    assert skilled.choices[0].message.content != base.choices[0].message.content
    again = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"skill": None}})
    assert again.choices[0].message.content == base.choices[0].message.content  # switching back is exact
    tasked = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"task": "half"}})
    assert tasked.model_extra["cmf"]["task"] == "half"
    assert tasked.choices[0].message.content != base.choices[0].message.content  # half the FFN rows off
    again = chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == base.choices[0].message.content
    # blends: all weight on one skill is that skill; "auto" routes (no routable skill here: the backbone)
    blended = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"blend": {"terse": 2.0}}})
    assert blended.choices[0].message.content == skilled.choices[0].message.content
    assert blended.model_extra["cmf"].get("blend", {"terse": 1.0}) == {"terse": 1.0}  # may run as the skill
    half = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"blend": {"terse": 1, "none": 1}}})
    assert half.model_extra["cmf"]["blend"] == {"terse": 0.5, "none": 0.5}
    routed = chat(client, max_tokens=10, extra_body={"ignore_eos": True, "cmf": {"skill": "auto"}})
    assert routed.model_extra["cmf"]["route"]["winner"] is None
    assert routed.choices[0].message.content == base.choices[0].message.content
    assert "route" in chat(client, max_tokens=2, extra_body={"cmf": {"blend": "auto"}}).model_extra["cmf"]
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, extra_body={"cmf": {"task": "nope"}})
    assert e.value.body["code"] == "task_not_found" and e.value.body["param"] == "cmf.task"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, extra_body={"cmf": {"skill": "nope"}})
    assert e.value.body["code"] == "skill_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, extra_body={"cmf": {"blend": {"terse": 0.5, "nope": 0.5}}})
    assert e.value.body["param"] == "cmf.blend.nope"
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"cmf": {"blend": {"terse": 0}}})
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"cmf": {"blend": {"terse": 1}, "skill": "terse"}})
    # a streamed request reports the selection in its finish chunk
    chunks = list(chat(client, max_tokens=2, stream=True, extra_body={"cmf": {"skill": "terse"}}))
    fin = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert fin.model_extra["cmf"]["skill"] == "terse"


# ----------------------------------------------------------------------------------- bad input

_M = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2}
LONG = "hello model tensor weight " * 1500  # ~6000 tokens > ctx 4096, far under the body cap
BAD = [
    # (name, path, body, status, param, code)
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    ("not utf-8", "/v1/chat/completions", b'{"messages": "\xff"}', 400, None, "invalid_json"),
    ("empty body", "/v1/chat/completions", b"", 400, None, "invalid_json"),
    ("array body", "/v1/chat/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400, None, "invalid_json"),
    ("deep nesting", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400, None, "invalid_json"),
    ("messages not array", "/v1/chat/completions", dict(_M, messages="hi"), 400, "messages", "invalid_type"),
    ("messages missing", "/v1/chat/completions", {"model": MODEL_ID}, 400, "messages", "missing_field"),
    ("empty messages", "/v1/chat/completions", dict(_M, messages=[]), 400, "messages", "invalid_value"),
    ("bad role", "/v1/chat/completions", dict(_M, messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", "invalid_value"),
    ("content number", "/v1/chat/completions", dict(_M, messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "invalid_type"),
    ("image part", "/v1/chat/completions",
     dict(_M, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0].type", "unsupported_value"),
    ("max_tokens string", "/v1/chat/completions", dict(_M, max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("max_tokens bool", "/v1/chat/completions", dict(_M, max_tokens=True), 400, "max_tokens", "invalid_type"),
    ("negative max_tokens", "/v1/chat/completions", dict(_M, max_tokens=-3), 400, "max_tokens", "invalid_value"),
    ("temperature string", "/v1/chat/completions", dict(_M, temperature="hot"), 400, "temperature", "invalid_type"),
    ("temperature range", "/v1/chat/completions", dict(_M, temperature=5), 400, "temperature", "invalid_value"),
    ("top_p range", "/v1/chat/completions", dict(_M, top_p=1.5), 400, "top_p", "invalid_value"),
    ("stream string", "/v1/chat/completions", dict(_M, stream="yes"), 400, "stream", "invalid_type"),
    ("stop number", "/v1/chat/completions", dict(_M, stop=5), 400, "stop", "invalid_type"),
    ("logit_bias key", "/v1/chat/completions", dict(_M, logit_bias={"abc": 1}), 400, "logit_bias", "invalid_value"),
    ("logit_bias id", "/v1/chat/completions", dict(_M, logit_bias={"99999": 1}), 400, "logit_bias", "invalid_value"),
    ("logit_bias value", "/v1/chat/completions", dict(_M, logit_bias={"5": 500}), 400, "logit_bias.5",
     "invalid_value"),
    ("top_logprobs alone", "/v1/chat/completions", dict(_M, top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("n past the cap", "/v1/chat/completions", dict(_M, n=17), 400, "n", "invalid_value"),
    ("completions n past the cap", "/v1/completions", {"prompt": "a", "n": 17}, 400, "n", "invalid_value"),
    ("cmf not object", "/v1/chat/completions", dict(_M, cmf="terse"), 400, "cmf", "invalid_type"),
    ("response_format type", "/v1/chat/completions", dict(_M, response_format={"type": "yaml"}), 400,
     "response_format.type", "invalid_value"),
    ("prompt past context", "/v1/chat/completions", dict(_M, messages=[{"role": "user", "content": LONG}]), 400,
     "messages", "context_length_exceeded"),
    ("max_tokens past context", "/v1/chat/completions", dict(_M, max_tokens=5000), 400, "max_tokens",
     "context_length_exceeded"),
    ("unknown model", "/v1/chat/completions", dict(_M, model="gpt-9"), 404, "model", "model_not_found"),
    ("completions no prompt", "/v1/completions", {"model": MODEL_ID}, 400, "prompt", "missing_field"),
    ("completions batch", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    ("completions bad id", "/v1/completions", {"prompt": [1, 100000]}, 400, "prompt", "invalid_value"),
    ("completions logprobs", "/v1/completions", {"prompt": "a", "logprobs": 9}, 400, "logprobs", "invalid_value"),
    ("completions suffix", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix", "unsupported_value"),
    ("completions past context", "/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, name, path, body, status, param, code):
    got, headers, raw = request(server, "POST", path, body)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_routes_sizes_and_unknown_fields(server):
    status, _, raw = request(server, "GET", "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, _, raw = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    status, headers, raw = request(server, "GET", "/")  # the chat page (tests/test_webui.py drives it)
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/static/app.js" in raw
    assert request(server, "GET", "/static/app.js")[0] == 200
    assert request(server, "GET", "/static/nothing.js")[0] == 404
    huge = json.dumps(dict(_M, messages=[{"role": "user", "content": "x" * (2 << 20)}]))
    status, _, raw = request(server, "POST", "/v1/chat/completions", huge)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    status, _, raw = request(server, "POST", "/v1/chat/completions", dict(_M, frobnicate={"x": 1}, user="u", store=False))
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["role"] == "assistant"
    status, _, raw = request(server, "POST", "/chat/completions", _M)  # without the /v1 prefix too
    assert status == 200
    assert request(server, "GET", "/health")[0] == 200  # still up after all of the above


# ----------------------------------------------------------------------------------- load and cancellation


def test_concurrent_streams_all_correct(server, engine, client):
    prompts = [[{"role": "user", "content": f"prompt {i} tensor"}] for i in range(4)]
    expected = [chat(client, messages=p, max_tokens=6).choices[0].message.content for p in prompts]
    before = engine.snapshot()
    health: list[float] = []

    def worker(i: int) -> list[bool]:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        ok = []
        for j in range(3):
            k = (i + j) % len(prompts)
            text = "".join(ch.choices[0].delta.content or "" for ch in
                           chat(c, messages=prompts[k], max_tokens=6, stream=True) if ch.choices)
            ok.append(text == expected[k])
        return ok

    def probe() -> None:
        t0 = time.perf_counter()
        assert request(server, "GET", "/health")[0] == 200
        health.append(time.perf_counter() - t0)

    with ThreadPoolExecutor(33) as pool:
        futures = [pool.submit(worker, i) for i in range(32)]
        time.sleep(0.2)
        probe()
        results = [f.result() for f in futures]
    assert all(all(r) for r in results)
    assert health and health[0] < 2.0  # /health does not wait for the queue
    after = engine.snapshot()
    assert after["completed"] - before["completed"] == 96 and after["failed"] == before["failed"]
    assert after["rejected"] == before["rejected"]


def test_queue_full_gives_429_quickly(model_path):
    model = cmf.load(model_path)
    eng = Engine(model, max_queue=2)
    try:
        with ServerThread(create_app(eng, model_id=MODEL_ID)) as s:
            eng.pause()
            with ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(request, s, "POST", "/v1/chat/completions", _M) for _ in range(2)]
                deadline = time.monotonic() + 10
                while eng.waiting < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert eng.waiting == 2
                t0 = time.perf_counter()
                status, headers, raw = request(s, "POST", "/v1/chat/completions", _M)
                assert time.perf_counter() - t0 < 1.0
                assert status == 429 and headers["retry-after"] == "1"
                assert json.loads(raw)["error"]["code"] == "queue_full"
                c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    chat(c)
                eng.resume()
                assert [f.result()[0] for f in waiting] == [200, 200]
            assert eng.snapshot()["rejected"] == 2
    finally:
        eng.close()
        model.close()


def _open_stream(server, body: dict) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_disconnect_cancels_generation(server, engine):
    assert engine.wait_idle(30)
    before = engine.snapshot()
    body = dict(_M, max_tokens=3000, stream=True, ignore_eos=True)
    sock = _open_stream(server, body)
    got = b""
    while got.count(b"data: ") < 4:  # the role chunk and a few tokens
        got += sock.recv(65536)
    sock.close()
    assert engine.wait_idle(15), "the engine kept generating for a client that left"
    after = engine.snapshot()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < 3000
    # non-streaming: a client that gives up waiting cancels too
    sock = _open_stream(server, dict(body, stream=False))
    deadline = time.monotonic() + 10
    while not engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()
    assert engine.wait_idle(15)
    assert engine.snapshot()["cancelled"] == before["cancelled"] + 2


def test_slow_reader_does_not_stall_the_engine(server, engine, client):
    assert engine.wait_idle(30)
    # ~600 KB of SSE (top-20 logprobs on every token): more than the socket buffers hold, so the
    # transport backs up; the worker must still finish the job and take the next one.
    sock = _open_stream(server, dict(_M, max_tokens=300, stream=True, ignore_eos=True, logprobs=True,
                                     top_logprobs=20))
    try:
        deadline = time.monotonic() + 10
        while not engine.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.wait_idle(60), "the worker waited for a client that does not read"
        assert chat(client, max_tokens=3).usage.completion_tokens >= 1
    finally:
        sock.close()


def test_queued_job_of_departed_client_is_skipped(server, engine):
    assert engine.wait_idle(30)
    engine.pause()
    try:
        before = engine.snapshot()
        sock = _open_stream(server, dict(_M, max_tokens=50, stream=True))
        deadline = time.monotonic() + 10
        while engine.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.waiting == 1
        sock.recv(4096)  # the role chunk arrives while queued
        sock.close()
        time.sleep(0.3)
    finally:
        engine.resume()
    assert engine.wait_idle(15)
    after = engine.snapshot()
    assert after["cancelled"] == before["cancelled"] + 1 and after["completion_tokens"] == before["completion_tokens"]


# ----------------------------------------------------------------------------------- the CLI


def test_cli_refuses_skill_file_and_bad_file(tmp_path, capsys):
    from _builders import header, write_sample

    skill_file = tmp_path / "skill.cmf"
    write_sample(skill_file, masks=False, hdr=header(skills=[{"id": "s", "base_dir_hash": "ab" * 8}]))
    assert main(["serve", str(skill_file), "--port", "0"]) == 2
    assert "skill file" in capsys.readouterr().err
    junk = tmp_path / "junk.cmf"
    junk.write_bytes(b"not a cmf file" * 20)
    assert main(["serve", str(junk), "--port", "0"]) == 2
    assert "cmf: error:" in capsys.readouterr().err


def test_server_activations_rule(monkeypatch):
    """`cmf serve` runs int8 activations unless --exact-act or CMF_INT8_ACT=0; both flags at once
    are a usage error (exit 2, one line)."""
    import argparse

    from cmf.tools import UsageError
    from cmf.tools.serve import server_int8

    def ns(**kw):
        return argparse.Namespace(**{"int8_act": None, "exact_act": False, **kw})

    monkeypatch.delenv("CMF_INT8_ACT", raising=False)
    assert server_int8(ns()) is True
    assert server_int8(ns(exact_act=True)) is False
    assert server_int8(ns(int8_act=True)) is True
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("CMF_INT8_ACT", off)
        assert server_int8(ns()) is False
        assert server_int8(ns(int8_act=True)) is True  # the flag wins over the environment
    monkeypatch.setenv("CMF_INT8_ACT", "1")
    assert server_int8(ns()) is True
    with pytest.raises(UsageError, match="contradict"):
        server_int8(ns(int8_act=True, exact_act=True))


def test_server_kv_cache_default_and_overrides(monkeypatch):
    """`cmf serve` stores its KV caches as f16 unless --kv-cache or CMF_KV_CACHE says otherwise;
    an unknown CMF_KV_CACHE is a usage error, not a silent default."""
    import argparse

    from cmf.tools import UsageError
    from cmf.tools.serve import server_kv_cache

    monkeypatch.delenv("CMF_KV_CACHE", raising=False)
    assert server_kv_cache(argparse.Namespace(kv_cache=None)) == "f16"
    assert server_kv_cache(argparse.Namespace(kv_cache="f32")) == "f32"
    monkeypatch.setenv("CMF_KV_CACHE", "F32")
    assert server_kv_cache(argparse.Namespace(kv_cache=None)) == "f32"
    assert server_kv_cache(argparse.Namespace(kv_cache="f16")) == "f16"  # the flag wins
    monkeypatch.setenv("CMF_KV_CACHE", "q8")
    with pytest.raises(UsageError, match="CMF_KV_CACHE must be f32 or f16"):
        server_kv_cache(argparse.Namespace(kv_cache=None))


def test_cli_usage_errors_are_one_line(model_path, capsys):
    assert main(["serve", str(model_path), "--int8-act", "--exact-act"]) == 2
    assert capsys.readouterr().err == "cmf: error: --int8-act and --exact-act contradict each other; give one\n"
    assert main(["serve", str(model_path), "--max-queue", "-1"]) == 2
    assert capsys.readouterr().err == "cmf: error: --max-queue must be >= 0, got -1\n"


def test_app_reports_its_activations(model_path):
    """/health and the model card say which activations and KV cache the loaded model runs."""
    for int8, want, kv in ((True, "int8", "f16"), (False, "exact", "f32")):
        model = cmf.load(model_path, int8_activations=int8, kv_cache=kv)
        eng = Engine(model, max_queue=4)
        try:
            with ServerThread(create_app(eng, model_id="m")) as srv:
                conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
                conn.request("GET", "/health")
                health = json.loads(conn.getresponse().read())
                assert (health["activations"], health["kv_cache"]) == (want, kv)
                conn.request("GET", "/v1/models/m")
                card = json.loads(conn.getresponse().read())["cmf"]
                assert (card["activations"], card["kv_cache"]) == (want, kv)
                conn.close()
        finally:
            eng.close()
            model.close()


def _stderr_until_serving(proc: subprocess.Popen, seconds: float) -> list[str]:
    """The lines ``cmf serve`` wrote to stderr up to its ``serving ... on URL`` line (the last)."""
    seen = [""]
    deadline = time.monotonic() + seconds
    while "serving" not in seen[-1] and time.monotonic() < deadline:
        seen.append(proc.stderr.readline())
        if not seen[-1] and proc.poll() is not None:
            break
    return seen


def test_cli_serves_until_interrupted(model_path, tmp_path):
    cmd = [sys.executable, "-m", "cmf", "serve", str(model_path), "--port", "0", "--alias", "cli-model",
           "--api-key", KEY, "--max-queue", "4"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        seen = _stderr_until_serving(proc, 300)  # the start's warm-up may compile kernels first
        line = seen[-1]
        assert "serving cli-model" in line, "".join(seen)
        assert any(ln.startswith("cmf: warmed up in ") for ln in seen), "".join(seen)  # before it serves
        assert "int8 activations, f16 KV cache" in line, line  # the server's defaults on a q8 file
        url = line.split(" on ", 1)[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        r = c.chat.completions.create(model="cli-model", messages=HELLO, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        hostport = url.split("//", 1)[1].split("/", 1)[0]
        conn = http.client.HTTPConnection(*hostport.rsplit(":", 1), timeout=30)
        conn.request("GET", "/health")
        assert json.loads(conn.getresponse().read())["activations"] == "int8"
        conn.close()
        proc.send_signal(2)  # SIGINT, as Ctrl-C
        rest = proc.communicate(timeout=30)[1]
        assert "method=POST path=/v1/chat/completions status=200" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_no_warmup_serves_at_once(model_path):
    cmd = [sys.executable, "-m", "cmf", "serve", str(model_path), "--port", "0", "--no-warmup"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        seen = _stderr_until_serving(proc, 120)
        assert "serving" in seen[-1], "".join(seen)
        assert not any("warm" in ln for ln in seen), "".join(seen)
        proc.send_signal(2)  # at once: the line comes once uvicorn's Ctrl-C handlers are in place
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_greedy_requests_use_mtp_drafts_with_identical_answers():
    pytest.importorskip("transformers")  # the MTP fixture is built with torch
    model = cmf.load(H.converted("qwen3_5", "q8", mtp=True))
    eng = Engine(model, max_queue=4)
    try:
        assert model.has_mtp
        with ServerThread(create_app(eng, model_id=MODEL_ID)) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            kw = dict(max_tokens=12, logprobs=True, extra_body={"ignore_eos": True})
            drafted = chat(c, **kw)
            eng.speculative = False
            plain = chat(c, **kw)
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        assert [e.token for e in drafted.choices[0].logprobs.content] == \
            [e.token for e in plain.choices[0].logprobs.content]
        assert drafted.usage.completion_tokens == plain.usage.completion_tokens == 12
        assert drafted.model_extra["cmf"]["spec_drafted"] > 0 and "spec_drafted" not in plain.model_extra["cmf"]
    finally:
        eng.close()
        model.close()


# ----------------------------------------------------------------------------------- validation fuzz

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cmf.server import schemas  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                     | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                     max_leaves=12)
_keys = st.sampled_from(["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                         "stop", "seed", "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options",
                         "presence_penalty", "frequency_penalty", "top_k", "min_p", "repeat_penalty", "cmf", "tools",
                         "response_format", "chat_template_kwargs", "prompt", "echo", "suffix", "best_of",
                         "ignore_eos"])
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
                                  "content": st.text(max_size=8) | _json})
_body = st.dictionaries(_keys, _json, max_size=8) | st.builds(
    lambda d, m: dict(d, messages=m), st.dictionaries(_keys, _json, max_size=6), st.lists(_message, max_size=3))


@settings(max_examples=400, deadline=None)
@given(_body | _json)
def test_validation_never_raises_anything_but_request_error(body):
    for parse in (schemas.parse_chat, schemas.parse_completion):
        try:
            parse(body, vocab=384)
        except schemas.RequestError as err:
            assert 400 <= err.status < 500 and err.message and set(err.body()["error"]) == {
                "message", "type", "param", "code"}
