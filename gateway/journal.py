"""Resumable streams: the SSE events of a stream started with an ``Idempotency-Key``
are journaled in a capped Redis stream, so a client can re-attach and get the rest.

    sl:journal:{scope}        Redis stream; entry id ``0-N`` holds event N: "d" = SSE data
                              bytes, "s" = the token ids it carries (see gateway/takeover.py)
    sl:journal:{scope}:live   the producing gateway's token, refreshed while it produces
    sl:journal:{scope}:plan   what another gateway needs to take the stream over

``scope`` is a hash of the caller's API key id and its Idempotency-Key (see
gateway/idempotency.py), so one tenant can neither read nor disturb another's.

The generation runs in a producer task (:class:`JournalWriter`) that does not depend
on any client. Each event goes to the journal, then to the first client
(:meth:`JournalWriter.subscribe`) with the ``id: N`` the journal gave it: a client
never has an event the journal lacks, so when the producing gateway dies, another one
continues the stream from the journal (gateway/takeover.py) and the client, re-attached
with its ``Last-Event-ID``, gets exactly the rest. Re-attaching clients read the
journal through the one shared reader loop of gateway/journal_readers.py; so does a
first client that falls too far behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

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

    def hand_over(self) -> None:
        """Another gateway produces the stream now: go on from the journal."""
        if not self._closed:
            self._lagging = True
            self._queue.put_nowait(None)

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


#: Appends events to a journal if this producer still owns it (``:live`` holds its token):
#: a producer that stalled past ``LIVE_TTL_MS`` and was taken over by another gateway
#: must not write on. KEYS: stream, live. ARGV: owner, stream ttl ms, live ttl ms, max
#: events, then (id, data, state) per event; state "" when the event carries no tokens.
APPEND = """
local owner = redis.call('GET', KEYS[2])
if owner ~= ARGV[1] then return 0 end
for i = 5, #ARGV, 3 do
  local ok = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], ARGV[i], 'd', ARGV[i + 1], 's', ARGV[i + 2])
  if type(ok) == 'table' and ok.err and not string.find(ok.err, 'equal or smaller') then
    return redis.error_reply(ok.err)
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return 1
"""


class JournalLost(Exception):
    """Another gateway took this stream over (this one stalled past ``:live``'s TTL)."""


class JournalWriter:
    """Produces one resumable stream: journals its events, then hands them to the first client.

    An event reaches the first client only once it is in the journal, so whatever a
    client saw, a gateway taking the stream over (gateway/takeover.py) has too. Writes
    are not batched on a timer: the process's :class:`JournalCommitter` writes every
    pending event of every stream in one pipeline per round trip, so the journal adds
    about one Redis round trip to an event's latency and costs one command per stream
    per round, however many events it carries.

    >>> writer = JournalWriter(committer, scope, ttl_s=3600, owner=token)
    >>> await writer.claim()                    # this gateway produces the stream now
    >>> first = writer.subscribe(readers.tail)  # before the producer starts
    >>> producer = await start_producer(writer, events, abandon, tap.take)
    >>> response = SSEResponse(first.events(), keepalive, first.close)  # the first client reads this
    """

    def __init__(self, committer: JournalCommitter, key: str, *, ttl_s: float, owner: str,
                 max_events: int = 20_000, max_pending: int = 4096) -> None:
        self._committer = committer
        self.key = key
        self._owner = owner
        self._ttl_ms = int(ttl_s * 1000)
        self._max = max_events
        self._max_pending = max_pending
        self._pending: list[tuple[bytes, bytes]] = []  # (event, state): events _written+1 .. _produced
        self._in_flight = 0  # events of _pending being written now
        self._written = 0
        self._produced = 0
        self._progress = asyncio.Event()  # a write ended (well or not)
        self.last_write = time.monotonic()
        self._failure: RedisError | OSError | JournalLost | None = None
        self._first: FirstReader | None = None

    def __repr__(self) -> str:
        return f"<JournalWriter {self.key} produced={self._produced} written={self._written}>"

    async def claim(self, *, take_over: bool = False, plan: bytes | None = None) -> bool:
        """Mark this gateway as the stream's producer, and store its ``plan`` (gateway/takeover.py)
        in the same round trip; taking over only succeeds while no other gateway holds it
        (its ``:live`` expired)."""
        pipe = self._committer.redis.pipeline(transaction=False)
        if plan is not None:
            pipe.set(keys.journal_plan(self.key), plan, px=self._ttl_ms)
        pipe.set(live_key(self.key), self._owner, px=LIVE_TTL_MS, nx=take_over)
        return bool((await pipe.execute())[-1])

    def continue_after(self, number: int) -> None:
        """A taken-over stream: its next event is ``number + 1``."""
        if self._produced:
            raise RuntimeError("continue_after before the producer starts")
        self._written = self._produced = number

    def subscribe(self, catch_up: CatchUp, *, lag_max: int = 1024) -> FirstReader:
        """The first client's reader; call it before the producer starts, so it misses nothing."""
        if self._produced:
            raise RuntimeError("subscribe before the producer starts")
        self._first = FirstReader(self.key, catch_up, lag_max)
        return self._first

    async def run(self, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]],
                  state: Callable[[], bytes] = lambda: b"") -> None:
        """Journal every event; ``events`` ends with ``[DONE]``. ``state()`` after each event
        gives what a take-over needs of it (the token ids it carries, see takeover.py).

        ``abandon`` cleans up the generation if ``events`` never got to run (its own
        ``finally`` only runs once it has started); it must be idempotent.
        """
        self._committer.follow(self)
        try:
            async for event in events:
                self._produced += 1
                self._pending.append((event, state()))
                self._committer.schedule(self)
                await self._hold_back()
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # runs the generation's clean-up
            await abandon()
            await self._drain()
            self._committer.unfollow(self)
            if not isinstance(self._failure, JournalLost):
                with contextlib.suppress(RedisError, OSError):
                    await self._committer.redis.delete(live_key(self.key))
            if self._first is not None:
                self._first.end()

    async def _hold_back(self) -> None:
        """Only when Redis lags far behind: wait for it, or give up if it keeps failing."""
        while len(self._pending) >= self._max_pending or isinstance(self._failure, JournalLost):
            if self._failure is not None:
                raise self._failure
            self._progress.clear()
            await self._progress.wait()

    async def _drain(self, attempts: int = 3) -> None:
        """Write what is left; after a few failed attempts the journal just ends early."""
        for _ in range(attempts):
            if not self._pending or isinstance(self._failure, JournalLost) or not self._committer.alive():
                return
            self._progress.clear()
            self._committer.schedule(self)
            await self._progress.wait()

    # The committer's side: take a batch, then report how its write went.

    def batch(self) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and ARGV of ``APPEND`` for everything pending (only ``:live`` when nothing is)."""
        self._in_flight = len(self._pending)
        args: list[bytes | str | int] = [self._owner, self._ttl_ms, LIVE_TTL_MS, self._max]
        for number, (event, state) in enumerate(self._pending, start=self._written + 1):
            args += [f"0-{number}", event, state]
        return [stream_key(self.key), live_key(self.key)], args

    def written(self, owned: bool) -> None:
        self.last_write = time.monotonic()
        if not owned:
            self.failed(JournalLost(self.key))
            return
        batch, first = self._pending[:self._in_flight], self._written + 1
        self._written += len(batch)
        del self._pending[:len(batch)]  # only once written: a failed write is retried with the same ids
        self._failure = None
        if self._first is not None:
            for number, (event, _) in enumerate(batch, start=first):
                if not self._first.offer(number, event):
                    self._first = None
                    break
        self._progress.set()

    def failed(self, exc: RedisError | OSError | JournalLost) -> None:
        self._failure = exc
        if isinstance(exc, JournalLost):
            log.warning("journal %s was taken over by another gateway; this one stops producing it", self.key)
            if self._first is not None:
                self._first.hand_over()
                self._first = None
        else:
            log.warning("journal write failed for %s: %s", self.key, exc)
        self._progress.set()

    @property
    def dirty(self) -> bool:
        return bool(self._pending)


class JournalCommitter:
    """Writes the journals of every stream this gateway process produces, one pipeline per
    round: all pending events of all streams (one ``APPEND`` per stream), plus a ``:live``
    refresh for streams silent for a while (a migration in progress). A round starts as
    soon as the last one returned, so writes batch by themselves under load.

    >>> committer = JournalCommitter(redis)   # one per process
    >>> writer = JournalWriter(committer, scope, ttl_s=3600, owner=token)
    >>> await committer.close()
    """

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._script = redis.register_script(APPEND)
        self._followed: set[JournalWriter] = set()
        self._due: dict[JournalWriter, None] = {}  # insertion-ordered set
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    def __repr__(self) -> str:
        return f"<JournalCommitter streams={len(self._followed)} rounds={self.rounds}>"

    def follow(self, writer: JournalWriter) -> None:
        self._followed.add(writer)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="journal-committer")

    def unfollow(self, writer: JournalWriter) -> None:
        self._followed.discard(writer)
        self._due.pop(writer, None)

    def schedule(self, writer: JournalWriter) -> None:
        self._due[writer] = None
        self._wake.set()

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        try:
            await self._rounds()
        except Exception:  # a bug must not leave every producer waiting forever
            log.exception("the journal committer failed; its streams end here")
            for writer in list(self._followed):
                writer.failed(RedisError("the journal committer failed"))
            raise

    async def _rounds(self) -> None:
        while self._followed or self._due:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _LIVE_REFRESH_S / 2)
            self._wake.clear()
            stale = time.monotonic() - _LIVE_REFRESH_S
            for writer in self._followed:
                if writer.last_write < stale:
                    self._due[writer] = None
            writers = [w for w in self._due if w.dirty or w in self._followed]
            self._due.clear()
            if writers:
                await self._round(writers)

    async def _round(self, writers: list[JournalWriter]) -> None:
        self.rounds += 1
        batches = [writer.batch() for writer in writers]
        try:
            results = await self._append_all(batches)
        except (RedisError, OSError) as exc:
            for writer in writers:
                writer.failed(exc)
            await asyncio.sleep(0.05)  # Redis is down or far: do not spin
            return
        for writer, result in zip(writers, results, strict=True):
            if isinstance(result, NoScriptError):  # Redis restarted or failed over
                await self.redis.script_load(APPEND)
                self.schedule(writer)
            elif isinstance(result, (RedisError, OSError)):
                writer.failed(result)
            else:
                writer.written(bool(result))

    async def _append_all(self, batches: list[tuple[list[str], list[bytes | str | int]]]) -> list[Any]:
        """One ``APPEND`` per batch: one pipeline on a single server; on a Cluster (whose
        pipelines refuse scripts) concurrent calls, each to its stream's node."""
        if isinstance(self.redis, RedisCluster):
            return await asyncio.gather(
                *(self._script(keys=keys_, args=args) for keys_, args in batches), return_exceptions=True
            )
        pipe = self.redis.pipeline(transaction=False)
        for keys_, args in batches:
            pipe.evalsha(self._script.sha, len(keys_), *keys_, *args)
        return list(await pipe.execute(raise_on_error=False))


def last_event_id(header: str | None) -> int:
    if header is None:
        return 0
    try:
        return max(0, int(header.strip()))
    except ValueError:
        return 0


async def start_producer(
    writer: JournalWriter, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]],
    state: Callable[[], bytes] = lambda: b"",
) -> asyncio.Task[None]:
    task = asyncio.create_task(writer.run(events, abandon, state), name="journal-producer")
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("journal producer failed: %s", task.exception())
