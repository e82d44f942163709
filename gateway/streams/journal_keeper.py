"""Finished journals, kept a while by the gateway that produced them, written again if Redis loses them.

A resumable stream's client may come back after its stream ended (it left on purpose,
its connection broke near the end). If Redis lost its data in between (a restart without
persistence, FLUSHALL), the journal is gone and no producer is left to write it again, so
the client's ``Last-Event-ID`` gets ``stream_history_lost``. The producing gateway process
therefore keeps each finished stream's events (gateway/streams/journal_history.py) for
``KEEP_S`` after its end. When the process's loss watcher (gateway/loss_watch.py) sees that
Redis may have lost writes (a new epoch, Redis back after being unreachable, another server
answering: a restart from a snapshot, or a Sentinel failover to a replica that lacked the
last writes, can lose a stream's last events, and with them its end, and keep the epoch: a
reader's take-over then generated the tail again and the stream was billed twice), it writes
every kept journal back (``RESTORE``, which fills only what is missing), with its ``:head``, its
Idempotency-Key's record (``done``) and what is left of its TTL, unless the key was claimed
again meanwhile.

Memory: a kept journal is the bytes its stream reserved in the journal quota, which holds
them for ``journal_done_ttl_s`` (longer than ``KEEP_S``). Redis losing its data loses those
reservations too: a journal written back is reserved again; one that no longer fits its
tenant's or the total bound is kept no longer (it expires with its TTL). The quota bounds
the fleet's journals, not what one process keeps: up to ``journal_max_bytes`` (2 GiB) could
end on one gateway within ``KEEP_S``. So each process keeps at most ``keep_bytes``
(``journal_keep_max_bytes``) of copies, dropping the oldest first (the streams whose clients
are least likely to come back); a copy dropped early only means its journal is not written
back should Redis lose it, as after ``KEEP_S``.

>>> keeper = JournalKeeper(redis)
>>> keeper.keep(Finished(scope, owner, fp, head, history, done_ttl_ms, budget))
>>> await keeper.close()
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.loss_watch import CHECK_S, LossWatch
from gateway.streams.journal_history import JournalHistory
from sluice import keys
from sluice.errors import SluiceError

log = logging.getLogger("sluice.journal")

#: How long after its end a stream's events stay in its gateway's memory.
KEEP_S = 60.0
#: What the copies of one process may hold together (the events' bytes, as the journal
#: quota counts them; ``journal_keep_max_bytes``).
KEEP_BYTES = 256 * 1024 * 1024
#: A process dropping copies early says so at most this often.
DROP_LOG_S = 60.0
#: A kept journal is back this long after a loss its keeper can see (the loss noticed
#: within the watcher's ``CHECK_S``, well within the two idle checks, ``JournalReaders``'
#: ``idle_s``, after which a reader takes over a stream whose journal lost its end; the
#: write-back's round trips; a failover's reconnect): how long a re-attach that finds a
#: finished stream's journal missing waits for it.
WRITE_BACK_S = 3.0
#: Kept journals written back at once, each in its own round trip. One at a time, a pass over
#: a minute of finished streams took as many round trips as it had journals: about 0.3 s each
#: while a Cluster failover settled, and one journal came back 28 s after its loss was seen,
#: 18 s after its client's re-sent POST had waited 10 s for a producer and generated the stream
#: again (nemesis, Cluster, 6ec4b61: nem-1291 billed twice). Bounded: the write-backs share the
#: process's Redis connections with its requests.
RESTORE_CONCURRENCY = 16

#: Write a finished journal back, if Redis lost it (or its end) and nobody claimed the key
#: since (no ``:live`` but this producer's own; no record, or one this producer owns). A
#: failover to a replica that lacked the stream's last writes brings back this producer's
#: ``:live`` too (its release was one of them): that claim is stale, and deleted once the
#: end is back (it held the write-back off until it expired, a reader then took the stream
#: over and generated its tail again: nemesis, Sentinel, billed twice). KEYS: stream, head,
#: record, live. ARGV: ttl ms, head, fp, owner, number of events, "1" to write the record
#: back (``done``) also over a whole journal, then (data, state) per event. That is for a
#: producer that completed its stream and found its record gone when it settled it: Redis
#: lost the record alone (nemesis, Cluster: a re-sent request then found the key free and
#: ran it again, billed twice). Returns the number of events written.
RESTORE = """
local live = redis.call('GET', KEYS[4])
if live and live ~= ARGV[4] then return 0 end
local owner = redis.call('HGET', KEYS[3], 'owner')
if owner and owner ~= ARGV[4] then return 0 end
local last = 0
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if top[1] then last = tonumber(string.match(top[1][1], '%d+$')) end
local n = last
local short = last < tonumber(ARGV[5])
if not short and ARGV[6] ~= '1' then return 0 end
if short then
  n = 0
  for i = 7, #ARGV, 2 do
    n = n + 1
    if n > last then redis.call('XADD', KEYS[1], '0-' .. n, 'd', ARGV[i], 's', ARGV[i + 1]) end
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1]) end
end
if not owner and ARGV[3] ~= '' then
  redis.call('HSET', KEYS[3], 'fp', ARGV[3], 'stream', '1', 'state', 'done', 'owner', ARGV[4])
  redis.call('PEXPIRE', KEYS[3], ARGV[1])
