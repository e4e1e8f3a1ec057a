"""uvicorn's h11 protocol with two fixes for hostile clients (issue 28, benchmarks/server_abuse.py).

- **A deadline for the request head.** uvicorn arms its keep-alive timer only after a response,
  so a connection that sends nothing, or sends its headers one byte a second (slowloris), is
  held forever: enough of them exhaust the process's file descriptors. Here every connection
  must deliver a complete request head within ``HEAD_TIMEOUT`` seconds of opening (or of its
  previous response); past it the connection is closed, with a 408 when part of a head arrived.
  A request being answered (a long stream) is never cut.
- **A bound on the request head.** h11 caps only a head that is still incomplete (16 KiB); one
  that arrives whole in one read was taken at any size (a 64 KiB header line, 4,000 headers).
  A head over ``MAX_HEAD_BYTES`` or ``MAX_HEADERS`` lines gets a 431.
- **Refusals in OpenAI's shape.** A malformed request or a header block over h11's 16 KiB limit
  got a plain-text 400; it is now ``{"error": {...}}`` JSON like every other refusal.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

HEAD_TIMEOUT = 20.0  # seconds for a request head; browsers' idle preconnects live ~10 s
MAX_HEAD_BYTES = 16 << 10  # a request head (request line + headers), as h11's limit for an incomplete one
MAX_HEADERS = 200  # header lines; clients send 5-20


def _raw_json_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, as bytes: written directly, since h11
    will not send a response before it has parsed a request."""
    body = json.dumps(error_body(message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` plus the request-head deadline and JSON 400s (see the module docstring)."""

    head_timeout = HEAD_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received since the last response (0: idle)
        self._head_buf = b""  # the head so far, until its blank line
        self._head_done = False

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = 0
        self._head_buf, self._head_done = b"", False
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._head_bytes += len(data)
        if not self._head_done and not self.transport.is_closing():
            buf = self._head_buf + data
            end = buf.find(b"\r\n\r\n")
            head = buf if end < 0 else buf[:end]
            if len(head) > MAX_HEAD_BYTES or head.count(b"\r\n") > MAX_HEADERS:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request head is over {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} header lines",
                             "headers_too_large")
                return
            self._head_buf, self._head_done = (b"", True) if end >= 0 else (buf, False)
        super().data_received(data)

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self._cancel_head_timer()
        self.transport.write(_raw_json_response(status, reason, message, code))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request on this connection gets its own deadline

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._in_request():
            return  # a head arrived in time: the request runs as long as it needs
        if self._head_bytes:  # part of a head came: say why the connection ends
            self.transport.write(_raw_json_response(
                408, "Request Timeout", f"the request head did not arrive within {self.head_timeout:g} s",
                "request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._cancel_head_timer()
        self.transport.write(_raw_json_response(
            400, "Bad Request", "invalid HTTP request (malformed, or its header block is over 16 KiB)",
            "invalid_http_request"))
        self.transport.close()
