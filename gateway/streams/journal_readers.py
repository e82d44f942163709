"""One reader loop per gateway process for every client re-attached to a journaled stream.

A reader parked in ``XREAD BLOCK`` holds a Redis connection until its next event, so
connections grew with readers until the pool ran out. Here one task polls every
followed stream with one pipeline of non-blocking ``XREAD``s, every ``poll_s`` while
there are readers (it sleeps on an event when there are none), and fans the entries
out to per-reader queues: a gateway's Redis connections no longer depend on its readers.

- one ``XREAD`` per key, never a multi-key one, in a non-transactional pipeline: on
  Redis Cluster the keys of different readers live in different slots;
- readers at the same position of the same stream share one ``XREAD`` and the same
  bytes (300 readers of one stream cost one command per poll);
- backpressure: a reader with more than ``max_queued`` events waiting is not polled
  until its client has drained them;
- never a silent gap: a reader whose next entry is not the one after its cursor (Redis
  lost part of the journal, see gateway/streams/journal.py) gets an in-band error, then
  ``[DONE]``; so does one whose entries need the stream's lost ``:head``;
- never a splice: each reader follows one generation, the one whose ``:head`` (the chunk
  id every event carries) its first events came with. ``:head`` is read after each
  ``XREAD`` in the same pipeline, so entries a poll hands out are never older than the head
  checked with them; a journal whose head changed (Redis lost the stream, then a re-sent
  request, or a failover back to older data, made another generation of it) ends the
  reader with the in-band ``stream_history_lost`` error. One ``GET`` per followed stream
  and poll; a client that re-attaches after the change cannot be told (its
  ``Last-Event-ID`` is a number);
- a reader that got nothing for ``idle_s`` has the stream's ``:live`` marker checked;
  if the producer is gone (not running in this process; and not judged from a poll that
  Redis, or this process, stalled: the clock starts again) and a further read still
  finds nothing, this gateway takes
  the stream over (``adopt``, gateway/streams/takeover.py) and the readers go on with what it
  produces; only a stream that cannot be continued ends with the in-band error (the
  take-over's own when it raised one: e.g. the journal's history is incomplete), then
  ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from gateway.streams.event_ids import follows, frame, id_tail, marks
from gateway.streams.journal import (
    DONE,
    another_generation,
    entry_number,
    expand,
    history_lost,
    live_key,
    producer_gone,
    stream_key,
)
from sluice import keys
from sluice.errors import SluiceError, Unavailable, error_event

log = logging.getLogger("sluice.journal")

#: A take-over that has not started producing by then (Redis stalled mid-way) gives up:
#: its readers get an error and may re-attach, rather than wait on it for ever.
ADOPT_TIMEOUT_S = 30.0
#: A poll that Redis has not answered by then ends its readers with the in-band "re-attach"
#: error: on a Cluster, one slow topology refresh (nodes tried one after another, a stalled
#: one accepting and never answering) held every command of the process, and readers waited
#: past their clients' deadlines (the nemesis, Cluster: 9 hangs).
POLL_TIMEOUT_S = 10.0
#: A poll that fails at once (a connection Redis closed: a restart, a failover, CLIENT KILL;
#: Sentinel naming no master yet) is tried again for this long, as long as a poll that gets
#: no answer is waited for, before its readers end with the "re-attach" error: the pool's
#: next connection usually reaches the server again (a re-attach just after a Redis restart
#: ended on its first poll's stale connection, on a machine running make test's four
#: processes), and a Sentinel failover names the new master within seconds (the nemesis,
#: Sentinel, seed 11: with 2 s here, nem-250's readers ended three times during failovers,
#: each a round trip for its client). A poll that waited for an answer (a stall) is not
#: tried again.
READ_RETRY_S = POLL_TIMEOUT_S


@dataclass(eq=False)
class _Reader:
    key: str
    cursor: int  # the last event number queued for this reader
    quiet_since: float  # since when nothing arrived, or :live was last seen
    #: The ``:head`` of the generation this reader's client has events of (None: none yet).
    lineage: bytes | None = None
    #: The tag of the last event this reader's client has (gateway/streams/event_ids.py;
    #: None: unknown): the next one must continue that history.
    chain: bytes | None = None
    #: The whole id of that event (its number, tag and the account of what the client has,
    #: gateway/streams/event_ids.py): a take-over generates the stream again against it when
    #: the journal lacks events this client holds (gateway/relay/serving.py).
    last_id: str = ""
    queue: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    doomed: bool = False  # :live was gone after an empty read: one more empty read ends it


class JournalReaders:
    """Every re-attached reader of this process, served by one polling task.

    >>> readers = JournalReaders(redis)
    >>> async for event in readers.tail(scope, after=10):  # "id: 11\\ndata: ...", ...
    ...     ...
    >>> await readers.close()
    """

    def __init__(self, redis: Redis, *, poll_s: float = 0.05, idle_s: float = 1.0,
                 count: int = 256, max_queued: int = 1024, poll_timeout_s: float = POLL_TIMEOUT_S) -> None:
        self._redis = redis
        self._poll_s = poll_s
        self._poll_timeout_s = poll_timeout_s
        self._idle_s = idle_s
        self._count = count
        self._max_queued = max_queued
        self._readers: set[_Reader] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._polls = 0
        #: Continues a stream whose producer is gone, given its key and the id of the last
        #: event of the reader here that holds the most (a journal with fewer is not
        #: continued from); True while some gateway produces it.
        self.adopt: Callable[[str, str], Awaitable[bool]] | None = None
        #: Whether this process produces a stream: its producer lives, whatever ``:live``
        #: says (Redis lost it in a stall or outage; the producer re-claims it).
        self.producing: Callable[[str], bool] = lambda key: False
        self._adopting: dict[str, asyncio.Task[bool]] = {}
        self._last_poll = time.monotonic()  # when the last poll's answer came
        self._failing_since: float | None = None  # the first of the polls failing at once, in a row

    def __repr__(self) -> str:
        return f"<JournalReaders readers={len(self._readers)} polls={self._polls}>"

    async def tail(self, key: str, after: int = 0, lineage: bytes | None = None,
                   chain: bytes | None = None, last_id: str | None = None) -> AsyncIterator[bytes]:
        """Events after number ``after``, each with its ``id:``, following the live stream to
        [DONE]; only of the generation whose ``:head`` is ``lineage``, if given (else the
        one the first events come with), and only in the history whose event ``after`` is
        tagged ``chain``, if given (gateway/streams/event_ids.py). ``last_id``: event
        ``after``'s whole id, as the client has it."""
        reader = _Reader(key, after, time.monotonic(), lineage, chain, last_id or str(after))
        self._readers.add(reader)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="journal-readers")
        self._wake.set()
        try:
            while (data := await reader.queue.get()) != DONE:
                yield data
            yield DONE
        finally:
            self._readers.discard(reader)

    async def close(self) -> None:
        for task in list(self._adopting.values()):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            if not self._readers:
                self._wake.clear()
                await self._wake.wait()
                self._last_poll = time.monotonic()  # idle is not a stall
                continue
            started = time.monotonic()
            try:
                more = await self._poll()
            except Exception:  # a bug must not leave every reader waiting forever
                log.exception("the journal reader loop failed; ending its readers")
                self._end_all(self._readers)
                continue
            if not more:  # else some reader is catching up: read on at once
                await asyncio.sleep(max(0.0, self._poll_s - (time.monotonic() - started)))

    async def _poll(self) -> bool:
        """One round trip for all readers; True if some stream may have more right away."""
        now = time.monotonic()
        groups: dict[tuple[str, int, bytes | None, bytes | None], list[_Reader]] = {}
        for reader in self._readers:
            if reader.queue.qsize() < self._max_queued:
                groups.setdefault((reader.key, reader.cursor, reader.lineage, reader.chain), []).append(reader)
        if not groups:
            return False
        checks = sorted({key for (key, _, _, _), readers in groups.items()
                         if any(now - r.quiet_since >= self._idle_s for r in readers)})
        pipe = self._redis.pipeline(transaction=False)
        for key, cursor, _, _ in groups:
            pipe.xread({stream_key(key): f"0-{cursor}"}, count=self._count)
            # After its XREAD: a head is written with the first entries that need it, and
            # one read later than the entries is never older than they are.
            pipe.get(keys.journal_head(key))
        for key in checks:
            pipe.exists(live_key(key))
        self._polls += 1
        try:
            async with asyncio.timeout(self._poll_timeout_s):
                results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError, TimeoutError) as exc:
            waited = isinstance(exc, (TimeoutError, RedisTimeout))
            self._failing_since = self._failing_since or now
            if not waited and time.monotonic() - self._failing_since < READ_RETRY_S:
                log.info("reading %d journals failed, trying again: %s", len(groups), exc)
                return False
            self._failing_since = None
            log.warning("reading %d journals failed: %s", len(groups),
                        str(exc) or f"no answer in {self._poll_timeout_s:g} s")
            self._end_all([reader for readers in groups.values() for reader in readers])
            return False
        self._failing_since = None
        answered = time.monotonic()
        found_live = results[2 * len(groups):]
        live = {key: bool(found) for key, found in zip(checks, found_live, strict=True)
                if not isinstance(found, Exception)}
        if answered - now > self._idle_s or now - self._last_poll > self._idle_s + self._poll_s:
            # Redis (or this process) stalled: a ``:live`` gone now expired while no producer
            # could refresh it, and says nothing about the producer. Every reader's quiet
            # clock starts again, so producers have ``idle_s`` to re-claim their streams
            # before a take-over is considered (a take-over right after a Redis stall raced
            # a live producer: nemesis, Sentinel).
            live = {}
            for readers in groups.values():
                for reader in readers:
                    reader.quiet_since, reader.doomed = answered, False
        self._last_poll = answered
        more = False
        for i, ((key, cursor, lineage, _), readers) in enumerate(groups.items()):
            got, head = results[2 * i], results[2 * i + 1]
            head = head if isinstance(head, bytes) else None
            if isinstance(got, Exception):  # this stream only, e.g. its key now holds something else
                log.warning("reading journal %s failed: %s", key, got)
                self._end_all(readers)
            elif lineage is not None and head != lineage and (got or head is not None):
                # Another generation's head, or entries without the head of ours (a lost
                # journal with no entries yet is not a change: its producer may write it back).
                log.warning("journal %s holds another generation than the one %d reader(s) had events 1..%d of",
                            key, len(readers), cursor)
                for reader in readers:
                    self._end(reader, another_generation(cursor))
            elif got:
                entries = got[0][1]
                more |= len(entries) >= self._count
                self._deliver(readers, entries, now, head)
            else:
                self._quiet(key, readers, live, now)
        return more

    def _quiet(self, key: str, readers: list[_Reader], live: dict[str, bool], now: float) -> None:
        """Nothing new: readers that already missed ``:live`` have their stream taken over
        (or end, if it cannot be); note ``:live`` for the others."""
        for reader in readers:
            if reader.doomed:
                if self.adopt is None:
                    self._end(reader, producer_gone())
                elif key not in self._adopting:
                    task = asyncio.create_task(self._take_over(key), name="journal-take-over")
                    self._adopting[key] = task
            elif key in live:
                reader.quiet_since = now
                # A take-over here raced the producer of this same process, draining after
                # a Redis stall, continued from a journal that lacked events its client
                # already had, and left that client a gap (nemesis, Sentinel).
                reader.doomed = not live[key] and not self.producing(key)

    async def _take_over(self, key: str) -> bool:
        assert self.adopt is not None
        error = producer_gone()
        try:
            most = max((r for r in self._readers if r.key == key), key=lambda r: r.cursor, default=None)
            produced = await asyncio.wait_for(self.adopt(key, most.last_id if most else "0"), ADOPT_TIMEOUT_S)
        except TimeoutError:
            log.warning("taking over the stream %s did not start in %.0f s; its readers may re-attach", key,
                        ADOPT_TIMEOUT_S)
            produced, error = False, error_event(Unavailable(
                "taking the stream over did not start in time; re-attach", retry_after_s=1))
        except SluiceError as exc:  # it cannot be continued, and says why
            log.warning("the stream %s cannot be taken over: %s", key, exc.message)
            produced, error = False, error_event(exc)
        except (RedisError, OSError) as exc:  # Redis away mid-way: the readers may re-attach
            log.warning("taking over the stream %s failed: %s: %s", key, type(exc).__name__, exc)
            produced, error = False, error_event(Unavailable(
                "the stream's journal could not be read; re-attach", retry_after_s=1))
        except Exception:  # a take-over that fails must still end its readers
            log.exception("taking over the stream %s failed", key)
            produced = False
        finally:
            del self._adopting[key]
        for reader in [r for r in self._readers if r.key == key]:
            if produced:
                reader.doomed, reader.quiet_since = False, time.monotonic()
            else:
                self._end(reader, error)
        return produced

    def _deliver(self, readers: list[_Reader], entries: list[tuple[bytes, dict[bytes, bytes]]], now: float,
                 head: bytes | None) -> None:
        """Hand the entries after the readers' cursor out, up to ``[DONE]``; a hole before
        the next one (or a lost head), or an event of another history than the readers'
        (gateway/streams/event_ids.py), ends them with the in-band error instead."""
        frames: list[bytes] = []
        last, chain, last_id = readers[0].cursor, readers[0].chain, readers[0].last_id
        tail: bytes | None = None
        lost: bytes | None = None
        for entry_id, fields in entries:
            number = entry_number(entry_id)
            event = expand(head, fields[b"d"])
            if number != last + 1 or event is None:
                lost = history_lost(last, number if number != last + 1 else None)
                break
            tag, prev = marks(fields.get(b"s", b""))
            if not follows(chain, tag, prev):
                log.warning("journal %s: event %d belongs to another history than the one %d reader(s) had "
                            "events 1..%d of (Redis lost data after a take-over)", readers[0].key, number,
                            len(readers), last)
                lost = another_generation(last)
                break
            last, chain, tail = number, tag or chain, id_tail(fields.get(b"s", b""))
            frames.append(frame(number, event, tail))
            if event == DONE:
                break
        if frames:
            last_id = f"{last}.{tail.decode()}" if tail else str(last)
        for reader in readers:
            reader.cursor, reader.quiet_since, reader.doomed, reader.chain = last, now, False, chain
            reader.last_id = last_id
            if frames and head is not None:
                reader.lineage = head
            for data in frames:
                reader.queue.put_nowait(data)
            if lost is not None:
                self._end(reader, lost)
            elif frames[-1] == DONE:
                self._readers.discard(reader)

    def _end_all(self, readers: Iterable[_Reader]) -> None:
        """The journal could not be read: each reader ends with an error, and may re-attach."""
        failed = error_event(Unavailable("the stream's journal could not be read; re-attach", retry_after_s=1))
        for reader in list(readers):
            self._end(reader, failed)

    def _end(self, reader: _Reader, error: bytes) -> None:
        reader.queue.put_nowait(error)
        reader.queue.put_nowait(DONE)
        self._readers.discard(reader)
