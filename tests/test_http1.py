"""sluice/http1.py against a loopback server that answers each request with given bytes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.embedded_redis import free_port
from sluice import http1
from sluice.http1 import Http1Pool, _unchunk, drain

CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
SIZED = b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found"
TO_EOF = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"
BROKEN = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel"


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[bytes], list[int]]]:
    """(url, answers to give in turn, connection count)."""
    answers: list[bytes] = []
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                answer = answers.pop(0)
                writer.write(answer)
                await writer.drain()
                if answer in (TO_EOF, BROKEN):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    port = free_port()
    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}", answers, connections
    srv.close()


async def test_chunked_bodies_and_keep_alive(server) -> None:
    url, answers, connections = server
    pool = Http1Pool(connect_timeout_s=1)
    answers += [CHUNKED, SIZED]
    first = await pool.post(url, "/x", b"{}", {"content-type": "application/json"})
    assert first.status_code == 200 and [c async for c in first.aiter_raw()] == [b"hello", b" world"]
    await first.aclose()
    second = await pool.post(url, "/x", b"{}", {})
    assert (second.status_code, await second.aread()) == (404, b"not found")
    await second.aclose()
    assert connections[0] == 1  # the finished first response gave its connection back
    await pool.aclose()


async def test_a_drained_body_keeps_its_connection_and_a_stalled_one_costs_at_most_the_drain(
    server, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``drain`` (the gateway's worker hop and the engine relay, once the last line came):
    a body whose end is read already is finished without a timer and its connection reused;
    one whose end never comes is given up after ``DRAIN_S``. (The drain is lengthened here so
    that the bounds tell a timer from no timer on a loaded machine: at 50 ms, one pause of the
    test process was enough to fail it.)"""
    monkeypatch.setattr(http1, "DRAIN_S", 2.0)
    url, answers, connections = server
    pool = Http1Pool(connect_timeout_s=1)
    answers += [CHUNKED, CHUNKED]
    response = await pool.post(url, "/x", b"", {})
    raw = response.aiter_raw()
    assert await anext(raw) == b"hello" and response.ended
    started = time.monotonic()
    await drain(response, raw)
    await response.aclose()
    assert time.monotonic() - started < 1.0  # no timer waited
    second = await pool.post(url, "/x", b"", {})
    assert [c async for c in second.aiter_raw()] == [b"hello", b" world"]
    await second.aclose()
    assert connections[0] == 1
    answers.append(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")  # no end
    stalled = await pool.post(url, "/x", b"", {})
    raw = stalled.aiter_raw()
    assert await anext(raw) == b"hello" and not stalled.ended
    monkeypatch.setattr(http1, "DRAIN_S", 0.5)
    started = time.monotonic()
    await drain(stalled, raw)
    assert 0.45 <= time.monotonic() - started < 1.9
    await stalled.aclose()
    await pool.aclose()


async def test_a_response_says_when_its_end_is_read(server) -> None:
    """``ended``: the terminating chunk came with the last payload, so the engine relay reads
    the rest without a timer; it is false while the end is still to come."""
    url, answers, _ = server
    pool = Http1Pool(connect_timeout_s=1)
    answers.append(CHUNKED)
    response = await pool.post(url, "/x", b"", {})
    chunks = response.aiter_raw()
    assert not response.ended
    assert await anext(chunks) == b"hello" and response.ended  # one read brought the whole body
    await response.aclose()
    answers.append(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    response = await pool.post(url, "/x", b"", {})
    assert await anext(response.aiter_raw()) == b"hello" and not response.ended
    await response.aclose()
    await pool.aclose()


async def test_a_body_without_length_runs_to_the_end(server) -> None:
    url, answers, _ = server
    pool = Http1Pool(connect_timeout_s=1)
    answers.append(TO_EOF)
    response = await pool.post(url, "/x", b"", {})
    assert await response.aread() == b"until the end"
    await response.aclose()
    await pool.aclose()


async def test_failures_are_httpx_errors(server) -> None:
    url, answers, connections = server
    pool = Http1Pool(connect_timeout_s=1)
    answers.append(BROKEN)
    response = await pool.post(url, "/x", b"", {})
    with pytest.raises(httpx.RemoteProtocolError):
        await response.aread()
    await response.aclose()
    with pytest.raises(httpx.ConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}", "/x", b"", {})
    # A response closed before its end is not reused: the server must see the disconnect.
    answers += [CHUNKED, CHUNKED]
    early = await pool.post(url, "/x", b"", {})
    await anext(early.aiter_raw())
    await early.aclose()
    later = await pool.post(url, "/x", b"", {})
    await later.aread()
    await later.aclose()
    assert connections[0] == 3
    await pool.aclose()


async def _serve(handle) -> tuple[str, asyncio.AbstractServer]:  # type: ignore[no-untyped-def]
    port = free_port()
    return f"http://127.0.0.1:{port}", await asyncio.start_server(handle, "127.0.0.1", port)


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")  # (the tests below send no body)


async def _answer_then_take_another(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a first request on the connection, then read a second one and leave it unanswered."""
    await _read_request(reader)
    writer.write(SIZED)
    await writer.drain()
    await _read_request(reader)


async def test_a_kept_connection_its_server_closed_while_idle_is_left_for_a_new_one() -> None:
    """A server's keep-alive timeout (or its end) closed the idle connection: the next
    request goes out on a new one, without first failing on the old one."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(SIZED)
        await writer.drain()
        writer.close()  # an answer of known length, then the connection closed while idle

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    for _ in range(2):
        response = await pool.post(url, "/x", b"", {})
        assert await response.aread() == b"not found"
        await response.aclose()
        await asyncio.sleep(0.05)  # the server's close arrives
    assert connections == 2
    await pool.aclose()
    srv.close()
    await srv.wait_closed()


async def test_a_server_that_goes_down_with_the_request_in_it_broke_the_exchange() -> None:
    """The request went out on a kept connection, and its server went down before answering
    (a whole answer's server dies before its head): a broken exchange, not a server never
    reached, though a new connection is refused too (gateway/relay/upstream.py counts the
    first as a worker lost with the request)."""
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _answer_then_take_another(reader, writer)
        served += 1
        srv.close()  # the second request arrived; the server goes down
        writer.transport.abort()
        writer.close()

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    first = await pool.post(url, "/x", b"", {})
    await first.aread()
    await first.aclose()
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        await pool.post(url, "/x", b"", {})
    with pytest.raises(httpx.ConnectError):  # a server that is simply not there
        await pool.post(url, "/x", b"", {})
    assert served == 1
    await pool.aclose()
    await srv.wait_closed()


async def test_a_request_cancelled_on_a_kept_connection_closes_it() -> None:
    """A timeout (or a client gone) while a kept connection waits for its answer closes it,
    so the server sees the request end and can stop its work."""
    ended = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_then_take_another(reader, writer)  # the second is never answered
        if await reader.read() == b"":
            ended.set()
        writer.close()

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    first = await pool.post(url, "/x", b"", {})
    await first.aread()
    await first.aclose()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pool.post(url, "/x", b"", {}), 0.2)
    await asyncio.wait_for(ended.wait(), 2)
    await pool.aclose()
    srv.close()
    await srv.wait_closed()


def test_chunk_framing_across_reads() -> None:
    """A chunked body's framing parsed from reads that split it anywhere (a size line, its
    extension, the data, the terminating chunk) or bring several chunks at once."""
    body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
    for step in (1, 2, 3, 7, len(body)):
        buffer, payloads, ended = bytearray(), [], False
        for start in range(0, len(body), step):
            assert not ended
            buffer += body[start:start + step]
            got, ended = _unchunk(buffer)
            payloads += got
        assert (payloads, ended, bytes(buffer)) == ([b"hello", b" world"], True, b"")
    with pytest.raises(ValueError):
        _unchunk(bytearray(b"zz\r\n"))


async def _kept_until_the_client_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                       handled: asyncio.Event) -> None:
    """A server's end of a connection it keeps after its answer, until the client closes it."""
    await reader.read()
    writer.close()
    await writer.wait_closed()
    handled.set()


async def _close_all(pool: Http1Pool, handled: asyncio.Event, srv: asyncio.AbstractServer) -> None:
    await pool.aclose()
    await asyncio.wait_for(handled.wait(), 2)  # the server saw the pool close its connection
    srv.close()
    await srv.wait_closed()


async def test_chunks_that_arrive_while_the_reader_is_away_are_read_without_waiting() -> None:
    """The connection's buffer fills while its reader is busy elsewhere (a slow client): the
    chunks and the body's end already there are read at once, not after more bytes that the
    server never sends (it keeps the connection open)."""
    more, handled = asyncio.Event(), asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await more.wait()
        writer.write(b"6\r\nsecond\r\n5\r\nthird\r\n0\r\n\r\n")  # then nothing, connection kept
        await writer.drain()
        await _kept_until_the_client_closes(reader, writer, handled)

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    response = await pool.post(url, "/x", b"", {})
    chunks = response.aiter_raw()
    assert await anext(chunks) == b"first"
    more.set()
    await asyncio.sleep(0.2)  # the rest arrives while nobody reads

    async def rest() -> list[bytes]:
        return [chunk async for chunk in chunks]  # the same reader, where it left off

    assert await asyncio.wait_for(rest(), 1) == [b"second", b"third"]
    assert response.ended
    await response.aclose()
    await _close_all(pool, handled, srv)


async def test_a_body_larger_than_the_read_ahead_arrives_whole_to_a_slow_reader() -> None:
    """A server sends more than the connection reads ahead (the connection stops reading,
    and reads again as its reader takes the bytes): every byte arrives, in order."""
    size = 3 * http1._READ_AHEAD + 12345
    body = bytes(i % 251 for i in range(size))
    handled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + body)
        await writer.drain()
        await _kept_until_the_client_closes(reader, writer, handled)

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    response = await pool.post(url, "/x", b"", {})
    got = bytearray()
    async for data in response.aiter_raw():
        got += data
        await asyncio.sleep(0.01)
    assert bytes(got) == body
    await response.aclose()
    await _close_all(pool, handled, srv)


