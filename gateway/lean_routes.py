"""The completion routes without FastAPI's per-request layers; FastAPI keeps every other
route, the exception handlers and the OpenAPI document.

Why: with one token per request, FastAPI's path to an endpoint (ExceptionMiddleware and
its send wrapper, the AsyncExitStack middleware, the router's matching of every route,
``request_response`` and dependency solving for an endpoint that takes only the
``Request``) was about a tenth of a gateway process's CPU per request (py-spy on
``loadtest/peers/profile_gateway.py --max-tokens 1``; the measured gain is in
loadtest/peers/README.md). The endpoints themselves parse and validate their bodies by
hand, so FastAPI did nothing for them that these layers are needed for.

:class:`LeanMiddleware` is placed inside ``RequestIdMiddleware`` (so every answer
still carries ``x-request-id``) and ServerErrorMiddleware (so an unhandled error is still
the same logged 500): a ``POST`` to a path registered here runs its endpoint directly, and
an exception it raises before its response starts goes to the app's own exception handler
for that type, as Starlette's ExceptionMiddleware would send it. Anything else goes on to
FastAPI unchanged, including other methods on these paths (405) and a trailing slash.

>>> lean = LeanRoutes()
>>> lean.install(app)                        # before the request-id middleware is added
>>> lean.add("/v1/chat/completions", route)  # the same endpoint FastAPI documents
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class LeanRoutes:
    """The endpoints served lean: ``POST`` by exact path."""

    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}

    def install(self, app: FastAPI) -> None:
        """Serve this registry's endpoints in ``app`` (call it before adding the request-id
        middleware, which then wraps it)."""
        app.add_middleware(LeanMiddleware, endpoints=self.endpoints, handlers=app.exception_handlers)

    def add(self, path: str, endpoint: Endpoint) -> None:
        self.endpoints[path] = endpoint


class LeanMiddleware:
    """Runs a registered endpoint straight from the ASGI scope; anything else goes on to FastAPI."""

    def __init__(self, app: ASGIApp, endpoints: dict[str, Endpoint], handlers: dict[Any, Any]) -> None:
        self.app = app
        self._endpoints = endpoints
        #: The FastAPI app's exception handlers, read when an exception needs one.
        self._handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise  # ServerErrorMiddleware: logged, a 500 in OpenAI's shape
            response = await handler(request, exc)
            exc.__traceback__ = None  # as Starlette does: reused instances keep no tracebacks
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[[Request, Exception], Awaitable[Response]] | None:
        for cls in type(exc).__mro__:
            if cls in (Exception, BaseException):
                return None  # the 500 handler is ServerErrorMiddleware's, outside this one
            handler = self._handlers.get(cls)
            if handler is not None:
                return handler  # type: ignore[no-any-return]
        return None
