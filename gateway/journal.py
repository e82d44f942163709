"""Resumable streams: the SSE events of a stream started with an ``Idempotency-Key``
are journaled in a capped Redis stream, so a client can re-attach and get the rest.

    sl:journal:{scope}        Redis stream; entry id ``0-N`` holds event N ("d" = SSE data bytes)
    sl:journal:{scope}:live   refreshed twice a second while this gateway still produces it

``scope`` is a hash of the caller's API key id and its Idempotency-Key (see
gateway/idempotency.py), so one tenant can neither read nor disturb another's.

The generation runs in a producer task that does not depend on any client: the
first client and every re-attaching one are readers of the journal. Writes are
batched (every ``flush_s`` or ``batch`` events), so Redis is not touched per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

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
        self._lock = asyncio.Lock()

    async def run(self, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]]) -> None:
        """Journal every event; ``events`` ends with ``[DONE]``.

        ``abandon`` cleans up the generation if ``events`` never got to run (its own
        ``finally`` only runs once it has started); it must be idempotent.
        """
        beat = asyncio.create_task(self._heartbeat(), name="journal-heartbeat")
        try:
            async for event in events:
                async with self._lock:
                    self._pending.append(event)
                    if len(self._pending) >= self._batch or event == DONE:
                        await self._flush()
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await events.aclose()  # type: ignore[attr-defined]  # runs the generation's clean-up
            await abandon()
            with contextlib.suppress(RedisError, OSError):
                async with self._lock:
                    await self._flush()
                await self._redis.delete(self._live)

    async def _heartbeat(self) -> None:
        """Keep ``:live`` fresh through long silences (a migration) and flush stragglers."""
        while True:
            try:
                async with self._lock:
                    await self._flush()
                    await self._redis.set(self._live, b"1", px=3000)
            except (RedisError, OSError) as exc:
                log.warning("journal heartbeat failed: %s", exc)
            await asyncio.sleep(min(self._flush_s * 10, 0.5))

    async def _flush(self) -> None:
        if not self._pending:
            return
        pipe = self._redis.pipeline(transaction=False)
        seq = self._seq
        for event in self._pending:
            seq += 1
            pipe.xadd(self._key, {"d": event}, id=f"0-{seq}", maxlen=self._max, approximate=True)
        pipe.pexpire(self._key, self._ttl_ms)
        pipe.set(self._live, b"1", px=3000)
        await pipe.execute()
        self._seq = seq  # only once written: a failed write is retried with the same ids
        self._pending.clear()


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


async def start_producer(
    writer: JournalWriter, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]]
) -> asyncio.Task[None]:
    task = asyncio.create_task(writer.run(events, abandon), name="journal-producer")
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("journal producer failed: %s", task.exception())
