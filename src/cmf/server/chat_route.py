"""``POST /v1/chat/completions`` with the API features: tool calls, structured output (a token
mask per job), reasoning split into ``reasoning_content``, and ``n`` choices (one job each).

The route handler lives here rather than in app.py so the features stay in one place; app.py's
``_Api`` hands it the request and its helpers (selection, budget, submission).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import reasoning as R
from . import responses as O
from . import schemas as S
from . import structured as G
from . import tools_calls as T
from .jobs import Delta, Failed, Finished, Job, JobFailed
from .plumbing import Channel, SSEResponse, sse

if TYPE_CHECKING:  # app imports this module: no cycle at run time
    from .app import _Api

log = logging.getLogger(__name__)


class Jobs(list):
    """The jobs of one request (one per choice); cancelling cancels them all."""

    def cancel(self) -> None:
        for j in self:
            j.cancel()


@dataclass
class Plan:
    """What a chat request runs: prompt ids, the constraint, tools and the template's habits."""

    ids: list[int]
    constraint: G.Constraint | None = None
    tools: T.ToolSetup | None = None
    syntax: str = "hermes"
    thinks: bool = False
    opened: bool = False  # the prompt left a think block open


@dataclass
class Choice:
    """One choice's streaming state."""

    index: int
    reason: R.ReasoningStream | None = None
    calls: T.CallStream | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    fin: Finished | None = None


def _template(api: "_Api") -> str | None:
    bundle = api.model.file.chat_config
    return bundle.chat_template if bundle is not None else None


async def plan(api: "_Api", req: S.ChatRequest) -> Plan:
    """Tools and constraint checked (400s), the conversation through the template."""
    from ..runtime.generate import prompt_ids_for

    raw = req.raw
    template = _template(api)
    setup = T.parse_tools(raw.get("tools"), raw.get("tool_choice"))
    if setup is not None and setup.choice == "none":
        setup_for_parse = None
    else:
        setup_for_parse = setup
    syntax = T.syntax_of(template)
    constraint = None
    if setup is not None and setup.forced:
        tok = api.engine.tokenizer

        def special(text: str) -> int | None:
            # a marker that is one added token (Qwen's <tool_call>, Mistral's [TOOL_CALLS]): the
            # grammar names that token, which llguidance would not let plain text spell
            tid = tok.token_to_id(text)
            return tid if tid is not None and tok.encode(text, add_special_tokens=False) == [tid] else None

        constraint = G.Constraint(G.lark_grammar(T.call_grammar(setup, syntax, special), "tools"), "tools")
    else:
        constraint = G.response_format(raw.get("response_format")) or G.grammar_param(raw.get("grammar"))
    messages, tools = T.prepare(req.messages, setup, template)
    ids = await run_in_threadpool(prompt_ids_for, api.model, messages, tools=tools, thinking=req.thinking)
    thinks = R.thinks(template)
    opened = thinks and R.opened(api.engine.tokenizer.decode(ids[-8:], skip_special_tokens=False))
    return Plan(ids, constraint, setup_for_parse, syntax, thinks, opened)


def _jobs(api: "_Api", req: S.ChatRequest, p: Plan, sel: tuple, max_tokens: int, chan: Channel) -> Jobs:
    task, skill, blend = sel
    out = Jobs()
    grammars = api.grammars
    for i in range(req.n):
        sampling = req.sampling
        if i and sampling.seed is not None:  # reproducible yet distinct choices
            sampling = S.replace_seed(sampling, (sampling.seed + i) % 2**64)
        mask = grammars.mask(p.constraint) if p.constraint is not None else None
        out.append(Job(p.ids, sampling, max_tokens, (lambda ev, i=i: chan.put((i, ev))), logprobs=req.logprobs,
                       top_logprobs=req.top_logprobs, task=task, skill=skill, blend=blend,
                       route_prompt=req.messages, token_mask=mask))
    return out


