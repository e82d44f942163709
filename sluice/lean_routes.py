"""The hot routes served straight from the ASGI scope (the gateway's completion routes, the
worker's ``/internal/generate``); FastAPI serves every other route, holds the exception
handlers and documents every route (the OpenAPI document).

Why: with one token per request, FastAPI's path to an endpoint (ExceptionMiddleware and
its send wrapper, the AsyncExitStack middleware, the router's matching of every route,
``request_response`` and dependency solving for an endpoint that takes only the
``Request``) was about a tenth of a gateway process's CPU per request (py-spy on
``loadtest/peers/profile_gateway.py --max-tokens 1``; the measured gains are in
loadtest/peers/README.md). The endpoints parse and validate their bodies by hand, so
FastAPI did nothing for them that these layers are needed for. After that, the layers in
front of the lean routes were still FastAPI's and Starlette's entry points, Starlette's
ServerErrorMiddleware and our request-id middleware, each a frame per request, and every
send went through two wrappers (one to know whether the response had started, one to add
the request id): :class:`Front`, what uvicorn runs, does what they did for these routes in
one frame and one wrapper.

The worker's generate route went through the same layers for every stream; served lean,
with its hang-up watched by a plain task (engine_worker/stream.py), a simulator worker's CPU
fell from 269 to 132 µs a one-token request (64 streams through ``sluice up --engine sim``,
loadtest/peers/README.md). The worker process, which also runs vLLM's frontend, is what
bounds short requests on a GPU (loadtest/gpu/h100-2026-12-06-short/).

What a lean route gets, as the layers gave it:
- ``x-request-id`` on every answer, when the front is given a ``request_id`` function (the
  gateway's): the client's when valid, else a fresh one (also in the scope as
  ``sluice.request_id``; gateway/app.py's ``RequestIdMiddleware`` does the same for FastAPI's
  routes);
- an exception before the response starts answers through the app's handler for its type
  (as Starlette's ExceptionMiddleware); one no handler takes (an unexpected error) goes to
  the app's ``Exception`` handler (it logs it), whose 500 in the client's shape is sent if the
  response has not started, and is raised on for uvicorn (which closes the connection), as
  ServerErrorMiddleware does. One difference: that 500 now carries ``x-request-id`` too
  (ServerErrorMiddleware sent it outside the request-id middleware).
Anything else (other methods on these paths: 405; a trailing slash; the lifespan) goes to
FastAPI unchanged, behind uvicorn's proxy-headers middleware (a client's address and scheme
from ``X-Forwarded-For``/``-Proto`` when a trusted proxy sent them: uvicorn's
``FORWARDED_ALLOW_IPS``, loopback by default), which uvicorn no longer runs in front of
every request: only FastAPI's routes read the client's address (``/metrics`` answers
loopback clients), and for a lean route it was a frame and a scan of the headers per
request (1.3 % of a gateway's CPU at 64 one-token streams, py-spy).

>>> lean = LeanRoutes()
>>> lean.add("/v1/chat/completions", route)  # the same endpoint FastAPI documents
>>> app = Front(fastapi_app, lean, new_request_id)
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


class LeanRoutes:
    """The endpoints served lean: ``POST`` by exact path."""

    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}

    def add(self, path: str, endpoint: Endpoint) -> None:
        self.endpoints[path] = endpoint


class Front:
    """The ASGI app uvicorn runs: a lean route straight from the scope, the rest FastAPI's."""

    def __init__(self, app: FastAPI, lean: LeanRoutes, request_id: Callable[[str], str] | None = None) -> None:
        self.app = app
        #: FastAPI's routes, as uvicorn would have run them (uvicorn's default trusted proxies).
        self._rest = ProxyHeadersMiddleware(app, trusted_hosts=os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1"))
        self._endpoints = lean.endpoints
        #: The FastAPI app's exception handlers, read when an exception needs one.
        self._handlers: dict[Any, Handler] = app.exception_handlers
        self._request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            await self._rest(scope, receive, send)
            return
        scope["app"] = self.app  # as Starlette's entry point sets it
        rid = b""
        if self._request_id is not None:
            given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
            scope["sluice.request_id"] = self._request_id(given)
            rid = scope["sluice.request_id"].encode()
        started = False

        def send_with_id(message: Message) -> Awaitable[None]:
            # Returns uvicorn's own awaitable, not a coroutine of its own: no frame more per
            # send (a streamed chunk is one send).
            nonlocal started
            if not started and message["type"] == "http.response.start":
                started = True
                headers = message.get("headers", ())
                if rid and not any(k == b"x-request-id" for k, _ in headers):  # raw header names are lower case
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            return send(message)

        request = Request(scope, receive)
        try:
            try:
                response = await endpoint(request)
            except Exception as exc:
                handler = self._handler(exc)
                if handler is None:
                    raise
                response = await handler(request, exc)
                exc.__traceback__ = None  # as Starlette does: reused instances keep no tracebacks
            await response(scope, receive, send_with_id)
        except Exception as exc:
            unexpected = self._handlers.get(Exception)
            if unexpected is not None:
                answer = await unexpected(request, exc)  # logged here, whether it can still answer or not
                if not started:
                    await answer(scope, receive, send_with_id)
            raise

    def _handler(self, exc: Exception) -> Handler | None:
        for cls in type(exc).__mro__:
            if cls in (Exception, BaseException):
                return None  # an unexpected error: the 500 and the raise, in __call__
            handler = self._handlers.get(cls)
            if handler is not None:
                return handler
        return None
