"""Resource bounds on hostile input: one test per bound (issue 28).

Request bounds are checked on the pure validators (``cmf.server.schemas``): every breach is a
400 in OpenAI's error shape naming the field. Chat-template bounds run the real sandbox.
File bounds (header size and depth, directory count) live in tests/test_malformed.py.
"""

from __future__ import annotations

import time

import pytest

from cmf.runtime.chat import ChatTemplateError, render_chat
from cmf.runtime import chat_sandbox as SB
from cmf.server import limits as L
from cmf.server import schemas as S

VOCAB = 1000
HI = [{"role": "user", "content": "hi"}]


def refused(body: dict, param: str, code: str, *, chat: bool = True) -> S.RequestError:
    with pytest.raises(S.RequestError) as ei:
        (S.parse_chat if chat else S.parse_completion)(body, vocab=VOCAB)
    err = ei.value
    assert err.status == 400 and err.param == param and err.code == code
    body_ = err.body()["error"]
    assert set(body_) == {"message", "type", "param", "code"} and body_["type"] == "invalid_request_error"
    return err


def nested(depth: int) -> dict:
    obj: dict = {"type": "string"}
    for _ in range(depth - 1):
        obj = {"type": "array", "items": obj}
    return obj


# ----------------------------------------------------------------------------------- requests


def test_stop_count_and_length() -> None:
    assert S.parse_chat(dict(messages=HI, stop=["x"] * S.MAX_STOP), vocab=VOCAB).sampling.stop == ["x"] * S.MAX_STOP
    refused(dict(messages=HI, stop=["x"] * (S.MAX_STOP + 1)), "stop", "invalid_value")
    ok = "y" * L.MAX_STOP_CHARS
    assert S.parse_chat(dict(messages=HI, stop=ok), vocab=VOCAB).sampling.stop == [ok]
    err = refused(dict(messages=HI, stop="y" * (L.MAX_STOP_CHARS + 1)), "stop", "invalid_value")
    assert str(L.MAX_STOP_CHARS) in err.message
    refused(dict(prompt="a", stop=["a", "z" * (L.MAX_STOP_CHARS + 1)]), "stop", "invalid_value", chat=False)


def test_logit_bias_entries() -> None:
    full = {str(i): 1.0 for i in range(L.MAX_LOGIT_BIAS)}
    assert len(S.parse_chat(dict(messages=HI, logit_bias=full), vocab=2 * L.MAX_LOGIT_BIAS).sampling.logit_bias) \
        == L.MAX_LOGIT_BIAS
    over = {str(i): 1.0 for i in range(L.MAX_LOGIT_BIAS + 1)}
    with pytest.raises(S.RequestError) as ei:
        S.parse_chat(dict(messages=HI, logit_bias=over), vocab=2 * L.MAX_LOGIT_BIAS)
    assert ei.value.status == 400 and ei.value.param == "logit_bias"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_cap(key: str) -> None:
    assert getattr(S.parse_chat({"messages": HI, key: L.MAX_TOKENS_CAP}, vocab=VOCAB).sampling, "max_tokens") \
        == L.MAX_TOKENS_CAP
    refused({"messages": HI, key: 10**30}, key, "invalid_value")


def test_n_bound() -> None:
    assert S.parse_chat(dict(messages=HI, n=S.MAX_N), vocab=VOCAB).n == S.MAX_N
    refused(dict(messages=HI, n=S.MAX_N + 1), "n", "invalid_value")
    refused(dict(prompt="a", n=10**9), "n", "invalid_value", chat=False)


def test_message_count() -> None:
    assert len(S.parse_chat(dict(messages=HI * L.MAX_MESSAGES), vocab=VOCAB).messages) == L.MAX_MESSAGES
    refused(dict(messages=HI * (L.MAX_MESSAGES + 1)), "messages", "invalid_value")


def tool(params: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_tool_count() -> None:
    tools = [tool({"type": "object"}, f"f{i}") for i in range(L.MAX_TOOLS + 1)]
    refused(dict(messages=HI, tools=tools), "tools", "invalid_value")
    assert len(S.parse_chat(dict(messages=HI, tools=tools[:-1]), vocab=VOCAB).tools) == L.MAX_TOOLS


def test_tool_schema_depth_and_size() -> None:
    # tools[i] is level 1, function 2, parameters 3: the schema itself may nest 30 more levels
    ok = tool(nested(L.MAX_SCHEMA_DEPTH - 2))
    assert S.parse_chat(dict(messages=HI, tools=[ok]), vocab=VOCAB).tools == [ok]
    refused(dict(messages=HI, tools=[tool(nested(L.MAX_SCHEMA_DEPTH - 1))]), "tools[0]", "schema_too_deep")
    refused(dict(messages=HI, tools=[tool(nested(900))]), "tools[0]", "schema_too_deep")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(L.MAX_SCHEMA_NODES)}}
    refused(dict(messages=HI, tools=[tool(wide)]), "tools[0]", "schema_too_large")


@pytest.mark.parametrize("key", ["response_format", "grammar", "tool_choice"])
def test_other_schema_objects_depth(key: str) -> None:
    refused({"messages": HI, key: {"type": "json_schema", "json_schema": {"schema": nested(200)}}}, key,
            "schema_too_deep")


def test_depth_walk_is_iterative() -> None:
    # A depth far past Python's recursion limit is measured without recursing (and stops early).
    obj: list = []
    for _ in range(100_000):
        obj = [obj]
    depth, nodes = L.depth_and_size(obj, 32, 10**6)
    assert depth == 33 and nodes == 33


# ----------------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("template, what", [
    ("{{ 'x' * 10**10 }}", "value over"),
    ("{{ [0] * 10**9 }}", "value over"),
    ("{{ 2 ** 100000 }}", "bits"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "string over"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "value over"),
    ("{{ 'x'.ljust(10**9) }}", "argument"),
    ("{{ 'x'|center(10**9) }}", "argument"),
    ("{{ messages|tojson(indent=10**9) }}", "argument"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "output over|rendering took over"),  # the time bound first on a loaded machine
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ cycler.__init__.__globals__.os }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_template_sandbox_bounds(template: str, what: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=what):
        render_chat(template, HI)
    assert time.monotonic() - t0 < 10.0  # the output case renders 1M loop turns on a loaded machine


def test_template_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nested loops that print nothing: only the deadline stops them.
    monkeypatch.setattr(SB, "RENDER_SECONDS", 0.3)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="took over 0.3 s"):
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", HI)
    assert time.monotonic() - t0 < 4.0  # the 0.3 s deadline plus a loaded machine's slack


def test_template_size_bound() -> None:
    with pytest.raises(ChatTemplateError, match="characters; the limit"):
        render_chat("x" * (SB.MAX_TEMPLATE_CHARS + 1), HI)


def test_real_template_renders_and_tracer_is_restored() -> None:
    import sys

    before = sys.gettrace()
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = render_chat(tpl, HI + [{"role": "assistant", "content": "yo " * 5}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo yo yo yo yo <|im_end|>\n" \
                  "<|im_start|>assistant\n"
    assert sys.gettrace() is before
