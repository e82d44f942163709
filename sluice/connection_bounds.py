"""Bounds on what a client's connections hold, for every HTTP server of Sluice (the gateway's,
the worker's): uvicorn's httptools protocol, with a largest head, a longest wait for one, and a
most connections a process keeps open.

**A request's head.** uvicorn bounds neither its size nor its time. Measured on a gateway
(``sluice up --engine sim``, one process): one client that sent a single header without end held
the process's event loop. Its parser joins a header's pieces as they come, and the cost grows
with the header: 200 MiB took 42 s to send, 400 MiB 201 s, and meanwhile ``GET /v1/models`` took
38-50 s or answered 503. Nor does uvicorn time a head out: its keep-alive timer runs only between
requests, so a connection that sends nothing, or a byte now and then, is held for ever (a
descriptor and a parser each). Here a head still incomplete after :attr:`ConnectionBounds.max_bytes`
bytes is answered 431 and the connection closed; a head not complete
:attr:`ConnectionBounds.timeout_s` after the connection opened (its first request) or after its
first byte (the requests after) is answered 408 (or, if nothing of it came, the connection is just
closed). A client that sent a head in time waits on nothing of this: the body and the response
have bounds of their own (the gateway's body limit, the request's deadline).

**A request's body.** Once its head is in, a body must come at
:attr:`ConnectionBounds.min_bytes_per_s` on average after a first ``timeout_s`` of slack,
else it is answered ``408 request_body_timeout`` and the connection closed (the route reading
it finds its client gone). A request in flight is never closed for a newcomer (below), and the
request's own deadline (up to an hour, as the client asks) bounded its body before: a client
trickling bodies could hold every connection a process keeps.

**A response the client does not take.** A process held each answer its client was not
reading in its memory for as long as the client kept the connection: 40 such clients of
10.7 MB answers (``n=16``, 500 tokens, ``top_logprobs=20``) grew a gateway by 480 MB. Once a
response's transport pauses (more than 64 KiB not taken), the client must take it at
:attr:`ConnectionBounds.min_bytes_per_s` on average after ``timeout_s`` of slack, and the
responses held for such clients stay under :attr:`ConnectionBounds.max_unsent_bytes` in all
(the largest cut first); a cut connection is dropped with what it held (its request, if still
in flight, finds its client gone, which frees its engine). A body the app writes in parts (a
large embeddings answer, gateway/relay/pooling.py) counts whole: what the app still holds of
it (:meth:`BoundedProtocol.hold_unsent`) with what the transport does, its client's rate
judged from its first pause to its end.

**Connections.** Each costs a process a descriptor and ~9 KB. Measured on a gateway (one
process, descriptors limited to 20,000, as on this project's machines): one client opening
idle connections took every descriptor at about 20,000 (196 MB); from then on every other
client's connection was reset, and a stream in flight could open no connection to a worker,
for as long as the client kept reopening them (each idle one lived 30 s). Now a process keeps
at most :attr:`ConnectionBounds.max_connections` client connections (by default half its
descriptors: a stream in flight holds one to its worker too). A connection past that closes the
one that has waited longest without a request in flight: opened and silent, kept alive between
two requests (HTTP lets a server close it, and the SDKs reconnect), or with a request still
coming (a head or body not yet whole). A client trickling requests on many connections,
reopening each as it is cut, so loses its own, older than any other client's pause between two
requests. Only when every connection has a request in flight is the new one answered
``503 too_many_connections`` with ``Retry-After`` and closed. A request in flight is never
given up for a newcomer.

**Pipelined requests.** uvicorn queues each request pipelined behind one in flight (a cycle
and its scope) and parses every request of a read at once (~7,700 tiny ones in 256 KiB); its
pause of reading does not hold, as each response's end reads on. A review measured one
connection pipelining ``GET /health`` queue 212,992 requests in 3.5 s, the gateway's memory
76 -> 250 MB. No SDK pipelines. Past :data:`MAX_PIPELINED` requests waiting on one connection,
its parsing stops and the connection is closed (what is under way is cut): each connection holds
at most that many.

Cost: a counter a read while a head or body is coming, and a few dict entries a request; one
timer a second per process while heads, bodies or slow clients are awaited sweeps the overdue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import socket
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sluice.errors import BodyTimedOut, HeadTimedOut, HeadTooLarge, SluiceError, Unavailable

log = logging.getLogger("sluice.http")

#: Bytes of an incomplete head past which it is refused (the gateway's
#: ``SLUICE_GATEWAY_MAX_HEAD_BYTES``). The SDKs' heads are 0.5-2 KiB.
MAX_HEAD_BYTES = 64 * 1024
#: Seconds a head may take (``SLUICE_GATEWAY_HEAD_TIMEOUT_S``).
HEAD_TIMEOUT_S = 30.0
#: Bytes a second a request's body must average once its head is in, and a response once the
#: client stopped taking it as fast as it comes, after a first ``HEAD_TIMEOUT_S`` of slack:
#: 16 KiB/s is a 128 kbit/s link. A client trickling a body holds its connection at most
#: HEAD_TIMEOUT_S + body limit / this (the gateway's 4 MiB: 4.8 min).
MIN_BYTES_PER_S = 16 * 1024
#: Bytes of responses a process holds for clients that do not take them, at most: past it
#: the connection holding most is cut (the gateway's ``SLUICE_GATEWAY_MAX_UNSENT_BYTES``).
MAX_UNSENT_BYTES = 256 * 2**20
#: How often overdue heads, bodies and responses are looked for.
SWEEP_S = 1.0
#: Descriptors a process keeps for anything but connections (Redis, logs, its own files).
SPARE_DESCRIPTORS = 64
#: SO_LINGER on, for 0 s: closing the socket resets the connection.
_RESET = struct.pack("ii", 1, 0)
#: At most one log line in this many seconds about connections closed or refused at the bound.
TELL_EVERY_S = 10.0


def openai_error(exc: SluiceError, path: bytes) -> bytes:
    """A refusal's body: OpenAI's error shape, whatever the path."""
    return orjson.dumps(exc.body())


def descriptors() -> int:
    """This process's limit on open descriptors, raised first to the most it may have (a
    soft limit below the hard one is a default of the shell, not a choice of the operator)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(limit: int) -> int:
    """Client connections a process with ``limit`` descriptors keeps: half of what the spare
    leaves, since a stream in flight holds a connection to its worker as well."""
    return max(16, (limit - SPARE_DESCRIPTORS) // 2)


@dataclass(frozen=True)
class ConnectionBounds:
    max_bytes: int = MAX_HEAD_BYTES
    timeout_s: float = HEAD_TIMEOUT_S
    #: The refusal's JSON body from the error and the path read so far (the gateway answers
    #: each API's routes in that API's shape).
    render: Callable[[SluiceError, bytes], bytes] = openai_error
    #: Client connections one process keeps open; 0: :func:`default_max_connections` of its
    #: descriptors (the gateway's ``SLUICE_GATEWAY_MAX_CONNECTIONS``).
    max_connections: int = 0
    #: Bytes a second a request's body, and a response a client is slow to take, must average
    #: after ``timeout_s`` of slack.
    min_bytes_per_s: int = MIN_BYTES_PER_S
    #: Bytes of responses the process holds for clients that are not taking them, at most.
    max_unsent_bytes: int = MAX_UNSENT_BYTES
    #: Whether clients slow to take responses are cut (at ``min_bytes_per_s``, and past
    #: ``max_unsent_bytes``; a body's rate holds either way). A worker's
    #: clients are gateways, which stop reading a stream while their own client is slow to
    #: take it: the gateway bounds that client, and its worker waits.
    cut_slow_readers: bool = True


def protocol(bounds: ConnectionBounds) -> Callable[..., HttpToolsProtocol]:
    """What ``uvicorn.Config(http=...)`` takes: the bounded protocol with these bounds."""
    if not bounds.max_connections:
        bounds = replace(bounds, max_connections=default_max_connections(descriptors()))
    return functools.partial(BoundedProtocol, bounds=bounds)


class _Watch:
    """One event loop's connections whose head or body is awaited, by deadline, and those with
    no request in flight, longest first. One timer looks for the overdue every :data:`SWEEP_S`
    while any is awaited. (It keeps no reference to its loop, the key it is kept under.)"""

    def __init__(self) -> None:
        self._due: dict[BoundedProtocol, float] = {}  # few: connections whose head or body is coming
        #: No request in flight (idle, or one still coming), in the order they became so.
        self.waiting: dict[BoundedProtocol, None] = {}
        #: Connections whose client takes their response slower than it comes (their transport
        #: paused writing): when that began, and the bytes it held then.
        self.paused: dict[BoundedProtocol, tuple[float, int]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._shed = {"closed": 0, "refused": 0, "cut": 0}
        #: Told each connection closed, refused or cut at a bound (a metric's counter).
        self.on_shed: Callable[[str], None] | None = None
        self._quiet_until: dict[str, float] = {}

    def add(self, conn: BoundedProtocol, due: float) -> None:
        """Await ``conn``'s head or body until ``due``, unless it is already awaited."""
        self.move(conn, self._due.get(conn, due))

    def move(self, conn: BoundedProtocol, due: float) -> None:
        self._due[conn] = due
        self._arm(conn.loop)

    def pause(self, conn: BoundedProtocol) -> None:
        if conn not in self.paused:  # (a response written in parts is judged from its first pause)
            self.paused[conn] = (conn.loop.time(), conn.unsent())
        self._arm(conn.loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(SWEEP_S, self._sweep)

    def arrived(self, conn: BoundedProtocol) -> None:
        """A head or a whole request came: nothing of it is awaited any more."""
        self._due.pop(conn, None)

    def in_flight(self, conn: BoundedProtocol) -> None:
        """A whole request came: nothing of it is awaited, and the connection is never closed
        for a newcomer until its response is complete."""
        self._due.pop(conn, None)
        self.waiting.pop(conn, None)

    def discard(self, conn: BoundedProtocol) -> None:
        self._due.pop(conn, None)
        self.waiting.pop(conn, None)
        self.paused.pop(conn, None)

    def make_room(self) -> BoundedProtocol | None:
        """Close the connection that has waited longest without a request in flight, if any,
        for a newcomer."""
        while self.waiting:
            conn = next(iter(self.waiting))
            self.discard(conn)
            if not conn.transport.is_closing():
                conn.transport.close()
                return conn
        return None

    def tell(self, what: str, conn: BoundedProtocol) -> None:
        """Count a connection closed, refused or cut at a bound; say so at most every
        :data:`TELL_EVERY_S` for each kind of bound (a client opening connections in a loop
        is not a line each; the next line has what the quiet time counted)."""
        self._shed[what] += 1
        if self.on_shed is not None:
            self.on_shed(what)
        topic = "cut" if what == "cut" else "connections"
        now = time.monotonic()
        if now < self._quiet_until.get(topic, 0.0):
            return
        self._quiet_until[topic] = now + TELL_EVERY_S
        peer, bounds = "%s:%d" % conn.client if conn.client else "a client", conn.bounds
        if topic == "cut":
            log.warning("%d connections cut whose client took its response slower than %d bytes a second "
                        "after %g s, or held the most of this process's %d bytes of responses not taken, since "
                        "the last such line; the last to %s", self._shed["cut"], bounds.min_bytes_per_s,
                        bounds.timeout_s, bounds.max_unsent_bytes, peer)
            self._shed["cut"] = 0
            return
        log.warning("this process holds its most connections (%d): %d connections idle or with a request "
                    "still coming closed for newcomers "
                    "and %d newcomers refused (503, every connection had a request in flight) since the last "
                    "such line; the last from %s", bounds.max_connections, self._shed["closed"],
                    self._shed["refused"], peer)
        self._shed["closed"] = self._shed["refused"] = 0

    def _sweep(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [conn for conn, due in self._due.items() if due <= now]:
            del self._due[conn]
            conn.overdue()
        if self.paused:
            self._cut_slow_readers(now)
        if self._due or self.paused:
            self._timer = loop.call_later(SWEEP_S, self._sweep)

    def _cut_slow_readers(self, now: float) -> None:
        """Cut the connections whose client takes its response slower than the least rate after
        the slack, then, while the responses held for the others pass the process's bound,
        the one holding most. (A client that reads nothing held its response in this process's
        memory as long as it kept the connection: 40 such clients of 10.7 MB answers, 480 MB.)"""
        held: list[tuple[int, BoundedProtocol]] = []
        for conn, (since, at_pause) in list(self.paused.items()):
            size = conn.unsent()
            bounds = conn.bounds
            if now > since + bounds.timeout_s + max(0, at_pause - size) / bounds.min_bytes_per_s:
                conn.cut()
            else:
                held.append((size, conn))
        if not held:
            return
        total, bound = sum(size for size, _ in held), held[0][1].bounds.max_unsent_bytes
        for size, conn in sorted(held, key=lambda pair: pair[0], reverse=True):
            if total <= bound:
                break
            conn.cut()
            total -= size


_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = weakref.WeakKeyDictionary()


#: Requests pipelined on one connection, waiting behind the one in flight, that it may hold.
MAX_PIPELINED = 16


class _PipelineFull(Exception):
    """Raised in the parser's callback: httptools stops parsing the read at once."""


#: The scope's key of a weak reference to the request's :class:`BoundedProtocol`
#: (:meth:`BoundedProtocol.hold_unsent`): the protocol holds its last scope, and a strong one
#: left each closed connection (protocol, transport, scope) to the cyclic collector.
CONNECTION = "sluice.connection"


def _watch_of(loop: asyncio.AbstractEventLoop) -> _Watch:
    watch = _WATCHES.get(loop)
    if watch is None:
        watch = _WATCHES[loop] = _Watch()
    return watch


def count_shed(on_shed: Callable[[str], None]) -> None:
    """Tell ``on_shed`` ("closed", "refused" or "cut") of each connection this event loop's
    servers close for a newcomer, refuse or cut at their bounds. Call it on the loop."""
    _watch_of(asyncio.get_running_loop()).on_shed = on_shed


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's protocol; a request's head is counted and timed until it is complete, its
    body timed, and the connections kept open are bounded."""

    def __init__(self, *args: Any, bounds: ConnectionBounds, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bounds = bounds
        self._in_head = True  # what comes next is a head (none has begun, or the last message ended)
        self._head_bytes = 0
        self._heard = False  # a byte of the awaited head came
        self._in_body = False  # a head is in, its body (if any) not yet whole
        self._body_from = 0.0  # when the body's wait began: its head's end
        self._body_bytes = 0  # bytes read since
        self._watch = _watch_of(self.loop)
        self._pipelined_past = False  # more than MAX_PIPELINED requests came waiting
        #: Bytes of the response under way that its app holds still, to write in parts
        #: (:meth:`hold_unsent`): counted as the transport's.
        self._unsent_in_app = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.bounds.max_connections:
            if self._watch.make_room() is None:
                self._watch.tell("refused", self)
                self._refuse(Unavailable(
                    f"this server holds its most connections ({self.bounds.max_connections}), each with a "
                    "request in flight; retry shortly", code="too_many_connections", retry_after_s=1), quiet=True)
                return
            self._watch.tell("closed", self)
        self._watch.add(self, self.loop.time() + self.bounds.timeout_s)
        self._watch.waiting[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._watch.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        elif self._in_body:
            self._body_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.bounds.max_bytes and not self.transport.is_closing():
            self._refuse(HeadTooLarge(f"the request's head exceeds the {self.bounds.max_bytes}-byte limit"))
        elif self._in_body:  # its bytes buy it time, at the least rate taken
            self._watch.move(self, self._body_from + self.bounds.timeout_s
                             + self._body_bytes / self.bounds.min_bytes_per_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._heard = True
        # The first request's wait began with the connection; a later one's with its first byte.
        self._watch.add(self, self.loop.time() + self.bounds.timeout_s)

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            self._pipelined_past = True
            raise _PipelineFull  # out of feed_data: uvicorn's data_received answers it (send_400_response)
        self.scope[CONNECTION] = weakref.ref(self)  # (the scope of the request whose head this is)
        # A body not whole once this read is parsed is awaited from here (data_received):
        # most come with their head, and cost no entry.
        self._in_head = False
        self._heard = False
        self._in_body = True
        self._body_from = self.loop.time()
        self._body_bytes = 0
        self._watch.arrived(self)
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._pipelined_past:
            super().send_400_response(msg)
            return
        self._refuse(Unavailable(f"more than {MAX_PIPELINED} requests pipelined on one connection",
                                 code="too_many_pipelined", retry_after_s=1))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_body = False
        self._watch.in_flight(self)
        self._in_head = True
        self._head_bytes = 0

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.bounds.cut_slow_readers:
            self._watch.pause(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self._unsent_in_app:  # else its client still owes the rest, at the same rate
            self._watch.paused.pop(self, None)

    def unsent(self) -> int:
        """Bytes of responses its client has not taken yet: the transport's, and what the app
        holds still of the one under way."""
        return self.transport.get_write_buffer_size() + self._unsent_in_app

    def hold_unsent(self, size: int) -> None:
        """The app holds ``size`` bytes of the response under way that it has not written yet
        (it writes a large body in parts, each once the client took the last): the bounds on
        what clients leave unread count them (the largest cut first past the process's bound,
        a client cut that takes them slower than the least rate); 0 once all are written."""
        self._unsent_in_app = size
        if not size and not self.flow.write_paused:
            self._watch.paused.pop(self, None)

    async def writable(self, scope: dict[str, Any]) -> bool:
        """Whether the app may write the next part of the response of ``scope``'s request: once
        the transport takes writes (a paused one drained), True; False if the connection is
        closing (its client left, or was cut), which uvicorn's cycle is told at once: it learns
        it at ``connection_lost``, a loop turn or more later, and logs an app that ends its
        response short meanwhile as an error."""
        if self.flow.write_paused:
            await self.flow.drain()
        if not self.transport.is_closing():
            return True
        cycle = self.cycle
        if cycle is not None and cycle.scope is scope and not cycle.response_complete:
            cycle.disconnected = True
        return False

    def cut(self) -> None:
        """Drop what the client did not take, and the connection (a request in flight finds
        its client gone): reset, so that the kernel drops what its send buffer held for the
        client too (closed, it would go on offering it to a client that takes nothing)."""
        self._watch.discard(self)
        self._watch.tell("cut", self)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:
                pass
        self.transport.abort()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None and not self.transport.is_closing():
            self._watch.waiting[self] = None  # kept alive, no request pipelined behind this one

    def overdue(self) -> None:
        if self.transport.is_closing():
            return
        if self._in_body:
            self._refuse(BodyTimedOut(
                f"the request's body came slower than {self.bounds.min_bytes_per_s} bytes a second "
                f"after its first {self.bounds.timeout_s:g}s"), body=True)
        elif not self._heard:
            self.transport.close()  # nothing came: nobody to answer
        else:
            self._refuse(HeadTimedOut(f"the request's head did not arrive within {self.bounds.timeout_s:g}s"))

    def _refuse(self, exc: SluiceError, quiet: bool = False, body: bool = False) -> None:
        """Answer ``exc`` and close. ``body``: the refused request is the current one (its body
        is late), which the app then finds its client gone; else a response under way (to the
        request before a pipelined head) is only cut."""
        self._watch.discard(self)
        if not quiet:
            log.warning("%d to %s: %s", exc.status, "%s:%d" % self.client if self.client else "a client",
                        exc.message)
        cycle = self.cycle
        if cycle is not None and (cycle.response_started if body else not cycle.response_complete):
            self.transport.close()  # a response is under way, or was sent: no second one in its bytes
            return
        if body and cycle is not None:
            cycle.disconnected = True  # the app's receive() says so; its send() writes nothing
            cycle.message_event.set()
        payload = self.bounds.render(exc, getattr(self, "url", b""))
        headers = b"".join(b"%s: %s\r\n" % (k.lower().encode(), v.encode()) for k, v in exc.headers().items())
        self.transport.write(b"".join((
            STATUS_LINE[exc.status], b"content-type: application/json\r\n", headers,
            b"content-length: %d\r\n" % len(payload), b"connection: close\r\n\r\n", payload)))
        self.transport.close()
