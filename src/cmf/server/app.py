"""The HTTP surface: an ASGI app (Starlette) over an :class:`~cmf.server.engine.Engine`.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/tokenize``, ``POST /v1/embeddings`` (each ``/v1`` route also answers without the
prefix, as llama.cpp's does). ``GET /`` and ``/static/…`` serve the web UI when the package ships one (``static/``
beside this file, see :func:`create_app`).

Every refusal has OpenAI's error shape; an unexpected exception becomes a 500 with a generic
message while its traceback goes to the log. One access-log line per request goes to the
``cmf.server.access`` logger as ``key=value`` pairs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from ..summary import info
from . import chat_route, completion_route
from . import embeddings as emb
from . import responses as O
from . import schemas as S
from .defaults import STREAM_INTERVAL
from .engine import Engine
from .filewatch import FileWatch
from .lease import LeaseGuard
from .structured import Grammars
from .jobs import Delta, EngineClosed, Failed, Finished, Job, JobFailed, QueueFull
from .plumbing import (Channel, Guard, ServerThread, SSEResponse, bind, coalesce, error_response,
                       read_json, sse)

__all__ = ["create_app", "ServerThread", "bind"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 << 20
STATIC_DIR = Path(__file__).with_name("static")


# ----------------------------------------------------------------------------------- the app


class _Api:
    """Route handlers; one instance per app, holding the engine and the served model's identity."""

    def __init__(self, engine: Engine, model_id: str, max_body: int) -> None:
        self.engine = engine
        self.model = engine.model
        self.model_id = model_id
        self.max_body = max_body
        self.vocab = int(self.model.plan.vocab)
        self.created = int(self.model.file.path.stat().st_mtime)
        self.info = self._info()
        self.grammars = Grammars(engine.tokenizer, self.vocab)  # llguidance's tokenizer, built on first use
        self.watch = FileWatch(self.model.file.paths)  # truncated under the mapping: 503, not SIGBUS
        # and a request in flight when another process cuts the file: the writer waits for the step
        self.lease = LeaseGuard(self.model.file.paths, lambda: engine.revoke(FileWatch.error("modified")))
        engine.on_close(self.lease.close)
        self.watch.revoked = lambda: engine.revoked is not None

    def _info(self) -> dict[str, Any]:
        """The model card's ``cmf`` block: what `cmf info --json` says, without server paths."""
        d = info(self.model.file)
        d.pop("path", None)
        d["files"] = [Path(p).name for p in d.get("files", [])]
        # `skills` below becomes the plain id list (as in /v1/models); the records with their
        # measured quality stay available to clients (the web UI's model panel) under this key.
        d["skill_info"] = d.get("skills", [])
        d.update(ctx_size=self.model.ctx_size, default_task=self.engine.default_task,
                 default_skill=self.engine.default_skill, tasks=self.model.tasks, skills=self.model.skills,
                 activations="int8" if getattr(self.model, "int8_activations", False) else "exact",
                 kv_cache=getattr(self.model, "kv_cache", "f32"))
        return d

    # -- helpers ---------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise S.RequestError(404, f"the model '{name[:200]}' does not exist; this server serves "
                                      f"'{self.model_id}'", param="model", code="model_not_found")

    def _unknown_skill(self, sid: str, param: str) -> S.RequestError:
        return S.RequestError(404, f"no skill '{sid[:200]}' in this model (skills: "
                                   f"{', '.join(self.model.skills) or 'none'})", param=param, code="skill_not_found")

    def _selection(self, sel: S.Selection) -> tuple[str | None, str | None, Any]:
        """The (task, skill, blend) a request runs with; 404 for names the file does not have."""
        task = self.engine.default_task if sel.task is ... else sel.task
        if task is not None and task != "none" and task not in self.model.tasks:  # "none": unmasked
            raise S.RequestError(404, f"no task '{task[:200]}' in this model (tasks: "
                                      f"{', '.join(self.model.tasks) or 'none'})", param="cmf.task",
                                 code="task_not_found")
        if sel.blend is not None:
            if sel.skill not in (..., None, "none"):
                raise S.bad("give 'cmf.skill' or 'cmf.blend', not both", "cmf.blend", "invalid_value")
            if isinstance(sel.blend, dict):
                for sid in sel.blend:
                    if sid != "none" and sid not in self.model.skills:
                        raise self._unknown_skill(sid, f"cmf.blend.{sid}")
            return task, None, sel.blend
        skill = self.engine.default_skill if sel.skill is ... else sel.skill
        if skill not in (None, "none", "auto") and skill not in self.model.skills:
            raise self._unknown_skill(skill, "cmf.skill")
        return task, None if skill == "none" else skill, None

    def _budget(self, n_prompt: int, requested: int | None, param: str) -> int:
        """max_tokens for a prompt of ``n_prompt`` tokens: the request's, or up to the context (or
        to what the server's KV budget holds for one sequence, when that is less)."""
        ctx = self.model.ctx_size
        limit = self.engine.max_sequence_tokens
        why = f"this model's context is {ctx} tokens" if limit >= ctx else \
            f"this server's KV budget (--kv-budget) holds {limit} tokens for one sequence"
        if n_prompt >= limit:
            raise S.bad(f"the prompt is {n_prompt} tokens; {why} (and at least one must be left to generate)",
                        param, "context_length_exceeded")
        if requested is None:
            return limit - n_prompt
        if n_prompt + requested > limit:
            what = f"this model's maximum context length is {ctx} tokens" if limit >= ctx else why
            raise S.bad(f"{what}; the request asks for {n_prompt + requested} ({n_prompt} in the prompt, "
                        f"{requested} to generate)", "max_tokens", "context_length_exceeded")
        return requested

    async def _completion_ids(self, req: S.CompletionRequest) -> list[int]:
        """The prompt ids of a completion request: its ids, or its text with the special tokens."""
        if isinstance(req.prompt, str):
            ids = await run_in_threadpool(self.engine.tokenizer.encode, req.prompt, add_special_tokens=True)
        else:
            ids = req.prompt
        if not ids:
            raise S.bad("the prompt encodes to no tokens", "prompt", "invalid_value")
        return ids

    def _submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            raise S.RequestError(429, f"the server is busy: {exc}; retry in {exc.retry_after} s",
                                 code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineClosed:
            raise S.RequestError(503, "the server is shutting down", code="unavailable") from None

    async def _collect(self, request: Request, job: Job, chan: Channel) -> tuple[str, list, Finished] | None:
        """Wait for the whole answer; None if the client left first (the job is cancelled)."""

        async def events() -> tuple[str, list, Finished]:
            parts: list[str] = []
            lps: list = []
            while True:
                for ev in await chan.get():
                    if isinstance(ev, Delta):
                        parts.append(ev.text)
                        lps.extend(ev.logprobs)
                    elif isinstance(ev, Finished):
                        return "".join(parts), lps, ev
                    elif isinstance(ev, Failed):  # a RequestError: the engine stopped for a writer (lease.py)
                        raise ev.error if isinstance(ev.error, S.RequestError) else JobFailed()

        async def disconnected() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        done_task = asyncio.ensure_future(events())
        gone_task = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (done_task, gone_task):
                if not t.done():
                    t.cancel()
        if not done_task.done() or done_task.cancelled():
            job.cancel()
            return None
        result = done_task.result()
        if result[2].finish_reason == "cancelled":
            raise S.RequestError(503, "the server is shutting down", code="unavailable")
        return result

    def _extra(self, fin: Finished | None = None) -> dict[str, Any]:
        if fin is None:
            return {}
        out = {"task": fin.task, "skill": fin.skill, "time_to_first_token_ms": round(fin.time_to_first_token * 1e3, 2),
               "prompt_tps": round(fin.prompt_tps, 2), "generation_tps": round(fin.generation_tps, 2),
               "queue_ms": round(fin.queued * 1e3, 2)}
        if fin.blend is not None:
            out["blend"] = fin.blend
        if fin.route is not None:
            out["route"] = fin.route
        if fin.spec_drafted:
            out.update(spec_drafted=fin.spec_drafted, spec_accepted=fin.spec_accepted)
        return out

    @staticmethod
    def _log_usage(request: Request, fin: Finished) -> None:
        """The access-log line's counts (the middleware reads them off the request state)."""
        request.state.usage = (fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
        request.state.finish = fin.finish_reason

    # -- routes ----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        state = self.watch.state()
        body: dict[str, Any] = {"status": "ok", "model": self.model_id, "engine": self.engine.snapshot(),
                                "activations": self.info["activations"], "kv_cache": self.info["kv_cache"]}
        if state != "ok":
            body["file"] = state
        try:
            self.watch.check()
        except S.RequestError as err:  # a supervisor polling /health sees the server must restart
            return JSONResponse(dict(err.body(), **dict(body, status="unavailable")), status_code=503)
        return JSONResponse(body)

    async def models(self, request: Request) -> Response:
        card = O.model_card(self.model_id, self.created, {"ctx_size": self.model.ctx_size, "tasks": self.model.tasks,
                                                          "skills": self.model.skills})
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(O.model_card(self.model_id, self.created, self.info))

    async def tokenize(self, request: Request) -> Response:
        """The prompt tokens a chat (or completion) body would run with, against the context:
        what a client needs to pick a ``max_tokens`` the model can serve, without generating."""
        self.watch.check()
        body = await read_json(request, self.max_body)
        parsed = S.parse_tokenize(body, vocab=self.vocab)
        req = parsed.request
        self._check_model(req.model)
        if isinstance(req, S.ChatRequest):  # the chat route's own prompt (tools described, calls as text)
            ids = (await chat_route.plan(self, req)).ids
        else:
            ids = await self._completion_ids(req)
        return JSONResponse(O.tokenize_result(self.model_id, ids, self.model.ctx_size, return_ids=parsed.return_ids))

    async def chat(self, request: Request) -> Response:
        # tools, structured output, reasoning and n > 1 live in chat_route
        self.watch.check()
        return await chat_route.chat(self, request)

    async def embeddings(self, request: Request) -> Response:
        self.watch.check()
        return await emb.route(self, request)

    async def completions(self, request: Request) -> Response:
        self.watch.check()
        body = await read_json(request, self.max_body)
        req = S.parse_completion(body, vocab=self.vocab)
        self._check_model(req.model)
        task, skill, blend = self._selection(req.selection)
        ids = await self._completion_ids(req)
        if isinstance(req.prompt, str):
            prompt_text = req.prompt
        else:
            prompt_text = self.engine.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        max_tokens = self._budget(len(ids), req.sampling.max_tokens, "prompt")
        if req.n > 1:
            return await completion_route.many(self, request, req, ids, prompt_text if req.echo else "",
                                               (task, skill, blend), max_tokens)
        chan = Channel()
        want_lp = req.logprobs is not None
        job = Job(ids, req.sampling, max_tokens, chan.put, logprobs=want_lp, top_logprobs=req.logprobs or 0,
                  task=task, skill=skill, blend=blend, route_prompt=req.prompt)
        self._submit(job)
        rid, created = O.new_id("cmpl"), O.now()
        echo = prompt_text if req.echo else ""
        if not req.stream:
            got = await self._collect(request, job, chan)
            if got is None:
                return Response(status_code=499)
            text, lps, fin = got
            self._log_usage(request, fin)
            return JSONResponse(O.text_completion(
                rid, created, self.model_id, echo + text, fin.finish_reason, prompt_tokens=fin.prompt_tokens,
                completion_tokens=fin.completion_tokens,
                logprobs=O.completion_logprobs(lps, len(echo)) if want_lp else None, extra=self._extra(fin),
                cached_tokens=fin.cached_tokens))

        async def stream() -> AsyncIterator[str]:
            offset = len(echo)
            if echo:
                yield sse(O.text_completion(rid, created, self.model_id, echo, None, chunk=True))
            while True:
                frames: list[str] = []
                for ev in coalesce(await chan.get()):
                    if isinstance(ev, Delta):
                        lp = O.completion_logprobs(ev.logprobs, offset) if want_lp else None
                        offset += len(ev.text)
                        frames.append(sse(O.text_completion(rid, created, self.model_id, ev.text, None, logprobs=lp,
                                                            chunk=True)))
                    elif isinstance(ev, Finished):
                        self._log_usage(request, ev)
                        if ev.finish_reason == "cancelled":
                            frames.append(sse(S.error_body("the server is shutting down", type="server_error",
                                                           code="unavailable")))
                            yield "".join(frames)
                            return
                        frames.append(sse(O.text_completion(rid, created, self.model_id, "", ev.finish_reason,
                                                            chunk=True, extra=self._extra(ev))))
                        if req.include_usage:
                            frames.append(sse({"id": rid, "object": "text_completion", "created": created,
                                               "model": self.model_id, "choices": [], "usage": O.usage(
                                                   ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)}))
                        frames.append("data: [DONE]\n\n")
                        yield "".join(frames)
                        return
                    elif isinstance(ev, Failed):
                        frames.append(sse(ev.error.body() if isinstance(ev.error, S.RequestError) else S.error_body(
                            "internal error while generating; see the server log", type="server_error",
                            code="internal_error")))
                        yield "".join(frames)
                        return
                if frames:
                    yield "".join(frames)

        return SSEResponse(stream(), job)


def _endpoint(fn: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn RequestError into its error response and anything unexpected into a logged 500."""

    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except S.RequestError as err:
            return error_response(err)
        except JobFailed:
            return error_response(S.RequestError(500, "internal error while generating; see the server log",
                                                  code="internal_error"))
        except Exception:  # noqa: BLE001 - the HTTP boundary: never a traceback to the client
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(S.RequestError(500, "internal server error; see the server log",
                                                  code="internal_error"))

    return handler


async def _http_error(request: Request, exc: Exception) -> Response:
    """Router-level errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        msg, code = f"no route {request.method} {request.url.path[:200]}", "not_found"
    elif status == 405:
        msg, code = f"method {request.method} is not allowed on {request.url.path[:200]}", "method_not_allowed"
    else:
        msg, code = (exc.detail if isinstance(exc, HTTPException) else "internal server error"), None
    headers = getattr(exc, "headers", None)
    return error_response(S.RequestError(status, str(msg), code=code), headers)


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               static_dir: Path | None = STATIC_DIR, stream_interval: float = STREAM_INTERVAL) -> ASGIApp:
    """The ASGI app serving ``engine``'s model as ``model_id``.

    ``api_key``: require ``Authorization: Bearer <key>`` on the API routes. ``max_body``: the
    request body cap in bytes (413 past it). ``static_dir``: when it holds ``index.html``, ``GET /``
    serves that page and ``/static/…`` the folder (the web UI's hook); otherwise ``/`` is a 404.
    ``stream_interval``: seconds between two writes of one stream (tokens generated meanwhile go
    out together; the first is sent at once; 0: every token as it comes).
    """
    api = _Api(engine, model_id, max_body)
    routes: list[Any] = [Route("/health", _endpoint(api.health), methods=["GET"])]
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/models", _endpoint(api.models), methods=["GET"]),
            Route(f"{prefix}/models/{{model_id:path}}", _endpoint(api.model_card), methods=["GET"]),
            Route(f"{prefix}/chat/completions", _endpoint(api.chat), methods=["POST"]),
            Route(f"{prefix}/completions", _endpoint(api.completions), methods=["POST"]),
            Route(f"{prefix}/tokenize", _endpoint(api.tokenize), methods=["POST"]),
            Route(f"{prefix}/embeddings", _endpoint(api.embeddings), methods=["POST"]),
        ]
    if static_dir is not None and (Path(static_dir) / "index.html").is_file():
        from starlette.staticfiles import StaticFiles

        index = Path(static_dir) / "index.html"

        async def page(request: Request) -> Response:
            return FileResponse(index, media_type="text/html")

        routes += [Route("/", page, methods=["GET"]), Mount("/static", StaticFiles(directory=str(static_dir)))]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return Guard(app, api_key, stream_interval)
