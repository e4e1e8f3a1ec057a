"""The server's refusals: :class:`RequestError` (an HTTP status and OpenAI's error fields) and
the OpenAI error body. A module of its own so that the request checks (``schemas``, ``limits``,
``tools_calls``, ``structured``) all raise the one class without importing each other."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers  # extra response headers (Retry-After of a 429)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for a status (the client maps the status itself to an exception)."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    """A 400 invalid_request_error."""
    return RequestError(400, message, param=param, code=code)
