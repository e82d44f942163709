"""Server-sent events to the client: one task per stream, one keep-alive timer per process.

Why not sse-starlette: its response runs a supervisor with four tasks per stream (the
pump, a ping timer, a shutdown listener, a disconnect listener), anyio cancel scopes and a
lock around every send. On a saturated gateway that was the largest single cost of starting
a stream (about a fifth of the CPU of a request, profiled with py-spy), and thousands of
open streams meant thousands of ping timers. Here a stream is its own request task plus,
once it has lasted ``WATCH_AFTER_S``, one idle task that waits for the client to leave;
:class:`Keepalive` pings every stream that has been quiet for a while from one timer.

Why the watch waits: its task (made, started, cancelled and ended) cost about 20 µs, some 4 %
of a one-token stream's CPU in the gateway, and most short streams have ended before a tenth
of a second (loadtest/peers/README.md). A client that leaves sooner is noticed once the
watch starts, and its generation stopped then: at most ``WATCH_AFTER_S`` of tokens later.

Shutdown: streams are left to finish during uvicorn's graceful shutdown
(``shutdown_grace_s``), then cancelled by uvicorn; clean-up runs either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.surfaces.openai import DONE
from sluice.aftercare import to_the_end

log = logging.getLogger("sluice.gateway")

PING = b": ping\n\n"

#: Every stream's own headers: no cache may keep it, no proxy may buffer it.
_SSE_HEADERS = [(b"cache-control", b"no-store"), (b"x-accel-buffering", b"no"),
                (b"content-type", b"text/event-stream; charset=utf-8")]
_OWN_HEADERS = frozenset(name.decode() for name, _ in _SSE_HEADERS)

#: Seconds a stream runs before a task watches for its client leaving (see above).
WATCH_AFTER_S = 0.1


class Keepalive:
    """Sends a comment line to every open stream that sent nothing for ``interval_s``
    (proxies close idle connections): one timer for all of this process's streams."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._streams: set[SSEResponse] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, stream: SSEResponse) -> None:
        self._streams.add(stream)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sse-keepalive")

    def discard(self, stream: SSEResponse) -> None:
        self._streams.discard(stream)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        # A stream is pinged when its count of sends did not move for a whole interval:
        # quiet for between one and two intervals.
        while True:
            await asyncio.sleep(self.interval_s)
            for stream in list(self._streams):
                if stream.sends == stream.seen_sends and not stream.sending:
                    stream.ping()
                stream.seen_sends = stream.sends


class SSEResponse(Response):
    """A ``text/event-stream`` response relaying ``events`` (each already framed).

    ``cleanup`` runs once when the response ends, however it ends, shielded from
    cancellation, even if ``events`` never started. A client that disconnects cancels the
    request's task, which throws into ``events`` where it waits (the generation stops)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], keepalive: Keepalive,
        cleanup: Callable[[], Awaitable[None]] | None = None, headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        # The raw headers built here, not by Starlette's ``init_headers`` (a body's length to
        # consider, a charset to add to the media type: ~4 µs a stream for the same list).
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()
                            if k.lower() not in _OWN_HEADERS] + _SSE_HEADERS
        self._events = events
        self._keepalive = keepalive
        self._cleanup = cleanup
        self._send: Send | None = None
        self._pings: set[asyncio.Task[None]] = set()
        self.sends = 0
        self.seen_sends = 0
        self.sending = False
        self._open = False

    def map_events(self, wrap: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]) -> None:
        """Send the events through ``wrap`` (a surface's own framing, see
        gateway/surfaces/messages.py); closing what it returns must close what it got."""
        self._events = wrap(self._events)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        watchers: list[asyncio.Task[None]] = []

        def watch() -> None:
            if self._open:
                watchers.append(loop.create_task(self._watch(receive, task, gone)))

        timer = loop.call_later(WATCH_AFTER_S, watch)
        self._send = send
        self._open = True
        self._keepalive.add(self)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # ``[DONE]`` is held back and leaves with the body's end, in one write: every
            # stream ends with it, and its producers end right after it (one write of the
            # few per short request fewer; see loadtest/peers/README.md).
            last = b""
            async for chunk in self._events:
                self.sending = True
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                    last = b""
                if chunk == DONE:
                    last = chunk
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sending = False
                self.sends += 1
            self._open = False
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            # Our own cancellation (the client left) ends the response quietly; any other
            # (shutdown, the server's timeout) goes on up.
            if not gone.done() or task.uncancel() > 0:
                raise
        finally:
            self._open = False
            self._keepalive.discard(self)
            timer.cancel()
            for watcher in watchers:
                watcher.cancel()
            await to_the_end(self._clean_up())

    async def _clean_up(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:  # suspended at a yield if a send failed: run its finally
            await aclose()
        if self._cleanup is not None:
            await self._cleanup()

    async def _watch(self, receive: Receive, task: asyncio.Task[None], gone: asyncio.Future[None]) -> None:
        """Wait for the client to leave; then cancel the stream (once) if it is still open."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._open:
            gone.set_result(None)
            task.cancel()

    def ping(self) -> None:
        if not self._open or self._send is None:
            return
        # A send can wait on a client that does not read: never in the keep-alive's timer.
        ping = asyncio.get_running_loop().create_task(self._ping(self._send))
        self._pings.add(ping)
        ping.add_done_callback(self._pings.discard)

    async def _ping(self, send: Send) -> None:
        if self._open and not self.sending:
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": PING, "more_body": True})
