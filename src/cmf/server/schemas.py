"""OpenAI request validation, as pure functions (no model, no HTTP).

Requests are checked field by field before anything is queued: a wrong type, an out-of-range
value or an unsupported option raises :class:`RequestError`, which carries the HTTP status and the
OpenAI error fields (``message``, ``type``, ``param``, ``code``). Unknown fields are ignored, as
OpenAI-compatible servers do, except the few whose silent omission would change the answer
(``best_of`` > 1, ``suffix``): those are refused. ``tools``,
``tool_choice``, ``response_format`` and ``grammar`` are checked by ``tools_calls`` and
``structured`` (the chat request keeps the raw body for them).

The errors are :mod:`.errors`'s; the response shapes :mod:`.responses`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import RequestError, bad, error_body, error_type  # noqa: F401 - the request errors, re-exported
from .limits import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_TOKENS_CAP, check_chat_bounds

# OpenAI's own limits, kept so that a request valid here is valid there.
MAX_STOP = 16  # OpenAI allows 4; llama.cpp-style clients send more, each costs one find() per token
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_N = 16  # choices per request: each is one sequence of the batch
ROLES = ("system", "developer", "user", "assistant", "tool")

_UNSET: Any = ...  # a field that was absent (``null`` is a value: "the backbone", "the default task")


# ----------------------------------------------------------------------------------- field checks


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: Mapping[str, Any], key: str, *, lo: int | None = None, hi: int | None = None,
         default: Any = None, param: str | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    p = param or key
    # JSON has one number type: 5.0 is accepted as 5, True is not (bool is an int in Python).
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{p}' must be an integer, got {_type_name(v)}", p, "invalid_type")
    if lo is not None and v < lo:
        raise bad(f"'{p}' must be >= {lo}, got {v}", p, "invalid_value")
    if hi is not None and v > hi:
        raise bad(f"'{p}' must be <= {hi}, got {v}", p, "invalid_value")
    return v


def _num(body: Mapping[str, Any], key: str, *, lo: float | None = None, hi: float | None = None,
         default: Any = None, lo_open: bool = False, param: str | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    p = param or key
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{p}' must be a number, got {_type_name(v)}", p, "invalid_type")
    v = float(v)
    if not math.isfinite(v):
        raise bad(f"'{p}' must be a finite number", p, "invalid_value")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{p}' must be {'>' if lo_open else '>='} {lo:g}, got {v:g}", p, "invalid_value")
    if hi is not None and v > hi:
        raise bad(f"'{p}' must be <= {hi:g}, got {v:g}", p, "invalid_value")
    return v


def _bool(body: Mapping[str, Any], key: str, default: bool = False, param: str | None = None) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        p = param or key
        raise bad(f"'{p}' must be a boolean, got {_type_name(v)}", p, "invalid_type")
    return v


def _str(body: Mapping[str, Any], key: str, default: Any = None, param: str | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        p = param or key
        raise bad(f"'{p}' must be a string, got {_type_name(v)}", p, "invalid_type")
    return v


def _obj(body: Mapping[str, Any], key: str, param: str | None = None) -> dict[str, Any] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        p = param or key
        raise bad(f"'{p}' must be an object, got {_type_name(v)}", p, "invalid_type")
    return v


# ----------------------------------------------------------------------------------- requests


@dataclass
class Selection:
    """The request's ``cmf`` object: which task mask, skill or blend runs it (``...`` = server default)."""

    task: Any = _UNSET
    skill: Any = _UNSET
    blend: dict[str, float] | str | None = None  # {skill id or "none": weight}, or "auto"


@dataclass
class Sampling:
    """Decoding options shared by chat and completions (``max_tokens`` None: up to the context)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``cmf.runtime.generate.stream_generate`` (without max_tokens)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias or None, seed=self.seed,
                    stop=self.stop or None, ignore_eos=self.ignore_eos)


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    model: str | None
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None
    thinking: bool | None = None
    selection: Selection = field(default_factory=Selection)
    n: int = 1
    raw: dict[str, Any] = field(default_factory=dict)  # the body: tools, tool_choice, response_format, grammar


def replace_seed(s: Sampling, seed: int) -> Sampling:
    """``s`` with another seed (the later choices of an ``n`` > 1 request)."""
    import dataclasses

    return dataclasses.replace(s, seed=seed)


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body; ``prompt`` is text or token ids."""

    model: str | None
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    selection: Selection = field(default_factory=Selection)
    n: int = 1


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad(f"'stop' may hold at most {MAX_STOP} sequences, got {len(v)}", "stop", "invalid_value")
    for i, s in enumerate(v):
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"'stop[{i}]' is {len(s)} characters; at most {MAX_STOP_CHARS}", "stop", "invalid_value")
    return [s for s in v if s]


