"""Bounds on a request's head, for every HTTP server of Sluice (the gateway's, the worker's):
uvicorn's httptools protocol, with a largest head and a longest wait for one.

uvicorn bounds neither. Measured on a gateway (``sluice up --engine sim``, one process): one
client that sent a single header without end held the process's event loop. Its parser joins a
header's pieces as they come, and the cost grows with the header: 200 MiB took 42 s to send,
400 MiB 201 s, and meanwhile ``GET /v1/models`` took 38-50 s or answered 503. Nor does uvicorn
time a head out: its keep-alive timer runs only between requests, so a connection that sends
nothing, or a byte now and then, is held for ever (a descriptor and a parser each).

Here a head still incomplete after :attr:`HeadBounds.max_bytes` bytes is answered 431 and
the connection closed; a head not complete :attr:`HeadBounds.timeout_s` after the
connection opened (its first request) or after its first byte (the requests after) is
answered 408 (or, if nothing of it came, the connection is just closed). A client that sent a
head in time waits on nothing of this: the body and the response have bounds of their own
(the gateway's body limit, the request's deadline).

Cost: a counter a read while a head is coming, and an entry in one dict a request; one
timer a second per process while heads are awaited sweeps the overdue ones.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sluice.errors import HeadTimedOut, HeadTooLarge, SluiceError

log = logging.getLogger("sluice.http")

#: Bytes of an incomplete head past which it is refused (the gateway's
#: ``SLUICE_GATEWAY_MAX_HEAD_BYTES``). The SDKs' heads are 0.5-2 KiB.
MAX_HEAD_BYTES = 64 * 1024
#: Seconds a head may take (``SLUICE_GATEWAY_HEAD_TIMEOUT_S``).
HEAD_TIMEOUT_S = 30.0
#: How often overdue heads are looked for.
SWEEP_S = 1.0


def openai_error(exc: SluiceError, path: bytes) -> bytes:
    """A refusal's body: OpenAI's error shape, whatever the path."""
    return orjson.dumps(exc.body())


@dataclass(frozen=True)
class HeadBounds:
    max_bytes: int = MAX_HEAD_BYTES
    timeout_s: float = HEAD_TIMEOUT_S
    #: The refusal's JSON body from the error and the path read so far (the gateway answers
    #: each API's routes in that API's shape).
    render: Callable[[SluiceError, bytes], bytes] = openai_error


def protocol(bounds: HeadBounds) -> Callable[..., HttpToolsProtocol]:
    """What ``uvicorn.Config(http=...)`` takes: the bounded protocol with these bounds."""
    return functools.partial(BoundedHeadProtocol, bounds=bounds)


class _Overdue:
    """The connections of one event loop whose head is awaited, by deadline; one timer
    looks for the overdue every :data:`SWEEP_S` while any is awaited. (It keeps no reference
    to its loop, the key it is kept under.)"""

    def __init__(self) -> None:
        self._due: dict[BoundedHeadProtocol, float] = {}  # few: connections whose head is coming
        self._timer: asyncio.TimerHandle | None = None

    def add(self, conn: BoundedHeadProtocol, due: float) -> None:
        self._due.setdefault(conn, due)
        if self._timer is None:
            self._timer = conn.loop.call_later(SWEEP_S, self._sweep)

    def discard(self, conn: BoundedHeadProtocol) -> None:
        self._due.pop(conn, None)

    def _sweep(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [conn for conn, due in self._due.items() if due <= now]:
            del self._due[conn]
            conn.head_overdue()
        if self._due:
            self._timer = loop.call_later(SWEEP_S, self._sweep)


_OVERDUE: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Overdue] = weakref.WeakKeyDictionary()


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's protocol; a request's head is counted and timed until it is complete."""

    def __init__(self, *args: Any, bounds: HeadBounds, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bounds = bounds
        self._in_head = True  # what comes next is a head (none has begun, or the last message ended)
        self._head_bytes = 0
        self._heard = False  # a byte of the awaited head came
        overdue = _OVERDUE.get(self.loop)
        if overdue is None:
            overdue = _OVERDUE[self.loop] = _Overdue()
        self._overdue = overdue

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._overdue.add(self, self.loop.time() + self._bounds.timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._overdue.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self._bounds.max_bytes and not self.transport.is_closing():
            self._refuse(HeadTooLarge(f"the request's head exceeds the {self._bounds.max_bytes}-byte limit"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._heard = True
        # The first request's wait began with the connection; a later one's with its first byte.
        self._overdue.add(self, self.loop.time() + self._bounds.timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heard = False
        self._overdue.discard(self)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0

    def head_overdue(self) -> None:
        if self.transport.is_closing():
            return
        if not self._heard:
            self.transport.close()  # nothing came: nobody to answer
            return
        self._refuse(HeadTimedOut(f"the request's head did not arrive within {self._bounds.timeout_s:g}s"))

    def _refuse(self, exc: SluiceError) -> None:
        self._overdue.discard(self)
        log.warning("%d to %s: %s", exc.status, "%s:%d" % self.client if self.client else "a client", exc.message)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is under way (a pipelined head): no second one in its bytes
            return
        body = self._bounds.render(exc, getattr(self, "url", b""))
        self.transport.write(b"".join((
            STATUS_LINE[exc.status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body)))
        self.transport.close()
