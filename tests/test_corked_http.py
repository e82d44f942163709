"""The corked HTTP protocol (sluice/corked_http.py): what a response writes in one turn of
the event loop leaves in one write to the socket, in order, and nothing is held past it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from sluice.corked_http import CorkedHttpToolsProtocol
from sluice.serve import uvicorn_config

#: Every write that reached a connection's real transport, in order.
WRITES: list[bytes] = []


class _Recording:
    """Delegates to the real transport, keeping what is written to it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _RecordedProtocol(CorkedHttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Recording(transport))  # type: ignore[arg-type]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    headers = [(b"content-type", b"text/event-stream")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["path"] == "/later":
        await asyncio.sleep(0.2)  # the head leaves on its own: nothing waits for the body
    for event in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


@pytest.fixture
async def server() -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(_app, "127.0.0.1", 0, graceful_s=1)
    assert config.http is CorkedHttpToolsProtocol  # what the gateway and the workers run
    config.http = _RecordedProtocol
    served = uvicorn.Server(config)
    task = asyncio.create_task(served.serve(sockets=[sock]))
    while not served.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    served.should_exit = True
    await task


BODY = "data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"


async def test_a_response_written_in_one_turn_leaves_in_one_write(server: str) -> None:
    WRITES.clear()
    async with httpx.AsyncClient() as client:
        response = await client.get(server + "/now")
    assert response.text == BODY
    assert len(WRITES) == 1  # uncorked: the head, three events and the last chunk, five
    assert WRITES[0].startswith(b"HTTP/1.1 200 OK\r\n") and WRITES[0].endswith(b"0\r\n\r\n")


async def test_a_head_sent_before_a_wait_is_not_held_for_the_body(server: str) -> None:
    WRITES.clear()
    async with httpx.AsyncClient() as client, client.stream("GET", server + "/later") as response:
        assert response.status_code == 200  # the head came before the body was written
        assert len(WRITES) == 1
        assert (await response.aread()).decode() == BODY
    assert len(WRITES) == 2


async def test_a_closing_connection_sends_what_was_written_before_it_closes(server: str) -> None:
    WRITES.clear()
    async with httpx.AsyncClient() as client:
        response = await client.get(server + "/close")
    assert response.text == BODY
    assert response.headers["connection"] == "close"
