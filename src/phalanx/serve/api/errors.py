"""One error shape for every HTTP failure: OpenAI's ``{"error": {...}}`` object.

Client errors are 4xx (the official client retries 5xx, so a bad request answered 500
would be sent again and again); 503 carries ``Retry-After``; 500 is only for a bug.
Every error says what was wrong with which field and what to do about it.
"""

from __future__ import annotations

import msgspec

__all__ = ["APIError", "error_body"]


class APIError(Exception):
    """An HTTP error in OpenAI's shape; raised by validation and mapped by the app."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


# OpenAI's error types by status, as its API and the official client name them.
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(message: str, type: str, param: str | None, code: str | None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": type, "param": param, "code": code}})
