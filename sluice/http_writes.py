"""uvicorn's HTTP/1.1 protocol, with a response's head leaving in the same write as the
body that follows it in the same turn of the event loop.

Why: uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and each body message as a write of its own: a one-token stream
made three writes (head, first event, ``[DONE]`` with the body's end) and a JSON answer
two. Each write to a loopback socket is a system call that also runs the receiving side
of TCP in the sender's process: py-spy on ``loadtest/peers/profile_gateway.py
--max-tokens 1 --keep-alive`` put the gateway's writes to its clients at about a sixth of
its CPU per request, the head's write alone at about 30 µs (py-spy's figures run high).
An SSE response here starts once its first event is known (gateway/relay/serving.py reads
it before answering, for retries before the first token), so the head and that event are
sent in the same turn, as are a JSON answer's head and body.

So a write that begins a response (``HTTP/1.1 ...``: uvicorn's head, never a chunk of a
body, which starts with its size) is held until the end of the current turn, and the
writes that follow it in that turn join it: one system call. Other writes go out as they
come, so a long stream's chunks pay nothing for it. A head held alone (its body came
later) leaves one turn later: microseconds. Closing the connection sends what is held
first; aborting it drops it, as the transport would.

The measured gain is in loadtest/peers/README.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1.1 "


class _HeadJoiningTransport:
    """A transport whose writes from a response's head to the end of the turn leave as one."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        elif data.startswith(_HEAD):
            self._held = [data]
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    # What uvicorn calls on every request, without a detour through __getattr__.
    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's own
        return getattr(self._transport, name)


class HeadJoiningProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`_HeadJoiningTransport` (``uvicorn.Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadJoiningTransport(transport, self.loop))  # type: ignore[arg-type]
