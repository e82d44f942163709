"""Calling an engine server directly: the gateway side of ``sluice worker --engine openai
--relay direct``.

Such a worker registers the OpenAI-compatible server it fronts (``vllm serve``,
``trtllm-serve``, ...) under a relay URL (sluice/engine_server.py: ``openai+http://...``)
and keeps its capacity, health and load in the registry; a lease on it reaches here
instead of ``POST /internal/generate``. The internal request the worker would have
received becomes the server's request in this process, and the server's chunks become
the same lines a worker sends (as dicts: nothing is encoded to be parsed again), so everything downstream of
:class:`gateway.relay.upstream.Upstream` (deadlines, retries, migration by token ids, the
journal, usage) is unchanged. Closing the stream closes the connection to the server,
which aborts the request there.

What it costs and buys: one process and one HTTP hop fewer per streamed chunk (the
worker's parsing, re-encoding and sending), for the translation work in the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from engine_worker.protocol import GenerateRequest
from sluice.engine_server import EngineServer, parse_relay_url
from sluice.errors import SluiceError
from sluice.http1 import Http1Pool

log = logging.getLogger("sluice.gateway")


class DeltaLines:
    """A server's stream as the lines a worker would send (dicts, never encoded), the first
    already read. The engine server's generator makes the lines itself, and a failure after
    the first line becomes one error line where :class:`gateway.relay.upstream.Upstream`
    reads it (:meth:`failed`): no generator of its own between them, one step fewer per
    relayed chunk (loadtest/peers/README.md)."""

    def __init__(self, first: dict[str, Any], lines: AsyncIterator[dict[str, Any]]) -> None:
        self.first = first
        self._lines = lines

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._lines

    @staticmethod
    def failed(exc: Exception) -> dict[str, Any]:
        """Like a worker: a failure mid-stream reaches the reader as a line."""
        if isinstance(exc, SluiceError):
            return exc.body()
        log.error("engine server stream failed", exc_info=exc)
        return SluiceError(f"engine error: {type(exc).__name__}").body()

    async def aclose(self, finished: bool = False) -> None:
        """``finished`` changes nothing here: the server's stream reads its body's end itself."""
        await self._lines.aclose()  # type: ignore[attr-defined]  # closes the server's connection


class DirectRelay:
    """The engine servers this gateway calls, one :class:`EngineServer` per relay URL."""

    def __init__(self, http: httpx.AsyncClient, streams: Http1Pool) -> None:
        self._http = http
        self._streams = streams
        self._servers: dict[str, EngineServer] = {}

    def server(self, relay: str) -> EngineServer:
        server = self._servers.get(relay)
        if server is None:
            url, model, token_ids = parse_relay_url(relay)
            server = self._servers[relay] = EngineServer(url, model, token_ids=token_ids, http=self._http,
                                                         streams=self._streams)
        return server

    async def open(self, relay: str, body: bytes) -> DeltaLines:
        """Start the generation and read its first delta; raises the server's refusal (a
        :class:`SluiceError`) before it, like a worker's HTTP error status."""
        lines = self.server(relay).lines(GenerateRequest.parse(body))
        try:
            first = await anext(lines)
        except BaseException:
            await lines.aclose()  # type: ignore[attr-defined]
            raise
        return DeltaLines(first, lines)
