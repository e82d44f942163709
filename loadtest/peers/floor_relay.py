"""The least a Python gateway can do per request: the floor under issue 22's goals.

Issue 22 asks one gateway process for at least 0.9x of the engine's own one-token req/s at
64 streams, on a 2-core machine that also runs the load generator and the engine. Whether
*any* gateway on Sluice's stack can do that is a question of the stack, not of Sluice, so
this relay answers it: a raw ASGI app under uvicorn (uvloop, httptools: what Sluice runs
on), no framework, no auth, no queue, no validation, no record, no metrics. Per request it

- reads the body and parses it (orjson: a router must at least read the model's name);
- makes ``--redis-calls`` round trips to Redis through Sluice's own pipelined script
  channel (``sluice/script_channel.py``), one after the other, each a Lua ``INCR`` or ``DECR``
  of one key (a shared queue's admission is two: acquire and release; 0 by default);
- posts the body to the engine server over Sluice's own HTTP/1.1 hop (``sluice/http1.py``,
  kept-alive connections) and passes its answer through unchanged, chunk by chunk.

``--server raw`` replaces uvicorn with an asyncio protocol of a few lines on httptools' parser
(no ASGI messages, one write per chunk): the least an HTTP server of our own could cost.

``bench_peers.py`` runs it as the paths ``python floor (uvicorn)``, ``python floor (raw
asyncio)`` and ``python floor (uvicorn) + 2 Redis calls`` beside the others. What it costs per request is what a Python gateway on this
stack pays before it does any of its own work; see loadtest/peers/README.md for the runs.

    python loadtest/peers/floor_relay.py --port 18529 --upstream http://127.0.0.1:18520 [--redis URL --redis-calls 2]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson
import uvicorn
import uvloop

from sluice.http1 import Http1Pool, Http1Response
from sluice.script_channel import ScriptChannel

_STEP = "return redis.call(ARGV[1], KEYS[1])"


class Floor:
    def __init__(self, upstream: str, redis_url: str | None, redis_calls: int) -> None:
        self.upstream = upstream
        self.pool: Http1Pool | None = None
        self.redis_url, self.redis_calls = redis_url, redis_calls
        self.step: Any = None

    async def _start(self) -> None:
        self.pool = Http1Pool(connect_timeout_s=5)
        if self.redis_url and self.redis_calls:
            where = urlsplit(self.redis_url)
            self.step = ScriptChannel(where.hostname or "127.0.0.1", where.port or 6379).register_script(_STEP)

    async def _forward(self, body: bytes) -> tuple[Http1Response, bytes]:
        """What every request costs whatever the server: the parse, the Redis round trips,
        the engine's response (and its content type)."""
        model = orjson.loads(body).get("model")  # what a router reads, at the least
        for i in range(self.redis_calls):
            await self.step(keys=(f"floor:{model}",), args=("INCR" if i % 2 == 0 else "DECR",))
        assert self.pool is not None
        response = await self.pool.post(self.upstream, "/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        return response, response.headers.get(b"content-type", b"application/json")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await self._start()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions" or scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        response, kind = await self._forward(body)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(b"content-type", kind)]})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await response.aclose()  # the engine connection back to the pool
        await send({"type": "http.response.body", "body": b""})

    async def answer(self, conn: RawConnection, path: bytes, body: bytes, keep: bool) -> None:
        """The same request on the raw server: the response written to the socket directly."""
        write = conn.transport.write
        if path != b"/v1/chat/completions":
            write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        response, kind = await self._forward(body)
        write(b"HTTP/1.1 %d OK\r\ncontent-type: %b\r\ntransfer-encoding: chunked\r\n%b\r\n"
              % (response.status_code, kind, b"" if keep else b"connection: close\r\n"))
        async for chunk in response.aiter_raw():
            write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        await response.aclose()
        write(b"0\r\n\r\n")
        if not keep:
            conn.transport.close()


class RawConnection(asyncio.Protocol):
    """One client connection of the raw server: httptools parses, :meth:`Floor.answer`
    answers (no pipelining: the load generator sends a request after the last answer)."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.url, self.body = b"", bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path, body = self.url.partition(b"?")[0], bytes(self.body)
        self.url, self.body = b"", bytearray()
        task = asyncio.get_running_loop().create_task(self.floor.answer(self, path, body,
                                                                         self.parser.should_keep_alive()))
        _ANSWERING.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(_ANSWERING.discard)


_ANSWERING: set[asyncio.Task[None]] = set()


async def serve_raw(floor: Floor, port: int) -> None:
    await floor._start()
    server = await asyncio.get_running_loop().create_server(lambda: RawConnection(floor), "127.0.0.1", port,
                                                            backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the engine server, e.g. http://127.0.0.1:18520")
    parser.add_argument("--redis", help="Redis URL (redis://host:port) for --redis-calls")
    parser.add_argument("--redis-calls", type=int, default=0, help="Redis round trips per request (0: none)")
    parser.add_argument("--server", choices=["uvicorn", "raw"], default="uvicorn",
                        help="uvicorn (what Sluice runs on), or a raw asyncio protocol with httptools: the least a "
                        "Python HTTP server of our own could cost")
    args = parser.parse_args()
    floor = Floor(args.upstream, args.redis, args.redis_calls)
    if args.server == "raw":
        uvloop.run(serve_raw(floor, args.port))
        return
    uvicorn.run(floor, host="127.0.0.1", port=args.port,
                loop="uvloop", http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
