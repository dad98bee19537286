"""What goes wrong in a request, as an HTTP status and a kind both APIs can name."""

from __future__ import annotations

from typing import Literal

from ..errors import (
    AgentClosedError,
    ContextLengthError,
    InvalidRequestError,
    MlxActorsError,
    PoolExhaustedError,
    RuntimeClosedError,
    TurnTimeoutError,
)

Kind = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "request_too_large",
    "overloaded_error",
    "timeout_error",
    "api_error",
]


class ApiError(Exception):
    """A request's failure as its client is told it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: Kind = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code


def api_error(exc: BaseException) -> ApiError | None:
    """``exc`` as its client is told it; ``None`` for an error that is not the client's
    to read (a bug: it answers 500 without its text, and is logged)."""
    if isinstance(exc, ApiError):
        return exc
    message = str(exc)
    if isinstance(exc, ContextLengthError):
        return ApiError(400, message, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, message)
    if isinstance(exc, PoolExhaustedError):
        return ApiError(503, message, kind="overloaded_error", code="pool_exhausted")
    if isinstance(exc, TurnTimeoutError):
        return ApiError(504, message, kind="timeout_error", code="timeout")
    if isinstance(exc, (RuntimeClosedError, AgentClosedError)):
        return ApiError(503, "the server is shutting down", kind="overloaded_error")
    if isinstance(exc, MlxActorsError):
        return ApiError(500, message, kind="api_error")
    return None
