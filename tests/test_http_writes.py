"""A response's head leaves in the same write as the body written in the same turn
(sluice/http_writes.py), and nothing is reordered, lost or sent after a close."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from sluice.http_writes import HeadJoiningProtocol, _HeadJoiningTransport
from sluice.serve import uvicorn_config


class _Recording(asyncio.Transport):
    """What a transport was asked to do (the seam under test is the wrapper, not a socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def _turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_a_head_and_the_body_of_the_same_turn_leave_in_one_write() -> None:
    raw = _Recording()
    joined = _HeadJoiningTransport(raw, asyncio.get_running_loop())
    joined.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    joined.write(b"ok")
    assert raw.writes == []
    await _turn()
    assert raw.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    joined.write(b"5\r\nlater\r\n")  # not a head: out at once
    assert raw.writes[-1] == b"5\r\nlater\r\n"
    assert joined.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_a_head_held_is_sent_before_a_close_and_dropped_by_an_abort() -> None:
    raw = _Recording()
    joined = _HeadJoiningTransport(raw, asyncio.get_running_loop())
    joined.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    joined.write(b"boom")
    joined.close()
    assert raw.writes == [b"HTTP/1.1 500 Internal Server Error\r\n\r\nboom"] and raw.closed
    await _turn()  # the turn's flush finds nothing more to send, and never writes after the close
    assert len(raw.writes) == 1
    raw = _Recording()
    joined = _HeadJoiningTransport(raw, asyncio.get_running_loop())
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.abort()
    await _turn()
    assert raw.writes == [] and raw.aborted


@pytest.fixture
async def server(unused_tcp_port: int):
    async def events(request):
        async def body():
            yield b"data: 1\n\n"
            await asyncio.sleep(0.01)
            yield b"data: 2\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def answer(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/events", events), Route("/answer", answer, methods=["POST"])])
    config = uvicorn_config(app, "127.0.0.1", unused_tcp_port, graceful_s=1)
    assert config.http is HeadJoiningProtocol
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{unused_tcp_port}"
    srv.should_exit = True
    await task


async def test_responses_through_the_joining_protocol_are_whole_on_kept_and_closed_connections(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:  # one kept-alive connection
        for _ in range(3):
            async with client.stream("GET", "/events") as r:
                assert r.status_code == 200
                assert [line async for line in r.aiter_lines() if line] == ["data: 1", "data: 2"]
            r = await client.post("/answer", json={})
            assert r.json() == {"ok": True}
        r = await client.post("/answer", json={}, headers={"Connection": "close"})
        assert r.json() == {"ok": True} and r.headers.get("connection") == "close"
        r = await client.get("/nowhere")
        assert r.status_code == 404
