"""Errors the proxy returns, rendered in the shape of the API the client called.

OpenAI clients expect `{"error": {"message", "type", "param", "code"}}`; Anthropic clients expect
`{"type": "error", "error": {"type", "message"}}`. Handlers raise `ApiError`; the app turns it into
the right shape (and status) from the request path, so no traceback ever reaches a client.
"""

from __future__ import annotations

from typing import Any, Literal

ApiFlavor = Literal["openai", "anthropic"]

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("timeout_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
}


def root_cause(exc: BaseException) -> BaseException:
    """The error at the bottom of Ray's wrappers (a `RayTaskError` keeps the actor's own error as
    `cause`; its text is the remote traceback); `exc` itself when it wraps nothing."""
    cause = getattr(exc, "cause", None)
    while isinstance(cause, BaseException) and cause is not exc:
        exc, cause = cause, getattr(cause, "cause", None)
    return exc


class ApiError(Exception):
    """A request that fails with `status`; `message` is shown to the client as is."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 naming what is wrong."""
    return ApiError(400, message, param)


def flavor_for_path(path: str) -> ApiFlavor:
    """Anthropic routes live under /v1/messages; everything else answers in the OpenAI shape."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(flavor: ApiFlavor, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response in the given API's shape."""
    openai_type, anthropic_type = _TYPES.get(status, _TYPES[500] if status >= 500 else _TYPES[400])
    if flavor == "anthropic":
        return {"type": "error", "error": {"type": anthropic_type, "message": message}}
    return {"error": {"message": message, "type": openai_type, "param": param, "code": None}}
