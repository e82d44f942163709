"""Whether the gateway process that produced a stream still runs, when Redis forgot the stream.

A client whose resumable stream Redis lost (a restart without persistence, ``FLUSHALL``, a
failover to a replica that lacked it) holds events that one other party may still have:
the stream's producer, if its process runs (it writes the journal back within ``:live``'s
refresh period, gateway/streams/journal.py) or comes back from a stall. So the client's
re-sent POST waited ``wait_for_producer_s`` (10 s) for it before generating the stream
again (gateway/streams/regenerate.py), and its ``GET`` as long before being told to re-send.
The wait counted from each attempt: under repeated faults every re-sent POST began it again,
even when the producer's gateway had been killed long before. The nemesis's one-Redis run
ended its inexact resumable streams at their deadline so, "waiting for its stream's
producer" (8fa2447, d483ace: 99.37-99.43 % exact).

So every gateway process names itself in the event ids it produces (the first
:data:`INSTANCE_HEX` hex digits of their producer tag, gateway/streams/event_ids.py) and
keeps a *beat* in Redis, ``sl:producer:{instance}``, set every :data:`BEAT_S` to expire
after :data:`BEAT_TTL_MS`: ``:live``'s TTL plus the stall a producer may come back from.
A lost stream whose producer's beat is missing, while Redis has answered this process for
as long since it last lost data (a loss takes every beat with it, and a stalled producer
sets its own again only once it runs), is not waited for: its producer's process has been
silent longer than the wait allows for. The beat thus says no more than the wait would have,
but counts from the producer's silence instead of from each attempt of its client. A
producer that comes back later still finds its stream claimed by another and stops, as it
did after the full wait (gateway/streams/journal.py, ``RECLAIM_GRACE_S``).

"Seen Redis answer for as long" counts from this process's start as well: a process that
started after a loss never saw it (its watch counts no loss before its first look), and a
producer that runs sets its beat again only within :data:`BEAT_S`. And a missing beat is
trusted only once a look at Redis, taken then, finds no loss since the watch's last (it
looks every half second): the beat may have gone with data lost a moment ago. (The nemesis,
Sentinel, 7be22dc: a gateway restarted 0.4 s before a re-sent POST trusted the missing beat of
the process it replaced; that producer was dead, so no harm came, but one alive in another
process would have had its stream generated twice.)

And none of this waits where nothing was lost: once this process has seen Redis answer
without a loss for ``wait_for_producer_s`` (as long as any producer takes to write its
stream back after one), a stream Redis does not know was never there, expired, failed, or
went with a loss older than any write-back, so nobody writes it now: :meth:`ProducerBeat.gone`
says so (after one look at Redis, as for a missing beat), whatever the id. Before, a
``Last-Event-ID`` on a key never used, or naming a process that runs, held its request 10 s,
polling Redis every 50 ms (~575 commands, 55-75 ms of the gateway's CPU each), and any
client could send as many at once as it liked.

Ids without an instance (from gateways before this) wait as before while a loss is recent.
So does a take-over that finds a stream without its plan (gateway/relay/serving.py,
``take_over``): ended by the beat, a loaded CI run told the readers of a producer stopped
5 s across a ``FLUSHALL`` that their stream was lost, so only the re-sent POST and the
``GET`` use it.

>>> beat = ProducerBeat(redis, watch)   # one per process; Idempotency owns it
>>> beat.start()
>>> await beat.gone(tag)                # the tag of the client's Last-Event-ID
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from gateway.admission.queue import stop_tasks
from gateway.streams.journal import LIVE_TTL_MS, RECLAIM_GRACE_S
from sluice import keys
from sluice.single_flight import SingleFlight

if TYPE_CHECKING:
    from gateway.loss_watch import LossWatch

log = logging.getLogger("sluice.journal")

#: How many hex digits of a producer tag name its gateway process (6: 16.7 M names, so two
#: processes alive at once share one with odds far below anything else that can go wrong).
INSTANCE_HEX = 6
#: How long past ``:live``'s TTL a producer's process may still be stalled (a long GC or
#: swap pause, a SIGSTOP, a VM migration) and come back to write its stream.
PRODUCER_STALL_S = 5.0
#: How often a process sets its beat, and how long one lives: a producer's ``:live`` and
#: the stall it may still come back from. A missing beat thus says no more than the wait
#: for the producer would have (``wait_for_producer_s``), but counted from the producer's
#: last beat instead of from each attempt of its client.
BEAT_S = 1.0
BEAT_TTL_MS = LIVE_TTL_MS + int(PRODUCER_STALL_S * 1000)
#: How long this process must have seen Redis answer, since it last lost data or was away,
#: before a missing beat says its process is gone: a loss takes every beat with it, and a
#: producer stalled meanwhile sets its own again only once it runs. So a full beat's life,
#: as if each beat had been set just before the loss.
BEAT_GRACE_S = BEAT_TTL_MS / 1000
#: How long one look at a beat answers for, and for how many processes answers are kept.
SEEN_S = 0.25
SEEN_MAX = 1024


def wait_for_producer_s() -> float:
    """How long a caller that holds events of a stream Redis lost waits for its producer to
    write the journal again (gateway/streams/journal.py), within the caller's deadline: a
    running producer refreshes ``:live`` far more often than it expires; one whose process
    is stalled writes again only once it runs, and then first gives a gateway that may have
    taken the stream over ``RECLAIM_GRACE_S`` to re-claim it. Giving up means the client
    runs the whole request again, so the wait is generous (nemesis: clients that came back
    while their producer was stopped got 502 one to two seconds before it wrote the journal
    back, at 3 s and again at 5 s). It is also how long after a loss a producer may still
    write back at all (:meth:`ProducerBeat.gone`)."""
    return LIVE_TTL_MS / 1000 + PRODUCER_STALL_S + RECLAIM_GRACE_S


def instance_of(tag: bytes | None) -> bytes | None:
    """The gateway process a producer tag names; None for a tag without one."""
    if tag is None or len(tag) != INSTANCE_HEX + 8:
        return None
    return tag[:INSTANCE_HEX]


class ProducerBeat:
    """This process's beat, and a look at others' (see the module)."""

    def __init__(self, redis: Any, watch: LossWatch | None = None) -> None:
        self._redis = redis
        #: Without a loss watch no missing beat is trusted: every lost stream is waited for.
        self._watch = watch
        self._born = time.monotonic()
        self.instance = secrets.token_hex(INSTANCE_HEX // 2).encode()
        self._task: asyncio.Task[None] | None = None
        self._seen: dict[bytes, tuple[float, bool]] = {}  # instance -> (when looked, gone)
        self._looks = SingleFlight[bytes, bool]()

    def __repr__(self) -> str:
        return f"<ProducerBeat {self.instance.decode()}>"

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="producer-beat")

    async def close(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(keys.producer(self.instance.decode()))

    async def gone(self, tag: bytes | None) -> bool:
        """Whether no producer will write back the stream whose event was tagged ``tag``:
        Redis lost nothing for longer than a write-back takes, or the process that produced
        it is known not to run. Its waiters ask every 50 ms: concurrent asks share one look, and an answer serves
        for :data:`SEEN_S`."""
        answered_s = self._answered_s()
        if answered_s >= wait_for_producer_s():
            # No loss for as long as any producer takes to write its stream back: a stream
            # Redis does not know was never there, expired or failed, or went with a loss
            # older than that, and nobody writes it now. Every master is asked: on a Cluster
            # a node that restarted empty leaves the epoch as it was (a review).
            return await self._no_loss_since_last_look(full=True)
        instance = instance_of(tag)
        if instance is None or instance == self.instance or answered_s < BEAT_GRACE_S:
            return False
        seen = self._seen.get(instance)
        if seen is not None and time.monotonic() - seen[0] < SEEN_S:
            gone = seen[1]
        else:
            gone = await self._looks.run(instance, lambda: self._look(instance))
        return gone and await self._no_loss_since_last_look()

    async def _no_loss_since_last_look(self, *, full: bool = False) -> bool:
        assert self._watch is not None  # (else _answered_s is 0)
        try:
            return await self._watch.confirm(full=full)
        except (RedisError, OSError):
            return False

    def _answered_s(self) -> float:
        """How long this process has seen Redis answer without losing data (see the module)."""
        if self._watch is None:
            return 0.0
        return min(self._watch.since_loss_s(), time.monotonic() - self._born)

    async def _look(self, instance: bytes) -> bool:
        try:
            gone = not await self._redis.exists(keys.producer(instance.decode()))
        except (RedisError, OSError):
            return False
        if len(self._seen) >= SEEN_MAX:  # (tags are the clients' to choose)
            self._seen.clear()
        self._seen[instance] = (time.monotonic(), gone)
        return gone

    async def _run(self) -> None:
        name = keys.producer(self.instance.decode())
        while True:
            try:
                await self._redis.set(name, b"1", px=BEAT_TTL_MS)
            except (RedisError, OSError) as exc:  # the loss watch tells of Redis away
                log.debug("producer beat not set: %s", exc)
            await asyncio.sleep(BEAT_S)