async def test_a_connection_back_from_a_body_read_ahead_still_sees_its_server_go() -> None:
    """A body that filled the read ahead (the connection stopped reading) and ended in it:
    the connection goes back to the pool reading again, so its server's end is seen while it
    is idle, and a request after the server went down is told it cannot connect, not that a
    kept connection broke (a lost worker, where none was lost)."""
    size = http1._READ_AHEAD + 1000  # the read that passes the read ahead brings the end
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + bytes(size))
        await writer.drain()
        await reader.read()

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    response = await pool.post(url, "/x", b"", {})
    await asyncio.sleep(0.3)  # all of it sent; the connection has stopped reading
    assert len(await response.aread()) == size
    await response.aclose()  # back to the pool
    srv.close()
    for writer in writers:
        writer.close()
    await srv.wait_closed()
    await asyncio.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        await pool.post(url, "/x", b"", {})
    await pool.aclose()


async def test_a_reader_that_does_not_read_holds_at_most_the_read_ahead() -> None:
    """What one response can make the process hold: a server sending far more than its reader
    takes fills the connection's buffer to the read ahead (and one read past it), no more."""
    size = 8 * http1._READ_AHEAD
    handled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        try:
            for _ in range(8):  # until the client closes the connection (a reset)
                writer.write(bytes(http1._READ_AHEAD))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            handled.set()

    url, srv = await _serve(handle)
    pool = Http1Pool(connect_timeout_s=1)
    response = await pool.post(url, "/x", b"", {})
    await asyncio.sleep(0.5)  # the server writes all it can; nobody reads
    conn = response._conn
    assert conn is not None and http1._READ_AHEAD < len(conn.buffer) <= http1._READ_AHEAD + 256 * 1024
    await response.aclose()  # closed before its end: not kept
    await _close_all(pool, handled, srv)
