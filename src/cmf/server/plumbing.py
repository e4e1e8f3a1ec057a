"""HTTP plumbing under the routes: the event channel from the engine, SSE responses, the bearer-key
and access-log middleware, body reading, and running uvicorn in a thread."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hmac
import json
import logging
import socket
import threading
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import schemas as S
from .defaults import STREAM_INTERVAL
from .jobs import Delta, Failed, Finished, Job

access_log = logging.getLogger("cmf.server.access")

# A body over the cap is read and discarded up to this much before the 413, so that a client
# still sending gets the answer instead of a connection reset; past it the connection is dropped.
_DRAIN_LIMIT = 64 << 20
_PUBLIC_PATHS = ("/health",)  # answered without the API key (load balancers, probes)
BODY_TIMEOUT = 60.0  # seconds for a whole request body (4 MiB at 70 KB/s)


def error_response(err: S.RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers or err.headers)


# Seconds between two hand-overs of one request's events (its SSE writes): tokens generated
# meanwhile go out in one write. The first is immediate. Set per app (create_app's
# stream_interval) through the request's context, read when a route makes its Channel.
_interval: contextvars.ContextVar[float] = contextvars.ContextVar("cmf_stream_interval", default=STREAM_INTERVAL)


class Channel:
    """Hands engine events (worker thread) to the request's coroutine (event-loop thread).

    The worker appends to a deque and wakes the loop only while the coroutine waits for events and
    no wake-up is pending: a coroutine that is busy, or that sleeps out its interval, takes every
    event that arrived meanwhile in one go (one SSE write for several tokens), without a callback
    scheduled per token. Hand-overs are at least ``interval`` seconds apart (the app's
    ``stream_interval``; the first is immediate): a fast stream then costs the event loop, the
    client and the socket one wake-up and one write per interval rather than per token — on a
    machine whose cores all run the kernels, each of those takes a core from a parallel region
    and the GIL from the worker. An event that ends a job (Finished, Failed, alone or as the
    ``(index, event)`` pair of an n > 1 request) cuts the interval short: the last tokens and the
    usage go out at once instead of after up to ``interval`` of idle waiting (at 25 ms that was
    ~2% of a 128-token answer's wall time)."""

    def __init__(self, interval: float | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: collections.deque[Any] = collections.deque()
        self.ready = asyncio.Event()
        self._waking = False  # a wake-up is scheduled on the loop
        self._waiting = False  # the coroutine is blocked in get(): only then does put() wake it
        self.interval = _interval.get() if interval is None else max(0.0, interval)
        self._last = 0.0  # loop time of the previous hand-over
        self._pausing = False  # the coroutine sleeps out its interval: only a final event wakes it
        self.final = asyncio.Event()  # set by a final event: ends the interval's sleep
        self._has_final = False  # a final event has been put (a flag: the deque is not iterated
        # on the loop while the worker may append to it)

    def put(self, event: Any) -> None:
        """Called by the engine; raises RuntimeError once the loop is closed (the engine then
        cancels the job)."""
        if self.loop.is_closed():
            raise RuntimeError("the request's event loop is closed")
        final = _is_final(event)
        self.events.append(event)  # first: a coroutine that reads the flag later finds the event
        if final:
            self._has_final = True
        if (self._waiting or (final and self._pausing)) and not self._waking:
            self._waking = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._waking = False
        self.ready.set()
        if self._has_final:
            self.final.set()

    async def get(self) -> list[Any]:
        """Every event that has arrived (at least one), in order."""
        if self.interval and self._last:
            wait = self._last + self.interval - self.loop.time()
            if wait > 0:
                self.final.clear()
                self._pausing = True  # before the look at the events: a put() after it wakes us
                try:
                    if not self._has_final:
                        await asyncio.wait_for(self.final.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._pausing = False
        while not self.events:
            self.ready.clear()
            self._waiting = True
            if self.events:  # appended before put() could see the flag
                self._waiting = False
                break
            await self.ready.wait()
            self._waiting = False
        out = []
        while self.events:
            out.append(self.events.popleft())
        self._last = self.loop.time()
        return out


def _is_final(event: Any) -> bool:
    """Whether ``event`` (or the event of an ``(index, event)`` pair) ends its job."""
    if isinstance(event, tuple) and event:
        event = event[-1]
    return isinstance(event, (Finished, Failed))


def coalesce(events: list[Any]) -> list[Any]:
    """Adjacent text deltas merged into one (text and logprobs concatenated)."""
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, Delta) and out and isinstance(out[-1], Delta):
            out[-1] = Delta(out[-1].text + ev.text, out[-1].logprobs + ev.logprobs)
        else:
            out.append(ev)
    return out


class SSEResponse(StreamingResponse):
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


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Guard:
    """ASGI middleware: bearer-key check, then one access-log line per request."""

    def __init__(self, app: ASGIApp, api_key: str | None, stream_interval: float = STREAM_INTERVAL) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.stream_interval = max(0.0, float(stream_interval))

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
        _interval.set(self.stream_interval)  # this request's context: its Channel reads it

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
                await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send_logged)
        finally:
            st = scope.get("state") or {}
            usage = st.get("usage")
            tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
            if usage and len(usage) > 2 and usage[2]:
                tokens += f" cached_tokens={usage[2]}"
            reason = f" finish={st['finish']}" if st.get("finish") else ""
            access_log.info("method=%s path=%s status=%d%s%s duration_ms=%.1f", scope.get("method"),
                            scope["path"], status[0] or 499, tokens, reason, (time.perf_counter() - t0) * 1000)


async def read_json(request: Request, limit: int) -> Any:
    """The body parsed as JSON; 413 past ``limit`` bytes, 400 when not UTF-8 JSON, 408 when it
    takes over BODY_TIMEOUT seconds to arrive (a client sending a byte a second holds nothing long)."""
    try:
        buf = await asyncio.wait_for(_read_body(request, limit), BODY_TIMEOUT)
    except asyncio.TimeoutError:
        raise S.RequestError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s",
                             code="request_timeout") from None
    return _parse_body(buf)


async def _read_body(request: Request, limit: int) -> bytearray:
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
    return buf


def _parse_body(buf: bytearray) -> Any:
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


class ServerThread:
    """Run an app with uvicorn in a background thread (tests, benchmarks, embedding).

    ``with ServerThread(app) as s: ...`` binds ``host:port`` (port 0 = any free port, see
    ``s.port``), serves until the block ends, then shuts down.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        from .protocol import GuardedH11Protocol

        config = uvicorn.Config(app, log_level=log_level, access_log=False, log_config=None, lifespan="off",
                                timeout_graceful_shutdown=2, http=GuardedH11Protocol)
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
