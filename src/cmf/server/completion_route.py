"""``POST /v1/completions`` with ``n`` > 1: one job per choice, as chat_route does for chat (the
n = 1 path stays app.py's)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import responses as O
from . import schemas as S
from .chat_route import Choice, Jobs, _events, _total, collect
from .jobs import Delta, Finished, Job
from .plumbing import Channel, SSEResponse, sse

if TYPE_CHECKING:
    from .app import _Api


async def many(api: "_Api", request: Request, req: S.CompletionRequest, ids: list[int], echo: str, sel: tuple,
               max_tokens: int) -> Response:
    """The n choices of one completion request, whole or streamed."""
    task, skill, blend = sel
    chan = Channel()
    want_lp = req.logprobs is not None
    jobs = Jobs()
    for i in range(req.n):
        sampling = req.sampling
        if i and sampling.seed is not None:  # reproducible yet distinct choices
            sampling = S.replace_seed(sampling, (sampling.seed + i) % 2**64)
        jobs.append(Job(ids, sampling, max_tokens, (lambda ev, i=i: chan.put((i, ev))), logprobs=want_lp,
                        top_logprobs=req.logprobs or 0, task=task, skill=skill, blend=blend,
                        route_prompt=req.prompt))
    for j in jobs:
        api._submit(j)
    choices = [Choice(i) for i in range(req.n)]
    rid, created = O.new_id("cmpl"), O.now()
    if req.stream:
        return SSEResponse(_stream(api, request, req, chan, choices, echo, rid, created), jobs)

    fins = await collect(request, chan, choices, jobs)
    if fins is None:
        return Response(status_code=499)
    fin = _total(fins)
    api._log_usage(request, fin)
    body = O.text_completion(rid, created, api.model_id, "", None, prompt_tokens=fin.prompt_tokens,
                             completion_tokens=fin.completion_tokens, extra=api._extra(fins[0]),
                             cached_tokens=fin.cached_tokens)
    body["choices"] = [{"index": c.index, "text": echo + "".join(c.text),
                        "logprobs": O.completion_logprobs(c.logprobs, len(echo)) if want_lp else None,
                        "finish_reason": c.fin.finish_reason} for c in choices]
    return JSONResponse(body)


async def _stream(api: "_Api", request: Request, req: S.CompletionRequest, chan: Channel, choices: list[Choice],
                  echo: str, rid: str, created: int) -> AsyncIterator[str]:
    want_lp = req.logprobs is not None
    offsets = [len(echo)] * len(choices)

    def mk(i: int, text: str, reason: str | None, **kw: Any) -> str:
        chunk = O.text_completion(rid, created, api.model_id, text, reason, chunk=True, **kw)
        chunk["choices"][0]["index"] = i
        return sse(chunk)

    if echo:
        yield "".join(mk(c.index, echo, None) for c in choices)
    try:
        async for evs in _events(chan, choices):
            frames: list[str] = []
            for i, ev in evs:
                if isinstance(ev, Delta):
                    lp = O.completion_logprobs(ev.logprobs, offsets[i]) if want_lp else None
                    offsets[i] += len(ev.text)
                    frames.append(mk(i, ev.text, None, logprobs=lp))
                elif isinstance(ev, Finished):
                    if ev.finish_reason == "cancelled":
                        frames.append(sse(S.error_body("the server is shutting down", type="server_error",
                                                       code="unavailable")))
                        yield "".join(frames)
                        return
                    frames.append(mk(i, "", ev.finish_reason, extra=api._extra(ev)))
            if frames:
                yield "".join(frames)
    except Exception:  # noqa: BLE001 - the engine failed a job (logged there)
        yield sse(S.error_body("internal error while generating; see the server log", type="server_error",
                               code="internal_error"))
        return
    fin = _total([c.fin for c in choices])
    api._log_usage(request, fin)
    tail = []
    if req.include_usage:
        tail.append(sse({"id": rid, "object": "text_completion", "created": created, "model": api.model_id,
                         "choices": [], "usage": O.usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)}))
    tail.append("data: [DONE]\n\n")
    yield "".join(tail)
