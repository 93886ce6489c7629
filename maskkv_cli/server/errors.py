"""Errors a request can meet, as OpenAI's API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server gives goes through ``APIError``: a malformed body is a 400, a wrong key a 401, an unknown
document a 404, a body over the limit a 413, a full queue a 429 with ``Retry-After``, a request over its time limit a
504. The message is one line: what went wrong and what to do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["APIError", "bad_request", "not_found"]


class APIError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request's body or one of its fields is not what the API takes."""
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, kind="not_found_error", param=param, code="not_found")
