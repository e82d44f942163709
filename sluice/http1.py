"""A lean HTTP/1.1 client for long streamed responses over plain HTTP: one POST, a body
read chunk by chunk straight from the connection's buffer, keep-alive connections per host.

Used where every streamed token crosses it: the gateway's NDJSON hop to workers, and an
``openai`` worker's stream from the server it fronts. Why not httpx there: profiling a
saturated gateway (64 streams, one process) put a third of its CPU in httpx/httpcore/h11
and their anyio and context-manager wrappers, once per streamed line; the same held for
an ``openai`` worker. Everything else (small JSON calls, ``https://``) stays on httpx.

Each connection is its own asyncio protocol (:class:`_Conn`): the event loop's read
callback appends to one buffer, and the reader parses the chunk framing in place, waiting
on a future only when the buffer holds nothing whole. Through an ``asyncio.StreamReader``
(as before) each streamed chunk also paid the stream reader's feed and wake-up, a ``read()``
coroutine that copied its buffer out, and a second buffer here to parse the framing in (12 %
less gateway CPU per streamed chunk with the change beside it, loadtest/peers/README.md).

Failures are raised as httpx's exception types (``ConnectError``, ``ReadError``,
``RemoteProtocolError``), so callers keep one vocabulary for "the server is gone".

>>> response = await pool.post("http://10.0.0.5:8100", "/internal/generate", body, headers)
>>> response.status_code, [chunk async for chunk in response.aiter_raw()]
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

#: Idle keep-alive connections kept per host.
MAX_IDLE = 64


#: How long the rest of a finished body (its terminating chunk) is waited for, so that the
#: connection goes back to the pool instead of being closed.
DRAIN_S = 0.05


async def drain(response: Http1Response | httpx.Response, raw: AsyncIterator[bytes]) -> None:
    """Read what is left of ``response``'s finished body from its ``raw`` iterator, briefly,
    so that its connection is kept. Mostly its end came in the same read as the last line
    (``Http1Response.ended``): then no timer is needed."""
    if getattr(response, "ended", False):
        async for _ in raw:
            pass
        return
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in raw:
                pass


#: A response head longer than this is no server's.
_MAX_HEAD = 2**20
#: Bytes read ahead of the reader before the connection stops reading (until it reads).
_READ_AHEAD = 2**20


class _Conn(asyncio.Protocol):
    """One connection: what the server sent, in :attr:`buffer` until the reader takes it."""

    __slots__ = ("_loop", "_paused", "_waiter", "buffer", "eof", "error", "key", "transport")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        #: The server closed its side (or the connection broke: :attr:`error`).
        self.eof = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _READ_AHEAD and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def resume(self) -> None:
        """Read again if reading stopped (the read ahead was full)."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    async def fill(self) -> bool:
        """Wait for more bytes than :attr:`buffer` holds: False at the connection's end (the
        error it broke with is raised)."""
        self.resume()
        size = len(self.buffer)
        while len(self.buffer) == size:
            if self.eof:
                if self.error is not None:
                    raise self.error
                return False
            self._waiter = self._loop.create_future()
            await self._waiter
        return True

    def reusable(self) -> bool:
        return not self.eof and not self.buffer and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _read_head(conn: _Conn) -> bytes:
    """The response head, taken out of the buffer (without its blank line)."""
    start = 0
    while True:
        end = conn.buffer.find(b"\r\n\r\n", start)
        if end >= 0:
            head = bytes(conn.buffer[:end])
            del conn.buffer[:end + 4]
            return head
        if len(conn.buffer) > _MAX_HEAD:
            raise ValueError("response head too long")
        start = max(0, len(conn.buffer) - 3)
        if not await conn.fill():
            raise asyncio.IncompleteReadError(bytes(conn.buffer), None)


class Http1Response:
    """A streamed response: ``status_code``, ``headers``, ``aiter_raw()``, ``aread()``, ``aclose()``."""

    def __init__(self, pool: Http1Pool, conn: _Conn, status_code: int, headers: dict[bytes, bytes]) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status_code = status_code
        self.headers = headers
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        length = headers.get(b"content-length")
        #: None: neither chunked nor sized, so the body runs to the connection's end.
        self._length = int(length) if length is not None else (None if not self._chunked else 0)
        self._keep = headers.get(b"connection", b"").lower() != b"close" and self._length is not None
        self._done = False
        #: The body's end has been read: what ``aiter_raw`` has left to give needs no read.
        self.ended = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        buffer = conn.buffer
        try:
            if self._length is None:
                while True:
                    if buffer:
                        data = bytes(buffer)
                        buffer.clear()
                        yield data
                    elif not await conn.fill():
                        break
            elif not self._chunked:
                left = self._length
                while left > 0:
                    if not buffer and not await conn.fill():
                        raise httpx.RemoteProtocolError("the server closed the connection mid-body")
                    if len(buffer) <= left:  # (one copy: slicing, then bytes(), was two)
                        data = bytes(buffer)
                        buffer.clear()
                    else:
                        with memoryview(buffer) as view:
                            data = bytes(view[:left])
                        del buffer[:left]
                    left -= len(data)
                    yield data
            else:
                # The chunk framing is parsed in the connection's buffer as bytes arrive
                # (mostly one whole chunk per read, a streamed token).
                while True:
                    if buffer:
                        payloads, ended = _unchunk(buffer)
                        self.ended = ended
                        for payload in payloads:
                            yield payload  # (more may arrive meanwhile: looked at before waiting)
                        if ended:
                            self._keep = self._keep and not buffer  # bytes after the end: not reusable
                            break
                        if payloads:
                            continue
                    if not await conn.fill():
                        raise asyncio.IncompleteReadError(bytes(buffer), None)
            self._done = True
        except (asyncio.IncompleteReadError, ValueError) as exc:
            raise httpx.RemoteProtocolError(f"the response broke off: {type(exc).__name__}") from None
        except OSError as exc:
            raise httpx.ReadError(f"reading the response failed: {exc}") from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep:
            self._pool.give_back(conn)
        else:
            conn.close()  # closed early: the server sees the disconnect and aborts the request


