"""The HTTP surface: an ASGI app (Starlette) over an :class:`~cmf.server.engine.Engine`.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/tokenize`` (each ``/v1`` route also answers without the
prefix, as llama.cpp's does). ``GET /`` and ``/static/…`` serve the web UI when the package ships one (``static/``
beside this file, see :func:`create_app`).

Every refusal has OpenAI's error shape; an unexpected exception becomes a 500 with a generic
message while its traceback goes to the log. One access-log line per request goes to the
``cmf.server.access`` logger as ``key=value`` pairs.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import schemas as S
from .engine import Delta, Engine, EngineClosed, Failed, Finished, Job, QueueFull

log = logging.getLogger(__name__)
access_log = logging.getLogger("cmf.server.access")

DEFAULT_MAX_BODY = 4 << 20
STATIC_DIR = Path(__file__).with_name("static")
# A body over the cap is read and discarded up to this much before the 413, so that a client
# still sending gets the answer instead of a connection reset; past it the connection is dropped.
_DRAIN_LIMIT = 64 << 20
_PUBLIC_PATHS = ("/health",)  # answered without the API key (load balancers, probes)


# ----------------------------------------------------------------------------------- plumbing


def _error_response(err: S.RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _Channel:
    """Hands engine events (worker thread) to the request's coroutine (event loop thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, event: Any) -> None:
        # Raises RuntimeError once the loop is closed; the engine then cancels the job.
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self) -> Any:
        return await self.queue.get()


class _SSEResponse(StreamingResponse):
    """A streaming response that cancels its job however the stream ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], job: Job) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op when the job has finished


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Guard:
    """ASGI middleware: bearer-key check, then one access-log line per request."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        path = scope["path"]
        # Open: health, and the UI page with its static files (the page asks for the key itself).
        # Everything else needs the key, unknown paths included, so no alias can slip past.
        if self.key is None or path in _PUBLIC_PATHS or path == "/" or path.startswith("/static/"):
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_logged)
            else:
                err = S.RequestError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     code="invalid_api_key")
                await _error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send_logged)
        finally:
            st = scope.get("state") or {}
            usage = st.get("usage")
            tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
            reason = f" finish={st['finish']}" if st.get("finish") else ""
            access_log.info("method=%s path=%s status=%d%s%s duration_ms=%.1f", scope.get("method"),
                            scope["path"], status[0] or 499, tokens, reason, (time.perf_counter() - t0) * 1000)



