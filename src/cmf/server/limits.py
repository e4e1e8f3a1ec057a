"""Resource bounds of a request body, checked before any field is used to allocate or loop.

The body itself is capped (``--max-body``, 413) and its JSON nesting by the parser; these bounds
hold the parts whose cost grows faster than their bytes: stop strings are searched for after
every token, logit_bias entries are applied to every step's logits, and tool / response-format
schemas are walked recursively (jsonschema's meta-schema check, the integer bounding in
``structured.bounded``, llguidance's compiler) so a deep one would end in a RecursionError (a 500)
or a slow compile. Each breach is a 400 naming the field, in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from .errors import bad

MAX_STOP_CHARS = 1024  # one stop string; each is searched for in the tail of the text after every token
MAX_LOGIT_BIAS = 1024  # entries: each is applied to every step's logits
MAX_MESSAGES = 10_000  # chat turns; each is rendered by the template
MAX_TOOLS = 128  # tool definitions in one request
MAX_SCHEMA_DEPTH = 32  # nesting of a tool's parameters, a response_format schema or a grammar object
MAX_SCHEMA_NODES = 20_000  # objects, arrays and values in one such schema
MAX_TOKENS_CAP = 1 << 24  # max_tokens: far above any context, far below a C integer's limits


def depth_and_size(obj: Any, max_depth: int, max_nodes: int) -> tuple[int, int]:
    """Nesting depth (objects and arrays; a scalar adds no level) and value count of a JSON value,
    iteratively (a recursive walk is what a hostile depth would break); stops early once either
    bound is passed."""
    deepest, nodes = 0, 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        nodes += 1
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > max_depth:
                break
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
        if nodes > max_nodes:
            break
    return deepest, nodes


def check_schema_bounds(obj: Any, param: str) -> None:
    """400 when ``obj`` (a schema or grammar object) nests deeper than MAX_SCHEMA_DEPTH or holds
    more than MAX_SCHEMA_NODES values."""
    depth, nodes = depth_and_size(obj, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad(f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels", param, "schema_too_deep")
    if nodes > MAX_SCHEMA_NODES:
        raise bad(f"'{param}' holds more than {MAX_SCHEMA_NODES} values", param, "schema_too_large")


def check_chat_bounds(body: dict[str, Any]) -> None:
    """The chat-only bounds: message count, tool count, tool / response_format / grammar schemas."""
    msgs = body.get("messages")
    if isinstance(msgs, list) and len(msgs) > MAX_MESSAGES:
        raise bad(f"'messages' may hold at most {MAX_MESSAGES} messages, got {len(msgs)}", "messages",
                  "invalid_value")
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > MAX_TOOLS:
            raise bad(f"'tools' may hold at most {MAX_TOOLS} definitions, got {len(tools)}", "tools",
                      "invalid_value")
        for i, t in enumerate(tools):
            check_schema_bounds(t, f"tools[{i}]")
    for key in ("response_format", "grammar", "tool_choice"):
        if body.get(key) is not None:
            check_schema_bounds(body[key], key)
