"""The OpenAI API features of `cmf serve`: tool calls, structured output, embeddings, n > 1,
streaming logprobs, reasoning_content, and their refusals (400 in OpenAI's error shape).

The model is the tiny seeded qwen3 of tests/server_fixtures.py (random weights): whatever it
says, constrained decoding must make its forced tool calls and json_schema answers valid.
"""

from __future__ import annotations

import base64
import http.client
import json

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from server_fixtures import tiny_qwen3  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.server import reasoning as R  # noqa: E402
from cmf.server import tools_calls as T  # noqa: E402
from cmf.server.app import ServerThread, create_app  # noqa: E402
from cmf.server.engine import Engine  # noqa: E402
from cmf.server.schemas import RequestError  # noqa: E402

MODEL_ID = "tiny"
HELLO = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["c", "f"]}, "days": {"type": "integer",
                                                                                  "minimum": 1, "maximum": 9}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    out = root / "tiny.cmf"
    convert(tiny_qwen3(root / "hf"), out, quant="q8")
    model = cmf.load(out)
    eng = Engine(model, max_queue=32)
    with ServerThread(create_app(eng, model_id=MODEL_ID, max_body=1 << 20)) as s:
        s.engine = eng
        yield s
    eng.close()
    model.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def raw(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def chat(client, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 240)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, **kw)


# ----------------------------------------------------------------------------------- tool calls


def test_required_tool_call_round_trip(client):
    r = chat(client, tools=TOOLS, tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
    call = ch.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, params[call.function.name])
    # the result goes back through the template and the model answers (tools still offered)
    msgs = HELLO + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r2 = chat(client, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason in ("stop", "length")


def test_named_tool_call(client):
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].message.tool_calls, r.choices[0]
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


def test_forced_tool_call_streams_as_deltas(client):
    chunks = list(chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    # the name first, then the arguments: in pieces as they are generated, though events that
    # pile up between two flushes are merged (the tiny model's ~20 argument tokens can all land in
    # one 25 ms window, more so on a loaded machine: seen in CI). That the stream yields argument
    # pieces as the text arrives is test_call_stream_holds_calls's.
    assert len(calls) >= 2 and calls[0].function.arguments == "" and {tc.index for tc in calls} == {0}
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ----------------------------------------------------------------------------------- structured output


def test_json_schema_output_validates(client):
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                             "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_json_object_is_json(client):
    # an object with no schema: the random model may ramble past any budget, which is no failure here
    r = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    if r.choices[0].finish_reason == "length":
        pytest.skip("the random model did not close its object within 200 tokens")
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_grammar_parameter_regex(client):
    r = chat(client, extra_body={"grammar": {"type": "regex", "value": "(yes|no)"}})
    assert r.choices[0].message.content in ("yes", "no")


# ----------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("body,param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function"}]), "tools[0]"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(grammar={"type": "lark", "value": "start: nope"}), "grammar"),
])
def test_malformed_definitions_are_400(server, body, param):
    status, got = raw(server, "/v1/chat/completions", dict(model=MODEL_ID, messages=HELLO, max_tokens=2, **body))
    assert status == 400, got
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_embeddings_refusals(server):
    for body, param in ((dict(input="a", dimensions=8), "dimensions"), (dict(input=[]), "input"),
                        (dict(input="a", encoding_format="hex"), "encoding_format"),
                        (dict(input=[[99999]]), "input[0]")):
        status, got = raw(server, "/v1/embeddings", dict(model=MODEL_ID, **body))
        assert status == 400 and got["error"]["param"] == param, got


# ----------------------------------------------------------------------------------- embeddings


def test_embeddings_shape_determinism_and_batching(client):
    texts = ["hello model", "a second, longer text about the weather", "x"]
    one = client.embeddings.create(model=MODEL_ID, input=texts[0]).data[0].embedding
    again = client.embeddings.create(model=MODEL_ID, input=texts[0]).data[0].embedding
    assert len(one) == 64 and one == again
    assert abs(np.linalg.norm(one) - 1) < 1e-5
    batch = client.embeddings.create(model=MODEL_ID, input=texts)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.usage.prompt_tokens > 0
    for t, d in zip(texts, batch.data):
        single = client.embeddings.create(model=MODEL_ID, input=t).data[0].embedding
        assert np.max(np.abs(np.array(single) - np.array(d.embedding))) < 1e-6
    ids = client.embeddings.create(model=MODEL_ID, input=[[5, 6, 7]]).data[0].embedding
    assert len(ids) == 64


