"""Resumable streams: the SSE events of a stream started with an ``Idempotency-Key``
are journaled in a capped Redis stream, so a client can re-attach and get the rest.

    sl:journal:{key}        Redis stream; entry id ``0-N`` holds event N ("d" = SSE data bytes)
    sl:journal:{key}:live   set every second while this gateway still produces the stream

The generation runs in a producer task that does not depend on any client: the
first client and every re-attaching one are readers of the journal. Writes are
batched (every ``flush_s`` or ``batch`` events), so Redis is not touched per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.errors import UpstreamFailed, error_event

log = logging.getLogger("sluice.journal")

DONE = b"data: [DONE]\n\n"
_PREFIX = "sl:journal:"


def stream_key(key: str) -> str:
    return _PREFIX + key


class JournalWriter:
    def __init__(self, redis: Redis, key: str, *, ttl_s: float, max_events: int = 20_000,
                 flush_s: float = 0.02, batch: int = 32) -> None:
        self._redis = redis
        self._key = stream_key(key)
        self._live = self._key + ":live"
        self._ttl_ms = int(ttl_s * 1000)
        self._max = max_events
        self._flush_s = flush_s
        self._batch = batch
        self._pending: list[bytes] = []
        self._seq = 0

    async def run(self, events: AsyncIterator[bytes]) -> None:
        """Journal every event; ``events`` ends with ``[DONE]``."""
        last_flush = time.monotonic()
        try:
            await self._redis.delete(self._key)  # a retry under the same key starts a fresh journal
            await self._redis.set(self._live, b"1", px=3000)
            async for event in events:
                self._pending.append(event)
                now = time.monotonic()
                if len(self._pending) >= self._batch or now - last_flush >= self._flush_s or event == DONE:
                    await self._flush()
                    last_flush = now
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # runs the generation's clean-up
            with contextlib.suppress(RedisError, OSError):
                await self._flush()
                await self._redis.delete(self._live)

    async def _flush(self) -> None:
        if not self._pending:
            return
        pipe = self._redis.pipeline(transaction=False)
        for event in self._pending:
            self._seq += 1
            pipe.xadd(self._key, {"d": event}, id=f"0-{self._seq}", maxlen=self._max, approximate=True)
        pipe.pexpire(self._key, self._ttl_ms)
        pipe.set(self._live, b"1", px=3000)
        self._pending.clear()
        await pipe.execute()


async def tail(redis: Redis, key: str, after: int = 0, *, idle_s: float = 1.0) -> AsyncIterator[bytes]:
    """Events after number ``after``, each with its ``id:``, following the live stream to [DONE]."""
    skey = stream_key(key)
    last = f"0-{after}"
    while True:
        got = await redis.xread({skey: last}, count=256, block=int(idle_s * 1000))
        if not got:
            if not await redis.exists(skey + ":live"):
                yield error_event(UpstreamFailed("the stream's producer is gone; the rest is lost"))
                yield DONE
                return
            continue
        for entry_id, fields in got[0][1]:
            ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            last = ident
            data = fields[b"d"]
            if data == DONE:
                yield DONE
                return
            yield b"id: " + ident.split("-", 1)[1].encode() + b"\n" + data


def last_event_id(header: str | None) -> int:
    if header is None:
        return 0
    try:
        return max(0, int(header.strip()))
    except ValueError:
        return 0


async def start_producer(writer: JournalWriter, events: AsyncIterator[bytes]) -> asyncio.Task[None]:
    task = asyncio.create_task(writer.run(events), name="journal-producer")
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("journal producer failed: %s", task.exception())
