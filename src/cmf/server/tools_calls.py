"""Tool calls: the request's ``tools`` / ``tool_choice`` checked, the conversation prepared for the
chat template, the model's call syntax parsed back into OpenAI ``tool_calls``, and the grammar
that forces a valid call for ``tool_choice: "required"`` or a named function.

Syntaxes (picked from the chat template's text): ``hermes`` — ``<tool_call>{"name", "arguments"}
</tool_call>`` (Hermes, Qwen 2.5/3, and the fallback this module teaches templates that know no
tools); ``llama3`` — a bare ``{"name", "parameters"}`` object, optionally after ``<|python_tag|>``;
``mistral`` — ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import bad
from .structured import bounded, check_schema

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


@dataclass
class ToolSetup:
    """Validated ``tools`` (OpenAI shape) and ``tool_choice``: "none", "auto", "required", or a name."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    named: str | None = None  # the forced function's name, when tool_choice names one
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters schema

    @property
    def forced(self) -> bool:
        return self.choice == "required" or self.named is not None


def parse_tools(tools: Any, tool_choice: Any) -> ToolSetup | None:
    """Check ``tools`` and ``tool_choice`` (400 naming the field); None when no tool applies."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of objects", "tools", "invalid_type")
    out: list[dict[str, Any]] = []
    params: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise bad(f"'{p}' must be {{\"type\": \"function\", \"function\": {{...}}}}", p, "invalid_type")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise bad(f"'{p}.function.name' must be 1-64 letters, digits, '_', '.' or '-'", f"{p}.function.name",
                      "invalid_value")
        if name in params:
            raise bad(f"'{p}.function.name' {name!r} is given twice", f"{p}.function.name", "invalid_value")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"'{p}.function.description' must be a string", f"{p}.function.description", "invalid_type")
        schema = fn.get("parameters", EMPTY_PARAMS)
        if not isinstance(schema, dict):
            raise bad(f"'{p}.function.parameters' must be a JSON schema object", f"{p}.function.parameters",
                      "invalid_type")
        check_schema(schema, f"{p}.function.parameters")
        params[name] = schema
        out.append({"type": "function", "function": {k: v for k, v in fn.items()
                                                      if k in ("name", "description", "parameters", "strict")}})
    setup = ToolSetup(out, params=params)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        setup.choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in params:
            raise bad(f"'tool_choice' names {str(name)[:64]!r}, which is not in 'tools'", "tool_choice.function.name",
                      "invalid_value")
        setup.choice, setup.named = "named", name
    else:
        raise bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}",
                  "tool_choice", "invalid_value")
    return setup


# ----------------------------------------------------------------------------------- the template


def syntax_of(template: str | None) -> str:
    """The call syntax a chat template uses (hermes when it shows none: the fallback's)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "hermes"


def knows_tools(template: str | None) -> bool:
    """Whether the template renders ``tools`` itself (else this module describes them)."""
    return bool(template) and "tools" in template  # type: ignore[operator]


def _args_obj(args: Any) -> Any:
    """A call's arguments as an object (templates expect one; OpenAI sends a JSON string)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def prepare(messages: list[dict[str, Any]], setup: ToolSetup | None, template: str | None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template. A template that knows tools gets them as they are (call
    arguments as objects); one that does not gets a system text describing them in the Hermes
    syntax, earlier calls as ``<tool_call>`` text and results as ``<tool_response>`` text."""
    native = knows_tools(template)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            calls = [c.get("function", c) for c in calls if isinstance(c, dict)]
            if native:
                m["tool_calls"] = [{"type": "function", "function": {"name": c.get("name"),
                                                                     "arguments": _args_obj(c.get("arguments"))},
                                    **{k: v for k, v in c.items() if k == "id"}} for c in calls]
            else:
                blocks = "".join("<tool_call>\n" + json.dumps({"name": c.get("name"),
                                                                "arguments": _args_obj(c.get("arguments"))})
                                 + "\n</tool_call>" for c in calls)
                m["content"] = (m.get("content") or "") + blocks
                m.pop("tool_calls")
        if m["role"] == "tool" and not native:
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if setup is None:
        return out, None
    if native:
        return out, setup.tools
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in setup.tools)
    text = ("You may call one or more functions to answer. The functions, one JSON object a line:\n<tools>\n"
            f"{listing}\n</tools>\nTo call a function, answer with one block per call:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


# ----------------------------------------------------------------------------------- forced calls


def _call_schema(setup: ToolSetup, syntax: str) -> dict[str, Any]:
    names = [setup.named] if setup.named else list(setup.params)
    key = "parameters" if syntax == "llama3" else "arguments"
    alts = [{"type": "object", "properties": {"name": {"const": n}, key: bounded(setup.params[n])},
             "required": ["name", key], "additionalProperties": False} for n in names]
    out = alts[0] if len(alts) == 1 else {"anyOf": alts}
    # llguidance's option: no free whitespace (a small model could fill its budget with blanks)
    return {**out, "x-guidance": {"whitespace_flexible": False}}


def call_grammar(setup: ToolSetup, syntax: str, special: Callable[[str], int | None]) -> str:
    """A Lark grammar (llguidance's, with ``%json``) of exactly one call in ``syntax`` whose
    arguments match the function's schema. ``special(text)``: the id of a marker that is one
    token in this vocabulary (referenced as ``<[id]>``, the text could not spell it)."""
    schema = json.dumps(_call_schema(setup, syntax))

    def lit(text: str) -> str:
        tid = special(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    if syntax == "mistral":
        return f'start: {lit("[TOOL_CALLS]")} "[" call "]"\ncall: %json {schema}\n'
    if syntax == "llama3":
        return f"start: call\ncall: %json {schema}\n"
    return f'start: {lit("<tool_call>")} "\\n" call "\\n" {lit("</tool_call>")}\ncall: %json {schema}\n'


# ----------------------------------------------------------------------------------- parsing


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` is always a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return new_call(obj["name"], args)
    return None


_DEC = json.JSONDecoder()


def _json_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of ``text`` (separated by blanks, ';' or ','), and what follows."""
    vals: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text) or text[i] not in "{[":
            return vals, text[i:]
        try:
            v, i = _DEC.raw_decode(text, i)
        except ValueError:
            return vals, text[i:]
        vals.append(v)


def parse_calls(text: str, syntax: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of an answer; text that holds no well-formed call stays content."""
    if syntax == "hermes":
        calls: list[dict[str, Any]] = []
        parts: list[str] = []
        pos = 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            vals, _ = _json_values(m.group(1))
            got = [c for c in map(_as_call, vals) if c]
            if got:
                parts.append(text[pos:m.start()])
                calls += got
                pos = m.end()
        parts.append(text[pos:])
        return ("".join(parts).strip() if calls else text), calls
    body = text.lstrip()
    marker = MARKERS[syntax]
    lead = ""
    if marker in body:
        lead, body = body.split(marker, 1)
    elif syntax == "mistral" and not body.startswith("["):
        return text, []
    vals, rest = _json_values(body)
    flat = [x for v in vals for x in (v if isinstance(v, list) else [v])]
    calls = [c for c in map(_as_call, flat) if c]
    if not calls:
        return text, []
    return (lead + rest).strip(), calls


# A call's opening in any syntax, up to where its arguments' JSON begins (name first, as the
# templates and the forced grammar write it).
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class CallStream:
    """Streams an answer's content while holding back what may be a tool call. Once a call opens,
    its id and name go out, then its arguments as they come (OpenAI's ``delta.tool_calls``):
    :meth:`feed` returns ``(content, call deltas)`` safe to send now, :meth:`finish` the rest of
    the content and the deltas of calls the incremental reading missed (parsed whole)."""

    def __init__(self, syntax: str, forced: bool) -> None:
        self.syntax = syntax
        self.marker = MARKERS[syntax]
        self.held = ""
        self.in_call = forced
        self.started = False  # any non-blank text seen
        self.pos = 0  # how far into `held` the calls have been read
        self.open: dict[str, Any] | None = None  # the call whose arguments are streaming
        self.depth = 0
        self.in_str = self.esc = False
        self.count = 0  # calls opened so far (their indexes)
        self.complete = 0  # calls whose arguments closed

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        if self.in_call:
            return "", self._calls()
        if not self.started:
            lead = self.held.lstrip()
            if not lead:
                return "", []
            self.started = True
            # Llama 3 and Mistral (whose marker may be a skipped special token) open a call bare.
            if self.syntax in ("llama3", "mistral") and lead[0] in "{[":
                self.in_call = True
                return "", self._calls()
        at = self.held.find(self.marker)
        if at >= 0:
            out, self.held = self.held[:at], self.held[at:]
            self.in_call = True
            return out, self._calls()
        # keep a tail that could be the marker's beginning
        keep = next((k for k in range(min(len(self.marker) - 1, len(self.held)), 0, -1)
                     if self.marker.startswith(self.held[-k:])), 0)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out, []

    def _calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.open is None:
                m = _HEAD.search(self.held, self.pos)
                if m is None:
                    return out
                self.open = new_call(json.loads(f'"{m.group(1)}"'), "")
                out.append({"index": self.count, **self.open})
                self.count += 1
                self.pos = m.end()
                self.depth, self.in_str, self.esc = 0, False, False
            start = self.pos
            done = False
            for j in range(start, len(self.held)):  # the arguments' JSON, read to its closing brace
                ch = self.held[j]
                if self.in_str:
                    if self.esc:
                        self.esc = False
                    elif ch == "\\":
                        self.esc = True
                    elif ch == '"':
                        self.in_str = False
                    continue
                if ch == '"':
                    self.in_str = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        self.pos, done = j + 1, True
                        break
            else:
                self.pos = len(self.held)
            piece = self.held[start:self.pos]
            if piece:
                out.append({"index": self.count - 1, "function": {"arguments": piece}})
            if not done:
                return out
            self.open = None
            self.complete += 1

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_calls(self.held, self.syntax)
        self.held = ""
        if self.count:  # streamed already: only what the incremental reading did not see
            return ("" if calls else content), [{"index": self.count + k, **c}
                                                for k, c in enumerate(calls[self.count:])]
        return content, [{"index": k, **c} for k, c in enumerate(calls)]