elseif owner then
  redis.call('HSET', KEYS[3], 'state', 'done')  -- as this producer settled it before the loss
end
if live then redis.call('DEL', KEYS[4]) end
return n - last
"""


class Reservation(Protocol):
    """The journal quota's hold on a stream's bytes (gateway/streams/journal_quota.py)."""

    async def reserve(self, more: int, *, new: bool = False) -> SluiceError | None: ...
    async def settle(self, used: int, hold_ms: int) -> None: ...


@dataclass(eq=False)
class Finished:
    """A finished stream as its producer leaves it: what to write back, and for how long."""

    scope: str
    owner: str
    fingerprint: str
    head: bytes
    history: JournalHistory
    done_ttl_ms: int
    budget: Reservation | None
    stored_bytes: int
    ended_at: float = field(default_factory=time.monotonic)

    def ttl_ms(self) -> int:
        return self.done_ttl_ms - int((time.monotonic() - self.ended_at) * 1000)


class JournalKeeper:
    """The finished journals of one gateway process (see the module)."""

    def __init__(self, redis: Redis, *, keep_s: float = KEEP_S, keep_bytes: int = KEEP_BYTES,
                 watch: LossWatch | None = None, check_s: float = CHECK_S) -> None:
        self._redis = redis
        self._restore = redis.register_script(RESTORE)
        self._keep_s = keep_s
        self._keep_bytes = keep_bytes
        #: What the copies in ``_ended`` hold (a copy replaced in ``_kept`` is held until it
        #: leaves the deque, so it counts until then).
        self.bytes = 0
        #: Copies dropped before their time, to stay within ``keep_bytes``.
        self.dropped = 0
        self._dropped_logged = 0
        self._drop_logged_at = -DROP_LOG_S
        self._kept: dict[str, Finished] = {}
        #: The same, oldest first: what has expired is found at the front. (Walking every
        #: kept journal at each look, twice a second, was 2 % of a gateway's CPU at 1,000
        #: one-token resumable streams a second: 60,000 kept.)
        self._ended: collections.deque[Finished] = collections.deque()
        #: The process's loss watcher (its own, looking every ``check_s``, when none is given).
        self._watch = watch if watch is not None else LossWatch(redis, check_s=check_s)
        self._owns_watch = watch is None
        self._watch.listen(self._after_look)
        self.restored = 0

    def __repr__(self) -> str:
        return f"<JournalKeeper kept={len(self._kept)} bytes={self.bytes} restored={self.restored}>"

    def keep(self, finished: Finished) -> None:
        if min(self._keep_s * 1000, finished.ttl_ms()) <= 0:
            return
        if finished.history.nbytes > self._keep_bytes:  # alone over the bound: not kept, the others stay
            self._kept.pop(finished.scope, None)  # (an older copy of the same key is not the stream's end)
            self._dropped(1)
            return
        self._kept[finished.scope] = finished
        self._ended.append(finished)
        self.bytes += finished.history.nbytes
        dropped = 0
        while self.bytes > self._keep_bytes:  # the oldest go first
            dropped += self._forget(self._ended.popleft())
        if dropped:
            self._dropped(dropped)
        self.watch()

    def _dropped(self, count: int) -> None:
        self.dropped += count
        now = time.monotonic()
        if now - self._drop_logged_at >= DROP_LOG_S:
            log.warning("finished journals kept for write-back reached %d bytes in this process "
                        "(journal_keep_max_bytes): %d dropped early since the last report, oldest first; "
                        "should Redis lose its data, those streams are not written back",
                        self._keep_bytes, self.dropped - self._dropped_logged)
            self._drop_logged_at, self._dropped_logged = now, self.dropped

    def _forget(self, finished: Finished) -> bool:
        """``finished``, just taken from the front of ``_ended``, is kept no more. False if
        it was not anymore (kept again since, or over its quota)."""
        self.bytes -= finished.history.nbytes
        if self._kept.get(finished.scope) is not finished:
            return False
        del self._kept[finished.scope]
        return True

    def watch(self) -> None:
        """Make sure Redis is watched (a loss right after a stream ended must find the epoch it
        was produced in already read): the committer calls it when a stream starts."""
        self._watch.start()

    async def close(self) -> None:
        self._kept.clear()
        self._ended.clear()
        self.bytes = 0
        if self._owns_watch:
            await self._watch.close()

    async def _after_look(self, lost: bool) -> bool:
        """After each of the watcher's looks: drop old copies; if Redis may have lost writes,
        write every kept journal back (False if some write failed: again at the next look)."""
        self._expire()
        return await self.restore_all() if lost and self._kept else True

    def _expire(self) -> None:
        """Drop the copies kept past ``keep_s`` or their TTL. Copies end in the order they
        are kept; one whose TTL ran out before an older one's (a shorter TTL) waits for that
        one, and is written back no more meanwhile (:meth:`_restore_one` skips it)."""
        now = time.monotonic()
        ended = self._ended
        while ended and (now - ended[0].ended_at > self._keep_s or ended[0].ttl_ms() <= 0):
            self._forget(ended.popleft())

    async def restore_all(self) -> bool:
        """Redis lost its data: write every kept journal back (those that still fit their
        quota), ``RESTORE_CONCURRENCY`` at a time. False when some write failed: the watch
        loop tries again at its next look."""
        gate = asyncio.Semaphore(RESTORE_CONCURRENCY)

        async def one(finished: Finished) -> bool:
            async with gate:
                try:
                    await self._restore_one(finished)
                except (RedisError, OSError) as exc:
                    log.warning("could not write the finished journal %s back: %s", finished.scope, exc)
                    return False
                return True

        return all(await asyncio.gather(*(one(finished) for finished in list(self._kept.values()))))

    async def restore(self, scope: str) -> None:
        """The kept stream ``scope`` completed, and its producer found its record gone when
        it settled it: write the record back ``done`` now, and the journal where Redis lacks it."""
        finished = self._kept.get(scope)
        if finished is not None:
            await self._restore_one(finished, record=True)

    async def _restore_one(self, finished: Finished, record: bool = False) -> None:
        ttl_ms = finished.ttl_ms()
        if ttl_ms <= 0:
            return
        args: list[bytes | str | int] = [ttl_ms, finished.head, finished.fingerprint, finished.owner,
                                         len(finished.history), "1" if record else "0"]
        for stored, state in finished.history.since(1):
            args += [stored, state]
        scope = finished.scope
        written = int(await self._restore(
            keys=[keys.journal(scope), keys.journal_head(scope), keys.idempotency(scope), keys.journal_live(scope)],
            args=args))
        if not written:
            return
        self.restored += 1
        log.warning("journal %s: Redis lost %d event(s) of this finished stream; written back", scope, written)
        if finished.budget is not None:  # its reservation was lost with it
            refusal = await finished.budget.reserve(finished.stored_bytes, new=True)
            if refusal is None:
                await finished.budget.settle(finished.stored_bytes, ttl_ms)
            else:  # over its bound now: no more copies of it, and it goes with its TTL
                log.warning("finished journal %s is over its quota: %s", scope, refusal.message)
                self._kept.pop(scope, None)
