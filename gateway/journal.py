"""Resumable streams: the SSE events of a stream started with an ``Idempotency-Key``
are journaled in a capped Redis stream, so a client can re-attach and get the rest.

    sl:journal:{scope}        Redis stream; entry id ``0-N`` holds event N ("d" = SSE data bytes)
    sl:journal:{scope}:live   refreshed while this gateway still produces it

``scope`` is a hash of the caller's API key id and its Idempotency-Key (see
gateway/idempotency.py), so one tenant can neither read nor disturb another's.

The generation runs in a producer task (:class:`JournalWriter`) that does not depend
on any client. It hands each event straight to the first client
(:meth:`JournalWriter.subscribe`), with the ``id: N`` the journal gives it, and
queues it for the journal, which a flusher task writes in batches (every
``flush_s`` or ``batch`` events): Redis is not touched per chunk and the first client
never waits for a write. Re-attaching clients read the journal through the one
shared reader loop of gateway/journal_readers.py; so does a first client that falls
too far behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from sluice import keys
from sluice.errors import UpstreamFailed, error_event

log = logging.getLogger("sluice.journal")

DONE = b"data: [DONE]\n\n"
#: ``:live`` expires this long after the last refresh (a gateway that died stops refreshing).
LIVE_TTL_MS = 3000
#: Refresh ``:live`` at least this often, even through long silences (a migration).
_LIVE_REFRESH_S = 0.5

#: Reads a journal from after event N on: ``JournalReaders.tail``.
CatchUp = Callable[[str, int], AsyncIterator[bytes]]


def stream_key(key: str) -> str:
    return keys.journal(key)


def live_key(key: str) -> str:
    return keys.journal_live(key)


def producer_gone() -> bytes:
    """The in-band error a reader gets when the stream ends without its ``[DONE]``."""
    return error_event(UpstreamFailed("the stream's producer is gone; the rest is lost"))


def frame(number: int, event: bytes) -> bytes:
    """Event ``number`` as a reader gets it: with its ``id:``, except the final ``[DONE]``."""
    return DONE if event == DONE else b"id: %d\n%b" % (number, event)


class FirstReader:
    """The first client of a resumable stream: events as they are produced, not as flushed.

    If it falls more than ``lag_max`` events behind, the producer lets go of it and it
    goes on from the journal (``catch_up``), so a slow client costs no unbounded memory.
    """

    def __init__(self, key: str, catch_up: CatchUp, lag_max: int) -> None:
        self._key = key
        self._catch_up = catch_up
        self._lag_max = lag_max
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._lagging = False
        self._closed = False

    def offer(self, number: int, event: bytes) -> bool:
        """Hand over event ``number``; False once this reader wants no more from the producer."""
        if self._closed:
            return False
        if self._queue.qsize() >= self._lag_max:
            self._lagging = True
            self._queue.put_nowait(None)
            return False
        self._queue.put_nowait((number, frame(number, event)))
        return True

    def end(self) -> None:
        """The producer is done; a reader still waiting for ``[DONE]`` gets the in-band error."""
        if not self._closed:
            self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[bytes]:
        last = 0
        while (item := await self._queue.get()) is not None:
            last, data = item
            yield data
            if data == DONE:
                return
        if self._lagging:
            async with contextlib.aclosing(self._catch_up(self._key, last)) as rest:
                async for data in rest:
                    yield data
        else:
            yield producer_gone()
            yield DONE

    async def close(self) -> None:
        """The client is gone: the producer drops this reader and goes on journaling."""
        self._closed = True


class JournalWriter:
    """Produces one resumable stream: journals its events and hands them to the first client.

    >>> writer = JournalWriter(redis, scope, ttl_s=3600)
    >>> first = writer.subscribe(readers.tail)  # before the producer starts
    >>> producer = await start_producer(writer, events, abandon)
    >>> response = GuardedSSE(first.events(), first.close)  # the first client reads this
    """

    def __init__(self, redis: Redis, key: str, *, ttl_s: float, max_events: int = 20_000,
                 flush_s: float = 0.1, batch: int = 32, max_pending: int = 4096) -> None:
        self._redis = redis
        self._key = key
        self._stream = stream_key(key)
        self._live = live_key(key)
        self._ttl_ms = int(ttl_s * 1000)
        self._max = max_events
        self._flush_s = flush_s
        self._batch = batch
        self._max_pending = max_pending
        self._pending: list[bytes] = []  # events _written+1 .. _produced
        self._written = 0
        self._produced = 0
        self._wake = asyncio.Event()  # a batch is full, or the stream ended
        self._flushed = asyncio.Event()
        self._closing = False
        self._failure: RedisError | OSError | None = None
        self._first: FirstReader | None = None

    def __repr__(self) -> str:
        return f"<JournalWriter {self._key} produced={self._produced} written={self._written}>"

    def subscribe(self, catch_up: CatchUp, *, lag_max: int = 1024) -> FirstReader:
        """The first client's reader; call it before the producer starts, so it misses nothing."""
        if self._produced:
            raise RuntimeError("subscribe before the producer starts")
        self._first = FirstReader(self._key, catch_up, lag_max)
        return self._first

    async def run(self, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]]) -> None:
        """Journal every event; ``events`` ends with ``[DONE]``.

        ``abandon`` cleans up the generation if ``events`` never got to run (its own
        ``finally`` only runs once it has started); it must be idempotent.
        """
        flusher = asyncio.create_task(self._flush_loop(), name="journal-flusher")
        try:
            async for event in events:
                self._produced += 1
                if self._first is not None and not self._first.offer(self._produced, event):
                    self._first = None
                self._pending.append(event)
                if len(self._pending) >= self._batch or event == DONE:
                    self._wake.set()
                await self._hold_back()
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # runs the generation's clean-up
            await abandon()
            self._closing = True
            self._wake.set()
            await flusher  # writes what is left, then returns
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(self._live)
            if self._first is not None:
                self._first.end()

    async def _hold_back(self) -> None:
        """Only when Redis lags far behind: wait for it, or give up if it keeps failing."""
        while len(self._pending) >= self._max_pending:
            if self._failure is not None:
                raise self._failure
            self._flushed.clear()
            self._wake.set()
            await self._flushed.wait()

    async def _flush_loop(self) -> None:
        """Write batches as they fill (or after ``flush_s``); keep ``:live`` fresh meanwhile."""
        refreshed = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            closing = self._closing
            try:
                if self._pending:
                    await self._flush()
                    refreshed = time.monotonic()
                elif not closing and time.monotonic() - refreshed >= _LIVE_REFRESH_S:
                    await self._redis.set(self._live, b"1", px=LIVE_TTL_MS)
                    refreshed = time.monotonic()
                self._failure = None
            except (RedisError, OSError) as exc:
                self._failure = exc
                log.warning("journal write failed for %s: %s", self._key, exc)
            self._flushed.set()
            if closing:
                return

    async def _flush(self) -> None:
        batch = self._pending[:]
        pipe = self._redis.pipeline(transaction=False)
        for number, event in enumerate(batch, start=self._written + 1):
            pipe.xadd(self._stream, {"d": event}, id=f"0-{number}", maxlen=self._max, approximate=True)
        pipe.pexpire(self._stream, self._ttl_ms)
        pipe.set(self._live, b"1", px=LIVE_TTL_MS)
        for result in await pipe.execute(raise_on_error=False):
            # An entry that a failed earlier attempt did write is refused as "equal or smaller".
            if isinstance(result, ResponseError) and "equal or smaller" not in str(result):
                raise result
        # Only once written: a failed write is retried with the same ids.
        self._written += len(batch)
        del self._pending[:len(batch)]


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