def _unchunk(buffer: bytearray) -> tuple[list[bytes], bool]:
    """Takes the whole chunks at the start of ``buffer`` out of it: their payloads, and
    whether the terminating chunk was among them (no trailers from our servers). A chunk
    still arriving stays in ``buffer``, read again only from its size line."""
    payloads: list[bytes] = []
    start = 0
    ended = False
    view = memoryview(buffer)
    try:
        while True:
            eol = buffer.find(b"\r\n", start)
            if eol < 0:
                if len(buffer) - start > _MAX_SIZE_LINE:
                    raise ValueError("chunk size line too long")
                break
            size = int(bytes(view[start:eol]).split(b";", 1)[0], 16)
            if size == 0:
                end = buffer.find(b"\r\n", eol + 2)
                if end >= 0:
                    start, ended = end + 2, True
                break
            if len(buffer) < eol + 2 + size + 2:
                break
            payloads.append(bytes(view[eol + 2:eol + 2 + size]))
            start = eol + 2 + size + 2
    finally:
        view.release()  # a bytearray with a view on it cannot be resized
    del buffer[:start]
    return payloads, ended


#: A chunk's size line longer than this is no HTTP server's.
_MAX_SIZE_LINE = 4096
#: URLs whose parts a pool keeps (far more than a fleet's workers).
_MAX_TARGETS = 4096


class Http1Pool:
    """Keep-alive connections by host and port (plain ``http://`` only)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        #: Each URL's host and port, path and ``host`` header, parsed once (workers come and
        #: go: emptied when it reaches :data:`_MAX_TARGETS`).
        self._targets: dict[str, tuple[tuple[str, int], str, str]] = {}

    def give_back(self, conn: _Conn) -> None:
        # A body that ended in what was read ahead left the connection not reading: an idle
        # one must read, or its server's close (or death) goes unseen until it is used.
        conn.resume()
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < MAX_IDLE and conn.reusable():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(key), key[0], key[1])
        except (OSError, TimeoutError) as exc:
            raise httpx.ConnectError(f"cannot connect: {exc or type(exc).__name__}") from None
        return conn

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Http1Response:
        """Send the request and read the response head; the body is read by the caller."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            parts = urlsplit(url)
            target = self._targets[url] = ((parts.hostname or "127.0.0.1", parts.port or 80),
                                           parts.path.rstrip("/"), parts.netloc)
        key, base, netloc = target
        head = (f"POST {base}{path} HTTP/1.1\r\nhost: {netloc}\r\n"
                f"content-length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")
        idle = self._idle.get(key)
        broke: httpx.HTTPError | None = None
        while idle:
            conn = idle.pop()
            if not conn.reusable():
                conn.close()  # closed by its server while idle (its keep-alive timeout, or it went down)
                continue
            # A reused connection the server closed just now fails before any byte of a
            # response: that is safe to try once more on a fresh connection.
            try:
                return await self._exchange(conn, head, body)
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                conn.close()
                broke = exc
            except BaseException:
                conn.close()  # cancelled (a timeout, a client gone): the server sees the request end
                raise
        try:
            conn = await self._connect(key)
        except httpx.ConnectError:
            # The server took the request on a kept connection, broke it, and takes no new
            # one: it went down with the request in it. Told as the broken exchange it was
            # (a whole answer's server dies before its head: gateway/relay/upstream.py counts
            # a lost worker toward a query of death), not as a server never reached.
            if broke is not None:
                raise broke from None
            raise
        try:
            return await self._exchange(conn, head, body)
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes) -> Http1Response:
        try:
            if conn.transport is None or conn.transport.is_closing():
                raise ConnectionResetError("the connection is closed")
            conn.transport.write(head + body)  # buffered by the loop as the socket takes it
            # The whole head in one search of the buffer, not one read per header line.
            status_line, *lines = (await _read_head(conn)).split(b"\r\n")
            headers: dict[bytes, bytes] = {}
            for line in lines:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            status = int(status_line.split(b" ", 2)[1])
        except (asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            raise httpx.RemoteProtocolError(f"bad response head: {type(exc).__name__}") from None
        except OSError as exc:
            raise httpx.ReadError(f"the connection failed: {exc}") from None
        return Http1Response(self, conn, status, headers)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                with contextlib.suppress(Exception):
                    conn.close()
        self._idle.clear()
