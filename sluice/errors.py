"""Errors in OpenAI's wire shape, shared by gateway and worker.

    SluiceError                 500 server_error
     ├── InvalidRequest         400 invalid_request_error
     │    └── BodyTooLarge      413 invalid_request_error
     ├── AuthenticationFailed   401 authentication_error / invalid_api_key
     ├── ModelNotFound          404 invalid_request_error / model_not_found
     ├── RouteNotFound          404 invalid_request_error / not_found
     ├── MethodNotAllowed       405 invalid_request_error
     ├── Conflict               409 invalid_request_error / conflict
     ├── RateLimited            429 rate_limit_error (+ Retry-After)
     ├── Unavailable            503 service_unavailable (+ Retry-After)
     ├── UpstreamFailed         502 server_error
     └── DeadlineExceeded       504 timeout

Every error renders as ``{"error": {"message", "type", "param", "code"}}``,
either as a JSON response (:func:`error_response`) or, once a stream has
started, as one in-band SSE event (:func:`error_event`). Messages never carry
stack traces, secrets or internal addresses.
"""

from __future__ import annotations

import math

import orjson
from starlette.responses import Response


class SluiceError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        #: More response headers (e.g. x-ratelimit-*), sent with the JSON rendering.
        self.extra_headers: dict[str, str] = {}

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class InvalidRequest(SluiceError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class HeadTooLarge(InvalidRequest):
    """A request's head past the server's bound (sluice/connection_bounds.py)."""
    status = 431
    code = "request_head_too_large"


class HeadTimedOut(InvalidRequest):
    """A request's head that did not arrive in time (sluice/connection_bounds.py)."""
    status = 408
    code = "request_head_timeout"


class BodyTimedOut(InvalidRequest):
    """A request's body that came slower than the server takes (sluice/connection_bounds.py)."""
    status = 408
    code = "request_body_timeout"


class AuthenticationFailed(SluiceError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(SluiceError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(SluiceError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(SluiceError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(SluiceError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RateLimited(SluiceError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Unavailable(SluiceError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class UpstreamFailed(SluiceError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class DeadlineExceeded(SluiceError):
    status = 504
    type = "timeout"
    code = "timeout"


def error_response(exc: SluiceError, headers: dict[str, str] | None = None) -> Response:
    """The JSON rendering: status, OpenAI body, ``Retry-After`` when known."""
    merged = {**exc.headers(), **(headers or {})}
    return Response(
        orjson.dumps(exc.body()),
        status_code=exc.status,
        media_type="application/json",
        headers=merged,
    )


def error_event(exc: SluiceError) -> bytes:
    """The in-band rendering for a stream already under way (``[DONE]`` follows)."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n"


def from_body(status: int, body: bytes) -> SluiceError:
    """Rebuild an error a worker sent in OpenAI's shape (for pass-through of 4xx)."""
    try:
        err = orjson.loads(body)["error"]
        message = str(err.get("message") or "upstream error")
        param, code = err.get("param"), err.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        message, param, code = "upstream error", None, None
    for cls in (BodyTooLarge, InvalidRequest, ModelNotFound, RateLimited, Unavailable):
        if cls.status == status:
            return cls(message, param=param, code=code)
    return UpstreamFailed(message)
