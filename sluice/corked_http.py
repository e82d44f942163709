"""uvicorn's HTTP/1.1 protocol (httptools) with its writes corked: what one connection
writes in one turn of the event loop leaves in one ``send``.

Why: uvicorn writes the response head and each body message with its own
``transport.write``, and uvloop sends each at once: one system call, and one packet for the
client to wake up for, per write. A short request's response is a head and a body (JSON),
or a head and a handful of events that arrive together from the engine (a one-token
stream: role, token, finish, usage, ``[DONE]``). Corked, they leave together at the end of
the loop's turn: the measured gain is in loadtest/peers/README.md (issue 22).

Nothing waits longer than the rest of the current turn: the flush is the first callback
of the next one. Flow control is unchanged: the real transport still tells uvicorn to pause
writing past its high-water mark, and at most one turn's writes are held here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CorkedTransport:
    """A transport whose writes are joined until the end of the event loop's turn."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def close(self) -> None:
        self._flush()  # what was written goes before the FIN, as without the cork
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class CorkedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a :class:`CorkedTransport`; give it to
    ``uvicorn.Config(http=...)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
