"""A TCP proxy between one gateway and Redis, so the harness can delay or cut that link.

Network namespaces need root; a proxy of our own needs nothing. The gateway's Redis URL
names the proxy's port; every connection it opens is piped to Redis. Faults:

- ``delay(s)``: every chunk, both ways, is delivered ``s`` later (order kept, bandwidth not
  throttled: the reader keeps reading while earlier chunks wait);
- ``cut(blackhole=False)``: open connections are reset and new ones reset at once, as when
  a route goes away; ``cut(blackhole=True)``: connections stay open but nothing passes, as
  in a partition (the gateway notices only through its socket timeouts). Nothing is lost
  inside a connection: what was sent meanwhile arrives after ``heal()``, in order, as TCP
  retransmission delivers it (dropping bytes mid-stream would be no network's behaviour,
  and would desynchronise any pipelined protocol);
- ``heal()``: back to a plain pipe (reset connections stay closed: the client reconnects).

>>> proxy = await LinkProxy(redis_port).start()
>>> url = f"redis://127.0.0.1:{proxy.port}/0"
>>> proxy.delay(0.2); ...; proxy.heal()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Self

_CHUNK = 64 * 1024


class _Link:
    """One proxied connection: two directions, each a reader task and a writer task."""

    def __init__(self, proxy: LinkProxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 server: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.proxy = proxy
        self.writers = (client[1], server[1])
        self.tasks = [
            *self._direction(client[0], server[1]),
            *self._direction(server[0], client[1]),
        ]

    def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> list[asyncio.Task[None]]:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        return [asyncio.create_task(self._read(src, queue)), asyncio.create_task(self._write(queue, dst))]

    async def _read(self, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        try:
            while data := await src.read(_CHUNK):
                queue.put_nowait((time.monotonic() + self.proxy.delay_s, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, b""))

    async def _write(self, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await self.proxy.flowing.wait()  # a partition holds bytes back, it never drops them
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        self.reset()

    def reset(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.proxy.links.discard(self)


class LinkProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.port = 0
        self.delay_s = 0.0
        self.refusing = False
        #: Cleared while a partition (``cut(blackhole=True)``) holds every byte back.
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def cut(self, *, blackhole: bool = False) -> None:
        if blackhole:
            self.flowing.clear()
            return
        self.refusing = True
        for link in list(self.links):
            link.reset()

    def heal(self) -> None:
        self.delay_s, self.refusing = 0.0, False
        self.flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            server = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()  # Redis is down: the gateway sees its connection fail
            return
        self.links.add(_Link(self, (reader, writer), server))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.reset()
            for task in link.tasks:
                task.cancel()
            for task in link.tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