def _logit_bias(body: Mapping[str, Any], vocab: int) -> dict[int, float]:
    v = _obj(body, "logit_bias")
    if not v:
        return {}
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}", "logit_bias",
                  "invalid_value")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {k[:40]!r}", "logit_bias", "invalid_value") from None
        if not 0 <= tid < vocab:
            raise bad(f"'logit_bias' token id {tid} is outside the vocabulary [0, {vocab})", "logit_bias",
                      "invalid_value")
        out[tid] = _num(v, k, lo=-100.0, hi=100.0, param=f"logit_bias.{tid}")
    return out


def _sampling(body: Mapping[str, Any], vocab: int, *, chat: bool) -> Sampling:
    _int(body, "n", lo=1, hi=MAX_N, default=1)  # the request's own field (ChatRequest.n, CompletionRequest.n)
    best_of = _int(body, "best_of", default=1)
    if best_of != 1:
        raise bad(f"only best_of=1 is supported, got {best_of}", "best_of", "unsupported_value")
    max_tokens = _int(body, "max_tokens", lo=1, hi=MAX_TOKENS_CAP)
    if chat:
        mct = _int(body, "max_completion_tokens", lo=1, hi=MAX_TOKENS_CAP)
        if mct is not None:  # the newer name wins, as in OpenAI's API
            max_tokens = mct
    rp = _num(body, "repeat_penalty", lo=0.0, lo_open=True)
    if rp is None:
        rp = _num(body, "repetition_penalty", lo=0.0, lo_open=True)
    seed = _int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", lo=0.0, hi=2.0, default=1.0),
        top_p=_num(body, "top_p", lo=0.0, hi=1.0, default=1.0),
        top_k=_int(body, "top_k", lo=0, default=0),
        min_p=_num(body, "min_p", lo=0.0, hi=1.0, default=0.0),
        repetition_penalty=rp,
        presence_penalty=_num(body, "presence_penalty", lo=-2.0, hi=2.0, default=0.0),
        frequency_penalty=_num(body, "frequency_penalty", lo=-2.0, hi=2.0, default=0.0),
        logit_bias=_logit_bias(body, vocab),
        # The sampler's generator takes a non-negative seed; OpenAI's is a signed 64-bit integer.
        seed=None if seed is None else seed % 2**64,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = _obj(body, "stream_options")
    include = _bool(opts, "include_usage", param="stream_options.include_usage") if opts else False
    return stream, include and stream


def _selection(body: Mapping[str, Any]) -> Selection:
    c = _obj(body, "cmf")
    if c is None:
        return Selection()
    sel = Selection()
    for key in ("task", "skill"):
        if key in c:
            v = c[key]
            if v is not None and not isinstance(v, str):
                raise bad(f"'cmf.{key}' must be a string or null, got {_type_name(v)}", f"cmf.{key}", "invalid_type")
            setattr(sel, key, v)
    if c.get("blend") == "auto":
        sel.blend = "auto"
        return sel
    blend = _obj(c, "blend", param="cmf.blend")
    if blend is not None:
        weights = {str(k): _num(blend, k, lo=0.0, default=0.0, param=f"cmf.blend.{k}") for k in blend}
        if not weights or sum(weights.values()) <= 0:
            raise bad("'cmf.blend' must give a positive weight to at least one skill", "cmf.blend", "invalid_value")
        sel.blend = weights
    return sel


