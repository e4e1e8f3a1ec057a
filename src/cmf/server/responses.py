"""OpenAI response shapes, as pure functions: ``chat.completion``, ``chat.completion.chunk``,
``text_completion``, ``model``/``list``, ``tokenize``, usage and logprobs, so they live in one file."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

@dataclass
class TokenLogprob:
    """One generated token with its log probability and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``chatcmpl-…`` / ``cmpl-…``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came
    from the prefix cache (OpenAI's field for its prompt caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion (or chunk)."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters of text before the first token."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, lp, _ in e.top} for e in entries], "text_offset": offsets}


def chat_completion(id: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, logprobs: list[TokenLogprob] | None = None,
                    extra: dict[str, Any] | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    """A ``chat.completion`` object (one choice)."""
    out: dict[str, Any] = {
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "system_fingerprint": None}
    if extra:
        out["cmf"] = extra
    return out


def chat_chunk(id: str, created: int, model: str, delta: dict[str, Any] | None, *, finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None, usage_obj: dict[str, int] | None = None,
               with_usage_field: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta=None`` gives the usage-only chunk (``choices: []``)."""
    out: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None, "choices": []}
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta,
                           "logprobs": chat_logprobs(logprobs) if logprobs else None,
                           "finish_reason": finish_reason}]
    if with_usage_field or usage_obj is not None:  # OpenAI sends "usage": null on every chunk when asked
        out["usage"] = usage_obj
    if extra:
        out["cmf"] = extra
    return out


def text_completion(id: str, created: int, model: str, text: str, finish_reason: str | None, *,
                    prompt_tokens: int | None = None, completion_tokens: int | None = None,
                    logprobs: dict[str, Any] | None = None, chunk: bool = False,
                    extra: dict[str, Any] | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    """A ``text_completion`` object (or one streamed chunk of it, which carries no usage)."""
    out: dict[str, Any] = {"id": id, "object": "text_completion", "created": created, "model": model,
                           "system_fingerprint": None,
                           "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]}
    if not chunk and prompt_tokens is not None and completion_tokens is not None:
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    if extra:
        out["cmf"] = extra
    return out


class ContentFrames:
    """The SSE frame of a plain content delta (no logprobs) as a string template: the same bytes
    as ``_sse(chat_chunk(...))`` — key order, separators, escaping — without building and dumping
    a dict per token."""

    def __init__(self, id: str, created: int, model: str, *, with_usage_field: bool) -> None:
        head = json.dumps({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None}, ensure_ascii=False, separators=(",", ":"))
        self.head = "data: " + head[:-1] + ',"choices":[{"index":0,"delta":{"content":'
        self.tail = '},"logprobs":null,"finish_reason":null}]' + (',"usage":null' if with_usage_field else "") + "}\n\n"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


def model_card(model_id: str, created: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``model`` object of ``/v1/models``; ``extra`` goes under the ``cmf`` key."""
    out: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "cmf"}
    if extra:
        out["cmf"] = extra
    return out


def tokenize_result(model_id: str, ids: list[int], ctx_size: int, *, return_ids: bool = False) -> dict[str, Any]:
    """The ``tokenize`` object: the prompt's token count against the context, and what is left
    for ``max_tokens`` (0 when the prompt leaves no token to generate)."""
    n = len(ids)
    out: dict[str, Any] = {"object": "tokenize", "model": model_id, "prompt_tokens": n, "ctx_size": ctx_size,
                           "max_tokens": max(ctx_size - n, 0)}
    if return_ids:
        out["ids"] = list(ids)
    return out