def _message(p: Plan, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole answer, and whether it holds tool calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if p.thinks:
        reasoning, text = R.split(("<think>" if p.opened else "") + text)
        msg["content"] = text
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
    if p.tools is not None:
        content, calls = T.parse_calls(msg["content"], p.syntax)
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = calls
            return msg, True
    return msg, False


async def chat(api: "_Api", request: Request) -> Response:
    """The chat completions route (see the module docstring)."""
    from .plumbing import read_json

    body = await read_json(request, api.max_body)
    req = S.parse_chat(body, vocab=api.vocab)
    api._check_model(req.model)
    sel = api._selection(req.selection)
    p = await plan(api, req)
    max_tokens = api._budget(len(p.ids), req.sampling.max_tokens, "messages")
    if p.constraint is not None:  # the first one builds llguidance's tokenizer (seconds for a large vocab)
        await run_in_threadpool(api.grammars.lltokenizer)
    chan = Channel()
    jobs = _jobs(api, req, p, sel, max_tokens, chan)
    for j in jobs:
        api._submit(j)
    choices = [Choice(i) for i in range(req.n)]
    rid, created = O.new_id("chatcmpl"), O.now()
    if not req.stream:
        return await _whole(api, request, req, p, jobs, chan, choices, rid, created)
    return SSEResponse(_stream(api, request, req, p, chan, choices, rid, created), jobs)


async def _events(chan: Channel, choices: list[Choice]) -> AsyncIterator[list[tuple[int, Any]]]:
    while any(c.fin is None for c in choices):
        evs = await chan.get()
        for i, ev in evs:
            if isinstance(ev, Finished):
                choices[i].fin = ev
            elif isinstance(ev, Failed):
                if isinstance(ev.error, S.RequestError):  # the engine stopped for a writer (lease.py)
                    raise ev.error
                raise JobFailed()
        yield evs


async def collect(request: Request, chan: Channel, choices: list[Choice], jobs: Jobs) -> list[Finished] | None:
    """Gather every choice's text and logprobs of a non-streamed request; None when the client
    went away first (its jobs are cancelled), else the choices' Finished events."""
    async def run() -> None:
        async for evs in _events(chan, choices):
            for i, ev in evs:
                if isinstance(ev, Delta):
                    choices[i].text.append(ev.text)
                    choices[i].logprobs.extend(ev.logprobs)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done, left = asyncio.ensure_future(run()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (done, left):
            if not t.done():
                t.cancel()
    if not done.done() or done.cancelled():
        jobs.cancel()
        return None
    done.result()  # re-raises a failure
    fins = [c.fin for c in choices]
    if any(f.finish_reason == "cancelled" for f in fins):
        raise S.RequestError(503, "the server is shutting down", code="unavailable")
    return fins


async def _whole(api: "_Api", request: Request, req: S.ChatRequest, p: Plan, jobs: Jobs, chan: Channel,
                 choices: list[Choice], rid: str, created: int) -> Response:
    fins = await collect(request, chan, choices, jobs)
    if fins is None:
        return Response(status_code=499)
    out_choices = []
    for c in choices:
        msg, called = _message(p, "".join(c.text))
        out_choices.append({"index": c.index, "message": msg,
                            "logprobs": O.chat_logprobs(c.logprobs) if req.logprobs else None,
                            "finish_reason": "tool_calls" if called else c.fin.finish_reason})
    fin = _total(fins)
    api._log_usage(request, fin)
    body = O.chat_completion(rid, created, api.model_id, "", fin.finish_reason, fin.prompt_tokens,
                             fin.completion_tokens, None, api._extra(fins[0]), cached_tokens=fin.cached_tokens)
    body["choices"] = out_choices
    return JSONResponse(body)


def _merged(evs: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Adjacent text deltas of one choice merged (one SSE frame for the tokens of a wake-up)."""
    out: list[tuple[int, Any]] = []
    for i, ev in evs:
        if isinstance(ev, Delta) and out and out[-1][0] == i and isinstance(out[-1][1], Delta):
            prev = out[-1][1]
            out[-1] = (i, Delta(prev.text + ev.text, prev.logprobs + ev.logprobs))
        else:
            out.append((i, ev))
    return out


def _total(fins: list[Finished]) -> Finished:
    """The request's usage: the prompt once, the completions of every choice."""
    f = fins[0]
    return Finished(f.finish_reason, f.prompt_tokens, sum(x.completion_tokens for x in fins),
                    cached_tokens=f.cached_tokens)


async def _stream(api: "_Api", request: Request, req: S.ChatRequest, p: Plan, chan: Channel,
                  choices: list[Choice], rid: str, created: int) -> AsyncIterator[str]:
    def mk(i: int, delta: dict[str, Any], **kw: Any) -> str:
        chunk = O.chat_chunk(rid, created, api.model_id, delta, with_usage_field=req.include_usage, **kw)
        chunk["choices"][0]["index"] = i
        return sse(chunk)

    for c in choices:
        c.reason = R.ReasoningStream(p.opened) if p.thinks else None
        c.calls = T.CallStream(p.syntax, p.tools.forced) if p.tools is not None else None
    yield "".join(mk(c.index, {"role": "assistant", "content": ""}) for c in choices)
    plain = O.ContentFrames(rid, created, api.model_id, with_usage_field=req.include_usage)

    def text_frames(c: Choice, text: str, lps: list, final: bool = False) -> list[str]:
        frames: list[str] = []
        reasoning = ""
        if c.reason is not None:
            reasoning, text = c.reason.feed(text)
            if final:
                r2, t2 = c.reason.finish()
                reasoning, text = reasoning + r2, text + t2
        if reasoning:
            frames.append(mk(c.index, {"reasoning_content": reasoning}))
        if c.calls is not None:
            text, deltas = c.calls.feed(text)
            frames += [mk(c.index, {"tool_calls": [d]}) for d in deltas]
        if lps and req.logprobs:
            frames.append(mk(c.index, {"content": text}, logprobs=lps))
        elif text:
            # the plain case: one string template per frame, not a dict dumped per token
            frames.append(plain(text) if c.index == 0 else mk(c.index, {"content": text}))
        return frames

    try:
        async for evs in _events(chan, choices):
            frames: list[str] = []
            for i, ev in _merged(evs):
                c = choices[i]
                if isinstance(ev, Delta):
                    frames += text_frames(c, ev.text, ev.logprobs)
                elif isinstance(ev, Finished):
                    if ev.finish_reason == "cancelled":
                        frames.append(sse(S.error_body("the server is shutting down", type="server_error",
                                                       code="unavailable")))
                        yield "".join(frames)
                        return
                    frames += text_frames(c, "", [], final=True)
                    reason = ev.finish_reason
                    if c.calls is not None:
                        rest, deltas = c.calls.finish()
                        if rest:
                            frames.append(mk(i, {"content": rest}))
                        frames += [mk(i, {"tool_calls": [d]}) for d in deltas]
                        if c.calls.count or deltas:
                            reason = "tool_calls"
                    frames.append(mk(i, {}, finish_reason=reason, extra=api._extra(ev)))
            if frames:
                yield "".join(frames)
    except S.RequestError as err:  # the engine stopped for a writer (lease.py)
        yield sse(err.body())
        return
    except Exception:  # noqa: BLE001 - the engine failed a job (logged there)
        yield sse(S.error_body("internal error while generating; see the server log", type="server_error",
                               code="internal_error"))
        return
    fin = _total([c.fin for c in choices])
    api._log_usage(request, fin)
    tail = []
    if req.include_usage:
        tail.append(sse(O.chat_chunk(rid, created, api.model_id, None,
                                     usage_obj=O.usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens))))
    tail.append("data: [DONE]\n\n")
    yield "".join(tail)