def _message(i: int, m: Any) -> dict[str, Any]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{p}' must be an object, got {_type_name(m)}", p, "invalid_type")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad(f"'{p}.role' must be a string", f"{p}.role", "invalid_type")
    if role not in ROLES:
        raise bad(f"'{p}.role' must be one of {', '.join(ROLES)}; got {role[:40]!r}", f"{p}.role", "invalid_value")
    content = m.get("content")
    if content is None:
        if role != "assistant":  # an assistant turn may carry only tool_calls
            raise bad(f"'{p}.content' is required for role {role!r}", f"{p}.content", "missing_field")
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pp = f"{p}.content[{j}]"
            if not isinstance(part, dict):
                raise bad(f"'{pp}' must be an object, got {_type_name(part)}", pp, "invalid_type")
            kind = part.get("type")
            if kind != "text":
                raise bad(f"'{pp}.type' {str(kind)[:40]!r} is not supported: only text parts", f"{pp}.type",
                          "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise bad(f"'{pp}.text' must be a string", f"{pp}.text", "invalid_type")
            parts.append(part["text"])
        text = "".join(parts)  # as cmf.runtime.chat.message_text joins text parts
    else:
        raise bad(f"'{p}.content' must be a string or an array of text parts, got {_type_name(content)}",
                  f"{p}.content", "invalid_type")
    # Templates know "system"; OpenAI's newer "developer" role means the same to a local model.
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if isinstance(m.get("tool_calls"), list):
        out["tool_calls"] = m["tool_calls"]
    return out


def parse_chat(body: Any, *, vocab: int) -> ChatRequest:
    """Validate a chat completions body; raises RequestError naming the offending field."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
    model = _str(body, "model")
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages", "missing_field")
    if not isinstance(msgs, list):
        raise bad(f"'messages' must be an array, got {_type_name(msgs)}", "messages", "invalid_type")
    if not msgs:
        raise bad("'messages' must hold at least one message", "messages", "invalid_value")
    check_chat_bounds(body)
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS, default=0)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be an array of objects", "tools", "invalid_type")
    _obj(body, "response_format")  # its content: cmf.server.structured
    thinking = None
    ctk = _obj(body, "chat_template_kwargs")  # vLLM's spelling, which many clients already send
    if ctk is not None and "enable_thinking" in ctk:
        thinking = _bool(ctk, "enable_thinking", param="chat_template_kwargs.enable_thinking")
    c = _obj(body, "cmf")
    if c is not None and "thinking" in c:
        thinking = _bool(c, "thinking", param="cmf.thinking")
    stream, include_usage = _stream(body)
    return ChatRequest(model=model, messages=messages, sampling=_sampling(body, vocab, chat=True), stream=stream,
                       include_usage=include_usage, logprobs=logprobs, top_logprobs=top, tools=tools or None,
                       thinking=thinking, selection=_selection(body),
                       n=_int(body, "n", lo=1, hi=MAX_N, default=1), raw=body)


def _prompt(body: Mapping[str, Any], vocab: int) -> str | list[int]:
    v = body.get("prompt")
    if v is None:
        raise bad("'prompt' is required", "prompt", "missing_field")
    # A batch of one prompt ([text] or [[ids]]) is a single prompt; a larger batch would be n > 1.
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad("'prompt' must not be empty", "prompt", "invalid_value")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        bad_ids = [t for t in v if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"'prompt' token id {bad_ids[0]} is outside the vocabulary [0, {vocab})", "prompt",
                      "invalid_value")
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(t, (str, list)) for t in v):
        raise bad(f"one prompt per request is supported, got a batch of {len(v)}", "prompt", "unsupported_value")
    raise bad("'prompt' must be a string or an array of token ids", "prompt", "invalid_type")


def parse_completion(body: Any, *, vocab: int) -> CompletionRequest:
    """Validate a (legacy) completions body; raises RequestError naming the offending field."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
    model = _str(body, "model")
    prompt = _prompt(body, vocab)
    if body.get("suffix"):
        raise bad("'suffix' (fill-in-the-middle) is not supported", "suffix", "unsupported_value")
    stream, include_usage = _stream(body)
    return CompletionRequest(model=model, prompt=prompt, sampling=_sampling(body, vocab, chat=False), stream=stream,
                             include_usage=include_usage,
                             logprobs=_int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS),
                             echo=_bool(body, "echo"), selection=_selection(body),
                             n=_int(body, "n", lo=1, hi=MAX_N, default=1))


@dataclass
class TokenizeRequest:
    """A validated ``POST /v1/tokenize`` body: a chat body (``messages``) or a completion body
    (``prompt``), parsed as its own route would parse it, so that the count is the route's."""

    request: ChatRequest | CompletionRequest
    return_ids: bool = False


def parse_tokenize(body: Any, *, vocab: int) -> TokenizeRequest:
    """Validate a tokenize body: with ``messages`` a chat body, else with ``prompt`` a completion body."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
    if "messages" not in body and "prompt" in body:
        req: ChatRequest | CompletionRequest = parse_completion(body, vocab=vocab)
    else:
        req = parse_chat(body, vocab=vocab)
    return TokenizeRequest(req, _bool(body, "return_ids"))
