"""A closed-loop streaming load generator on a minimal HTTP/1.1 client (asyncio streams,
chunked decoding by hand), so that 10k+ chunks/s cost the generator little and every path
is read the same way.

Each of ``streams`` loops: POST ``/v1/chat/completions`` with ``stream: true``, read
every SSE event, count the chunks that carry content, note the time to the first one,
repeat until the window closes. Chunks are counted when they arrive inside the measured
window; TTFT and errors belong to requests that started inside it.

Each request opens its own connection (``Connection: close``), as the issue-22 figures
were measured, unless ``keep_alive``: then each loop keeps its connection, as the
``openai`` SDK and httpx pools do, and the figures leave out what a connection costs
(accepting it, the server's per-connection state, closing it).

Loops without a pause between requests (the default) on kept-alive connections fall into
step with an engine whose first token always takes the same time, and then reach the
gateway in bursts (loadtest/peers/README.md, 2026-12-04 evening); ``think_ms`` breaks that.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson


@dataclass(slots=True)
class Window:
    start: float
    end: float
    chunks: int = 0
    ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


async def _read_chunked(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; None at its end."""
    size_line = await reader.readuntil(b"\r\n")
    size = int(size_line.split(b";", 1)[0], 16)
    if size == 0:
        await reader.readuntil(b"\r\n")
        return None
    data = await reader.readexactly(size + 2)
    return data[:-2]


async def _json_answer(reader: asyncio.StreamReader, head: bytes, chunked: bool, sent: float, counted: bool,
                       win: Window) -> None:
    """A non-streaming answer: one JSON body, counted as one chunk; its TTFT is the whole answer's time."""
    if chunked:
        parts = []
        while (part := await _read_chunked(reader)) is not None:
            parts.append(part)
        data = b"".join(parts)
    else:
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        data = await reader.readexactly(length)
    now = time.monotonic()
    obj = orjson.loads(data)
    choices = obj.get("choices") or ()
    if not counted or sent > win.end:
        return
    win.requests += 1
    if not choices or not (choices[0].get("message") or {}).get("content"):
        win.error("no content")
        return
    win.ttfts.append(now - sent)
    if win.start <= now <= win.end:
        win.chunks += 1


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _one(host: str, port: int, path: str, body: bytes, headers: bytes, win: Window,
               stream: bool = True, keep_alive: bool = False, conn: Conn | None = None) -> Conn | None:
    """One request, on ``conn`` if given (kept alive), else on a new connection; with
    ``keep_alive``, the connection to send the next request on, if it may be kept."""
    sent = time.monotonic()
    counted = sent >= win.start
    first: float | None = None
    reused = conn is not None
    try:
        reader, writer = conn or await asyncio.open_connection(host, port)
    except OSError:
        win.error("connect")
        return None
    keep = False
    try:
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\n" + headers
                     + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                     + (b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n")
                     + body)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError) as exc:
            if reused and not getattr(exc, "partial", b""):  # the server closed the idle connection
                writer.close()
                return await _one(host, port, path, body, headers, win, stream, keep_alive)
            raise
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            if counted:
                win.error(f"http {status}")
            return None
        lowered = head.lower()
        chunked = b"transfer-encoding: chunked" in lowered
        # Kept only where the answer's end is known without the connection's.
        keep = keep_alive and b"connection: close" not in lowered and (chunked or not stream)
        buffer = b""
        done = False
        if not stream:
            await _json_answer(reader, lowered, chunked, sent, counted, win)
            return (reader, writer) if keep else None
        while True:
            data = await (_read_chunked(reader) if chunked else reader.read(65536))
            if not data:
                break
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            now = time.monotonic()
            for event in events:
                event = event.strip()
                if not event.startswith(b"data:"):  # a resumable stream's events lead with their id
                    at = event.find(b"\ndata:")
                    if at < 0:
                        continue
                    event = event[at + 1:]
                payload = event[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                obj = orjson.loads(payload)
                if "error" in obj:
                    if counted:
                        win.error("in-band")
                    continue
                choices = obj.get("choices") or ()
                if choices and (choices[0].get("delta") or {}).get("content"):
                    if first is None:
                        first = now
                    if win.start <= now <= win.end:
                        win.chunks += 1
        if counted and sent <= win.end:
            win.requests += 1
            if not done:
                win.error("no [DONE]")
            elif first is not None:
                win.ttfts.append(first - sent)
        return (reader, writer) if keep else None
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        keep = False
        if counted:
            win.error(type(exc).__name__)
        return None
    finally:
        if not keep:
            writer.close()


async def run(url: str, model: str, streams: int, warmup_s: float, measure_s: float, max_tokens: int,
              api_key: str | None = None, stream: bool = True, keep_alive: bool = False,
              think_ms: float = 0.0, resumable: bool = False) -> Window:
    """``streams`` closed loops against ``url`` for warmup + measure seconds (``stream``: SSE,
    else one JSON answer per request; ``keep_alive``: each loop keeps its connection;
    ``think_ms``: each loop pauses a random 0..think_ms between its requests; ``resumable``:
    each request has an ``Idempotency-Key`` of its own, which makes a stream resumable)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = (parts.path.rstrip("/") or "") + "/v1/chat/completions"
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream})
    headers = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    now = time.monotonic()
    win = Window(start=now + warmup_s, end=now + warmup_s + measure_s)

    async def loop() -> None:
        conn: Conn | None = None
        while time.monotonic() < win.end:
            sent = headers + b"Idempotency-Key: " + os.urandom(12).hex().encode() + b"\r\n" if resumable else headers
            conn = await _one(host, port, path, body, sent, win, stream, keep_alive, conn)
            if think_ms:
                await asyncio.sleep(random.uniform(0, think_ms) / 1000)
        if conn is not None:
            conn[1].close()

    await asyncio.gather(*(loop() for _ in range(streams)))
    return win


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