async def _read_json(request: Request, limit: int) -> Any:
    """The body parsed as JSON; 413 past ``limit`` bytes, 400 when not UTF-8 JSON."""
    too_big = S.RequestError(413, f"request body larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise S.bad("invalid Content-Length header", None, "invalid_header") from None
        if size > limit:
            if size <= _DRAIN_LIMIT:
                async for _ in request.stream():
                    pass
            raise too_big
    buf = bytearray()
    over, seen = False, 0
    async for chunk in request.stream():  # chunked bodies have no Content-Length to check first
        seen += len(chunk)
        if over:
            if seen > _DRAIN_LIMIT:
                break
            continue
        if len(buf) + len(chunk) > limit:
            over = True
            buf = bytearray()
            continue
        buf.extend(chunk)
    if over:
        raise too_big
    if not buf:
        raise S.bad("the request body is empty: send a JSON object", None, "invalid_json")
    try:
        text = bytes(buf).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise S.bad("the request body is not valid UTF-8", None, "invalid_json") from None
    except RecursionError:
        raise S.bad("the request body nests too deeply", None, "invalid_json") from None
    except ValueError as exc:  # json.JSONDecodeError, and int() of a 4300+ digit number
        raise S.bad(f"the request body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


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

    def _info(self) -> dict[str, Any]:
        """The model card's ``cmf`` block: what `cmf info --json` says, without server paths."""
        from ..tools.info import info

        d = info(self.model.file)
        d.pop("path", None)
        d["files"] = [Path(p).name for p in d.get("files", [])]
        # `skills` below becomes the plain id list (as in /v1/models); the records with their
        # measured quality stay available to clients (the web UI's model panel) under this key.
        d["skill_info"] = d.get("skills", [])
        d.update(ctx_size=self.model.ctx_size, default_task=self.engine.default_task,
                 default_skill=self.engine.default_skill, tasks=self.model.tasks, skills=self.model.skills)
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
        """max_tokens for a prompt of ``n_prompt`` tokens: the request's, or up to the context."""
        ctx = self.model.ctx_size
        if n_prompt >= ctx:
            raise S.bad(f"the prompt is {n_prompt} tokens; this model's context is {ctx} tokens "
                        "(and at least one must be left to generate)", param, "context_length_exceeded")
        if requested is None:
            return ctx - n_prompt
        if n_prompt + requested > ctx:
            raise S.bad(f"this model's maximum context length is {ctx} tokens; the request asks for "
                        f"{n_prompt + requested} ({n_prompt} in the prompt, {requested} to generate)",
                        "max_tokens", "context_length_exceeded")
        return requested

    async def _chat_ids(self, req: S.ChatRequest) -> list[int]:
        """The prompt ids of a chat request: its messages through the model's chat template."""
        from ..runtime.generate import prompt_ids_for

        return await run_in_threadpool(prompt_ids_for, self.model, req.messages, tools=req.tools,
                                       thinking=req.thinking)

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
            raise S.RequestError(429, f"the server is busy: {exc}; retry shortly", code="queue_full") from None
        except EngineClosed:
            raise S.RequestError(503, "the server is shutting down", code="unavailable") from None

    async def _collect(self, request: Request, job: Job, chan: _Channel) -> tuple[str, list, Finished] | None:
        """Wait for the whole answer; None if the client left first (the job is cancelled)."""

        async def events() -> tuple[str, list, Finished]:
            parts: list[str] = []
            lps: list = []
            while True:
                ev = await chan.get()
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    lps.extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    return "".join(parts), lps, ev
                elif isinstance(ev, Failed):
                    raise _Internal()

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
               "prompt_tps": round(fin.prompt_tps, 2), "generation_tps": round(fin.generation_tps, 2)}
        if fin.blend is not None:
            out["blend"] = fin.blend
        if fin.route is not None:
            out["route"] = fin.route
        if fin.spec_drafted:
            out.update(spec_drafted=fin.spec_drafted, spec_accepted=fin.spec_accepted)
        return out

    # -- routes ----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, "engine": self.engine.snapshot()})

    async def models(self, request: Request) -> Response:
        card = S.model_card(self.model_id, self.created, {"ctx_size": self.model.ctx_size, "tasks": self.model.tasks,
                                                          "skills": self.model.skills})
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(S.model_card(self.model_id, self.created, self.info))

    async def tokenize(self, request: Request) -> Response:
        """The prompt tokens a chat (or completion) body would run with, against the context:
        what a client needs to pick a ``max_tokens`` the model can serve, without generating."""
        body = await _read_json(request, self.max_body)
        parsed = S.parse_tokenize(body, vocab=self.vocab)
        req = parsed.request
        self._check_model(req.model)
        ids = await (self._chat_ids(req) if isinstance(req, S.ChatRequest) else self._completion_ids(req))
        return JSONResponse(S.tokenize_result(self.model_id, ids, self.model.ctx_size, return_ids=parsed.return_ids))

    async def chat(self, request: Request) -> Response:
        body = await _read_json(request, self.max_body)
        req = S.parse_chat(body, vocab=self.vocab)
        self._check_model(req.model)
        task, skill, blend = self._selection(req.selection)
        ids = await self._chat_ids(req)
        max_tokens = self._budget(len(ids), req.sampling.max_tokens, "messages")
        chan = _Channel()
        job = Job(ids, req.sampling, max_tokens, chan.put, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                  task=task, skill=skill, blend=blend, route_prompt=req.messages)
        self._submit(job)
        rid, created = S.new_id("chatcmpl"), S.now()
        if not req.stream:
            got = await self._collect(request, job, chan)
            if got is None:
                return Response(status_code=499)  # nobody reads it; logged as the client's leaving
            text, lps, fin = got
            request.state.usage = (fin.prompt_tokens, fin.completion_tokens)
            request.state.finish = fin.finish_reason
            return JSONResponse(S.chat_completion(rid, created, self.model_id, text, fin.finish_reason,
                                                  fin.prompt_tokens, fin.completion_tokens,
                                                  lps if req.logprobs else None, self._extra(fin)))

        async def stream() -> AsyncIterator[str]:
            mk = lambda delta, **kw: S.chat_chunk(rid, created, self.model_id, delta,  # noqa: E731
                                                  with_usage_field=req.include_usage, **kw)
            yield _sse(mk({"role": "assistant", "content": ""}))
            while True:
                ev = await chan.get()
                if isinstance(ev, Delta):
                    if ev.text or ev.logprobs:
                        yield _sse(mk({"content": ev.text}, logprobs=ev.logprobs if req.logprobs else None))
                elif isinstance(ev, Finished):
                    request.state.usage = (ev.prompt_tokens, ev.completion_tokens)
                    request.state.finish = ev.finish_reason
                    if ev.finish_reason == "cancelled":
                        yield _sse(S.error_body("the server is shutting down", type="server_error",
                                                code="unavailable"))
                        return
                    yield _sse(mk({}, finish_reason=ev.finish_reason, extra=self._extra(ev)))
                    if req.include_usage:
                        yield _sse(S.chat_chunk(rid, created, self.model_id, None,
                                                usage_obj=S.usage(ev.prompt_tokens, ev.completion_tokens)))
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(ev, Failed):
                    yield _sse(S.error_body("internal error while generating; see the server log",
                                            type="server_error", code="internal_error"))
                    return

        return _SSEResponse(stream(), job)

    async def completions(self, request: Request) -> Response:
        body = await _read_json(request, self.max_body)
        req = S.parse_completion(body, vocab=self.vocab)
        self._check_model(req.model)
        task, skill, blend = self._selection(req.selection)
        ids = await self._completion_ids(req)
        if isinstance(req.prompt, str):
            prompt_text = req.prompt
        else:
            prompt_text = self.engine.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        max_tokens = self._budget(len(ids), req.sampling.max_tokens, "prompt")
        chan = _Channel()
        want_lp = req.logprobs is not None
        job = Job(ids, req.sampling, max_tokens, chan.put, logprobs=want_lp, top_logprobs=req.logprobs or 0,
                  task=task, skill=skill, blend=blend, route_prompt=req.prompt)
        self._submit(job)
        rid, created = S.new_id("cmpl"), S.now()
        echo = prompt_text if req.echo else ""
        if not req.stream:
            got = await self._collect(request, job, chan)
            if got is None:
                return Response(status_code=499)
            text, lps, fin = got
            request.state.usage = (fin.prompt_tokens, fin.completion_tokens)
            request.state.finish = fin.finish_reason
            return JSONResponse(S.text_completion(
                rid, created, self.model_id, echo + text, fin.finish_reason, prompt_tokens=fin.prompt_tokens,
                completion_tokens=fin.completion_tokens,
                logprobs=S.completion_logprobs(lps, len(echo)) if want_lp else None, extra=self._extra(fin)))

        async def stream() -> AsyncIterator[str]:
            offset = len(echo)
            if echo:
                yield _sse(S.text_completion(rid, created, self.model_id, echo, None, chunk=True))
            while True:
                ev = await chan.get()
                if isinstance(ev, Delta):
                    lp = S.completion_logprobs(ev.logprobs, offset) if want_lp else None
                    offset += len(ev.text)
                    yield _sse(S.text_completion(rid, created, self.model_id, ev.text, None, logprobs=lp, chunk=True))
                elif isinstance(ev, Finished):
                    request.state.usage = (ev.prompt_tokens, ev.completion_tokens)
                    request.state.finish = ev.finish_reason
                    if ev.finish_reason == "cancelled":
                        yield _sse(S.error_body("the server is shutting down", type="server_error",
                                                code="unavailable"))
                        return
                    yield _sse(S.text_completion(rid, created, self.model_id, "", ev.finish_reason, chunk=True,
                                                 extra=self._extra(ev)))
                    if req.include_usage:
                        yield _sse({"id": rid, "object": "text_completion", "created": created,
                                    "model": self.model_id, "choices": [],
                                    "usage": S.usage(ev.prompt_tokens, ev.completion_tokens)})
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(ev, Failed):
                    yield _sse(S.error_body("internal error while generating; see the server log",
                                            type="server_error", code="internal_error"))
                    return

        return _SSEResponse(stream(), job)


class _Internal(Exception):
    """The engine reported a failure (already logged there)."""


def _endpoint(fn: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn RequestError into its error response and anything unexpected into a logged 500."""

    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except S.RequestError as err:
            headers = {"Retry-After": "1"} if err.status == 429 else None
            return _error_response(err, headers)
        except _Internal:
            return _error_response(S.RequestError(500, "internal error while generating; see the server log",
                                                  code="internal_error"))
        except Exception:  # noqa: BLE001 - the HTTP boundary: never a traceback to the client
            log.exception("%s %s failed", request.method, request.url.path)
            return _error_response(S.RequestError(500, "internal server error; see the server log",
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
    return _error_response(S.RequestError(status, str(msg), code=code), headers)


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               static_dir: Path | None = STATIC_DIR) -> ASGIApp:
    """The ASGI app serving ``engine``'s model as ``model_id``.

    ``api_key``: require ``Authorization: Bearer <key>`` on the API routes. ``max_body``: the
    request body cap in bytes (413 past it). ``static_dir``: when it holds ``index.html``, ``GET /``
    serves that page and ``/static/…`` the folder (the web UI's hook); otherwise ``/`` is a 404.
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
        ]
    if static_dir is not None and (Path(static_dir) / "index.html").is_file():
        from starlette.staticfiles import StaticFiles

        index = Path(static_dir) / "index.html"

        async def page(request: Request) -> Response:
            return FileResponse(index, media_type="text/html")

        routes += [Route("/", page, methods=["GET"]), Mount("/static", StaticFiles(directory=str(static_dir)))]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return _Guard(app, api_key)


# ----------------------------------------------------------------------------------- running


class ServerThread:
    """Run an app with uvicorn in a background thread (tests, benchmarks, embedding).

    ``with ServerThread(app) as s: ...`` binds ``host:port`` (port 0 = any free port, see
    ``s.port``), serves until the block ends, then shuts down.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, log_config=None, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="cmf-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(256)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