def test_embeddings_between_decode_steps(client):
    """A vector computed while a generation runs equals the idle one, and the generation goes on."""
    from concurrent.futures import ThreadPoolExecutor

    idle = client.embeddings.create(model=MODEL_ID, input="hello model").data[0].embedding
    alone = chat(client, max_tokens=40, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(2) as pool:
        gen = pool.submit(chat, client, max_tokens=40, extra_body={"ignore_eos": True})
        busy = [client.embeddings.create(model=MODEL_ID, input="hello model").data[0].embedding for _ in range(3)]
        assert gen.result().choices[0].message.content == alone.choices[0].message.content
    assert all(b == idle for b in busy)


def test_embeddings_base64(server):
    status, got = raw(server, "/v1/embeddings", dict(model=MODEL_ID, input="hello model", encoding_format="base64"))
    assert status == 200
    vec = np.frombuffer(base64.b64decode(got["data"][0]["embedding"]), "<f4")
    status, flt = raw(server, "/v1/embeddings", dict(model=MODEL_ID, input="hello model"))
    assert np.allclose(vec, flt["data"][0]["embedding"], atol=0)


# ----------------------------------------------------------------------------------- n, logprobs


def test_n_choices(client):
    greedy = chat(client, n=2, max_tokens=8)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    a = chat(client, n=2, max_tokens=8, temperature=1.0, seed=7)
    b = chat(client, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens >= 2  # both choices counted
    chunks = list(chat(client, n=2, max_tokens=4, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_completions_n(client, server):
    a = client.completions.create(model=MODEL_ID, prompt="hello", n=2, max_tokens=6, temperature=1.0, seed=3)
    b = client.completions.create(model=MODEL_ID, prompt="hello", n=2, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in a.choices] == [0, 1] and [c.text for c in a.choices] == [c.text for c in b.choices]
    chunks = list(client.completions.create(model=MODEL_ID, prompt="hello", n=2, max_tokens=4, stream=True,
                                            logprobs=1))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert any(c.choices[0].logprobs and c.choices[0].logprobs.tokens for c in chunks if c.choices)


def test_streaming_logprobs(client):
    chunks = list(chat(client, max_tokens=6, stream=True, logprobs=True, top_logprobs=2))
    lps = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)


def test_server_stays_up(client):
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


# ----------------------------------------------------------------------------------- a template that thinks

THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
FORCED = '<think>plan it</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("think")
    hf = tiny_qwen3(root / "hf")
    (hf / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    convert(hf, root / "t.cmf", quant="q8")
    model = cmf.load(root / "t.cmf")
    eng = Engine(model, max_queue=8)
    with ServerThread(create_app(eng, model_id=MODEL_ID)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    eng.close()
    model.close()


def test_reasoning_and_native_tool_template(thinking_client):
    # the grammar makes the random model say what a thinking, calling model would
    kw = dict(model=MODEL_ID, messages=HELLO, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"grammar": "start: " + json.dumps(FORCED)})
    r = thinking_client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "plan it"
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    chunks = list(thinking_client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "plan it"
    assert not "".join(d.content or "" for d in deltas).strip()
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in parts if tc.function.name] == ["add"]
    assert json.loads("".join(tc.function.arguments or "" for tc in parts)) == {"a": 1, "b": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ----------------------------------------------------------------------------------- parsing units


def test_parse_hermes():
    content, calls = T.parse_calls('ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "hermes")
    assert content == "ok" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert T.parse_calls("<tool_call>{broken</tool_call>", "hermes") == ("<tool_call>{broken</tool_call>", [])
    _, two = T.parse_calls('<tool_call>{"name":"a","arguments":{}}</tool_call><tool_call>{"name":"b"}', "hermes")
    assert [c["function"]["name"] for c in two] == ["a", "b"]


def test_parse_llama3():
    content, calls = T.parse_calls('<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', "llama3")
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"q": "x"}
    _, calls = T.parse_calls('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}', "llama3")
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert T.parse_calls("plain answer", "llama3") == ("plain answer", [])


def test_parse_mistral():
    _, calls = T.parse_calls('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                             "mistral")
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    _, calls = T.parse_calls('[{"name": "f", "arguments": {}}]', "mistral")  # the marker skipped as special
    assert calls[0]["function"]["name"] == "f"


def test_syntax_of_templates():
    assert T.syntax_of("{{ '<tool_call>' }}") == "hermes"
    assert T.syntax_of("[TOOL_CALLS]") == "mistral"
    assert T.syntax_of("<|python_tag|>") == "llama3"
    assert T.syntax_of(None) == "hermes"


def test_call_grammar_names_a_marker_token():
    setup = T.parse_tools(TOOLS, "required")
    g = T.call_grammar(setup, "hermes", {"<tool_call>": 7, "</tool_call>": 8}.get)
    assert g.startswith("start: <[7]>") and "<[8]>" in g and "%json" in g
    assert '"\\n"' not in T.call_grammar(setup, "mistral", lambda t: None)


def test_call_stream_holds_calls():
    s = T.CallStream("hermes", forced=False)
    (a, d1), (b, d2) = s.feed("Sure. <tool"), s.feed('_call>{"name": "f", "arguments": {"x": "}\\""}}</tool_call>')
    content, rest = s.finish()
    assert a + b == "Sure. " and content == "" and rest == []
    assert d1 == [] and d2[0]["function"] == {"name": "f", "arguments": ""} and d2[0]["index"] == 0
    assert json.loads("".join(d["function"]["arguments"] for d in d2)) == {"x": '}"'}
    bare = T.CallStream("llama3", forced=False)
    parts = [bare.feed(x) for x in ('{"name": "g", "param', 'eters": {"q": [1, ', '2]}}')]
    args = "".join(d["function"].get("arguments", "") for _, ds in parts for d in ds)
    assert json.loads(args) == {"q": [1, 2]} and bare.finish() == ("", [])


def test_reasoning_split():
    assert R.split("<think>hmm</think>\n\nanswer") == ("hmm", "answer")
    s = R.ReasoningStream()
    parts = [s.feed(x) for x in ("<thi", "nk>a", "b</thi", "nk>c")]
    assert "".join(p[0] for p in parts) == "ab" and "".join(p[1] for p in parts) == "c"


def test_prepare_for_a_template_without_tools():
    setup = T.parse_tools(TOOLS, "auto")
    msgs, tools = T.prepare([{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"id": "c1", "type": "function",
                                  "function": {"name": "add", "arguments": '{"a":1}'}}]},
                             {"role": "tool", "content": "2", "tool_call_id": "c1"}], setup, "{{ messages }}")
    assert tools is None and "<tools>" in msgs[0]["content"] and "get_weather" in msgs[0]["content"]
    assert "<tool_call>" in msgs[2]["content"] and msgs[3]["content"].startswith("<tool_response>")
    with pytest.raises(RequestError):
        T.parse_tools([{"type": "function", "function": {"name": "f", "parameters": []}}], None)


# ----------------------------------------------------------------------------------- validation never crashes

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cmf.server import structured as G  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                         st.sampled_from(["type", "function", "name", "parameters", "json_schema", "schema",
                                          "value", "properties", "x"]), kids, max_size=3), max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(_json, _json, _json, _json)
def test_tool_and_format_validation_raises_only_request_errors(tools, choice, rf, grammar):
    for fn, args in ((T.parse_tools, (tools, choice)), (G.response_format, (rf if isinstance(rf, dict) else None,)),
                     (G.grammar_param, (grammar,))):
        try:
            fn(*args)
        except RequestError as err:
            assert err.status == 400 and err.param
