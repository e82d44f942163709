"""Resumable streams: the SSE events of a stream started with an ``Idempotency-Key``
are journaled in Redis, so a client can re-attach and get the rest.

    sl:journal:{scope}        Redis stream; entry id ``0-N`` holds event N: "d" = SSE data
                              bytes (a chunk's without what every chunk repeats, see
                              ``compact``), "s" = its producer's mark
                              (gateway/streams/event_ids.py), then the token ids it
                              carries (see gateway/streams/takeover.py)
    sl:journal:{scope}:live   the producing gateway's token, refreshed while it produces
    sl:journal:{scope}:plan   what another gateway needs to take the stream over (deleted
                              with the stream's last event: a finished stream needs none)
    sl:journal:{scope}:head   the bytes every chunk of the stream starts with (its id, created
                              time and model, ~110 B): stored once, not in each entry

``scope`` is a hash of the caller's API key id and its Idempotency-Key (see
gateway/streams/idempotency.py), so one tenant can neither read nor disturb another's.

The generation runs in a producer task (:class:`JournalWriter`) that does not depend
on any client. Each event goes to the journal, then to the first client
(:meth:`JournalWriter.subscribe`) with the ``id: N.tag`` the journal gave it (``tag``
names the producer's history, gateway/streams/event_ids.py): a client
never has an event the journal lacks, so when the producing gateway dies, another one
continues the stream from the journal (gateway/streams/takeover.py) and the client, re-attached
with its ``Last-Event-ID``, gets exactly the rest. Re-attaching clients read the
journal through the one shared reader loop of gateway/streams/journal_readers.py; so does a
first client that falls too far behind.

A stream begins with its first write, in one round trip: ``APPEND`` with its first events
also promotes the key's claim (record ``streaming``, plan stored: gateway/streams/idempotency.py),
and the same pipeline carries the stream's first journal memory reservation
(gateway/streams/journal_quota.py). The producer sends that write itself, at once, rather
than through the committer's next round (:meth:`JournalCommitter.write_now`); its request
answers only once both are known (:meth:`JournalWriter.started`): a refused promotion (the
key is another request's now) or reservation (429), or Redis failing, never reaches a
client, and the request undoes what the write did (Idempotency.abandon_stream, and the
reservation only while it is still the key's). Later writes go in the committer's rounds.

Never a silent gap:

- a journal is never trimmed. Its events are bounded by the request (every event but
  the first and last of a choice carries a token, see gateway/streams/journal_quota.py); a
  stream that still reaches ``max_events`` ends there with an in-band error, and its
  bytes count against its tenant's bound (gateway/streams/journal_quota.py);
- a reader whose next entry is not the one after its cursor gets an in-band error,
  then ``[DONE]`` (:func:`history_lost`), never the events after the hole;
- a take-over needs events 1..N, all of them (gateway/streams/takeover.py).

When Redis loses its data (a restart without persistence, a failover that lost the
latest writes, FLUSHALL), ``:live`` is missing rather than held by someone else: the
producer still has its generation, and a copy of every event it journaled
(gateway/streams/journal_history.py, within the journal's own byte quota). ``APPEND`` finds
the journal short of the events before the batch: it re-claims ``:live`` (and restores the
Idempotency-Key's record, see gateway/streams/idempotency.py) and writes nothing (if this
process stalled past ``:live``'s TTL since its last write, another gateway may have taken the
stream over before the loss: this producer first gives such a gateway time to re-claim it,
see ``APPEND``); the
producer's next call puts the missing events back, with the same ids, then its new ones,
and the stream's plan, in one script: a reader sees the journal as it was before the loss
or whole again, never a gap and never a partial history a take-over could continue from.
The first client, fed by the producer, goes on as if nothing happened; a client that
re-attaches from before the loss gets exactly the rest. A journal Redis loses after its
stream ended is written back by the gateway that produced it, for ``KEEP_S`` after the end
(gateway/streams/journal_keeper.py); past that, or if that gateway died too, a re-attach
from before the loss gets the in-band ``stream_history_lost`` error. ``:live`` missing while the journal already
holds events past this producer's means someone else took the stream over and ended it
(unless the key's record still names this producer its owner: then they are its own batch,
whose reply it lost): that is :class:`JournalLost`, as is ``:live`` held by another gateway. A producer that lost
its stream is done for good: it writes nothing more, whatever Redis loses later, and its
generation is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from gateway.loss_watch import LossWatch
from gateway.streams.event_ids import DONE, frame, id_tail, mark, tag_of
from gateway.streams.journal_history import JournalHistory
from gateway.streams.journal_keeper import KEEP_BYTES, Finished, JournalKeeper
from gateway.surfaces.openai import CHOICE_START, PLAIN_END
from sluice import keys, redis_faults
from sluice.errors import InvalidRequest, SluiceError, UpstreamFailed, error_event

log = logging.getLogger("sluice.journal")

#: ``:live`` expires this long after the last refresh (a gateway that died stops refreshing).
LIVE_TTL_MS = 3000
#: Refresh ``:live`` at least this often, even through long silences (a migration).
_LIVE_REFRESH_S = 0.5
#: How long a producer whose generation ended retries the journal writes it still owes
#: while Redis is down or stalled (its events wait in memory, within the journal's bounds).
DRAIN_S = 30.0
_RETRY_S = 0.1
#: Pause after a round whose writes failed: Redis is down or far, do not spin.
_FAILED_ROUND_PAUSE_S = 0.05
#: A producer re-claims a missing ``:live`` only up to this long before its claim could
#: have expired (see ``APPEND``): covers the clock skew between a gateway and Redis, and a
#: batch's time on the wire.
RECLAIM_MARGIN_MS = 500
#: The process counts as stalled (SIGSTOP, a blocked event loop) when its loop did not run
#: for this long: see :meth:`JournalCommitter.awake_since`.
STALL_S = 1.0
_TICK_S = 0.2
#: A producer refused a re-claim after its process stalled waits this long before it
#: re-claims anyway: a gateway that took the stream over and lives re-claims it first (it
#: refreshes ``:live`` every ``_LIVE_REFRESH_S``), and this one then finds it held.
RECLAIM_GRACE_S = 2.0
#: No re-claim deadline (Lua reads numbers as doubles: exact up to 2**53).
_NO_DEADLINE_MS = 2**53


def now_ms() -> int:
    return int(time.time() * 1000)

#: Reads a journal from after event N on, of the generation whose ``:head`` is given (None:
#: any), in the history whose event N has the given tag (None: any, see
#: gateway/streams/event_ids.py): ``JournalReaders.tail``.
CatchUp = Callable[[str, int, bytes | None, bytes | None], AsyncIterator[bytes]]


def stream_key(key: str) -> str:
    return keys.journal(key)


def live_key(key: str) -> str:
    return keys.journal_live(key)


def producer_gone() -> bytes:
    """The in-band error a reader gets when the stream ends without its ``[DONE]``."""
    return error_event(UpstreamFailed("the stream's producer is gone; the rest is lost"))


def another_generation(after: int) -> bytes:
    """The in-band error a reader gets when the journal it follows now holds another
    generation of the stream (Redis lost data, and a failover or a re-sent request brought
    another one): its client has events 1..``after`` of the first, which never go on with
    another's."""
    return error_event(UpstreamFailed(
        f"the stream's journal no longer holds the generation of events 1..{after} (Redis lost data); "
        "the stream cannot be resumed from there", code="stream_history_lost"))


def history_lost(after: int, found: int | None) -> bytes:
    """The in-band error a reader gets instead of a silent gap: its next event, ``after + 1``,
    is not in the journal (Redis lost it), only ``found`` and later (or nothing)."""
    what = f"events {after + 1}..{found - 1} are" if found is not None and found > after + 2 else \
        f"event {after + 1} is"
    return error_event(UpstreamFailed(
        f"{what} no longer in the stream's journal (Redis lost data); the stream cannot be resumed "
        "from there", code="stream_history_lost"))


def compact(head: bytes, event: bytes) -> bytes:
    """What the journal stores of ``event``: a chunk without the stream's ``head`` (then it
    starts with ``,``), a plain one (see gateway/surfaces/openai.py) as ``.`` and only its index
    and delta; any other event whole (it starts with ``data:`` or ``event:``)."""
    if not head or not event.startswith(head):
        return event
    rest = event[len(head):]
    if rest.startswith(CHOICE_START) and rest.endswith(PLAIN_END):
        return b"." + rest[len(CHOICE_START):-len(PLAIN_END)]
    return rest


def expand(head: bytes | None, stored: bytes) -> bytes | None:
    """An event as it was produced, from :func:`compact`'s bytes and the stream's ``:head``
    (None when it needs a head that is lost)."""
    if not stored.startswith((b",", b".")):
        return stored
    if head is None:
        return None
    if stored.startswith(b"."):
        return head + CHOICE_START + stored[1:] + PLAIN_END
    return head + stored


def entry_number(entry_id: bytes | str) -> int:
    """The event number of a journal entry id (``0-N``)."""
    ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(ident.split("-", 1)[1])


class FirstReader:
    """The first client of a resumable stream: events as they are produced, not as flushed.

    If it falls more than ``lag_max`` events behind, the producer lets go of it and it
    goes on from the journal (``catch_up``), so a slow client costs no unbounded memory;
    so does one whose producer lost the stream. From the journal it gets only events of its
    own generation (``lineage``: the stream's ``:head``): after Redis lost data, the journal
    may hold another one (the nemesis, Sentinel: a producer lost its journal to an older
    generation that a failover brought back, and its client went on with that one's events).
    """

    def __init__(self, key: str, catch_up: CatchUp, lag_max: int, lineage: bytes | None = None,
                 tag: bytes | None = None) -> None:
        self._key = key
        self._catch_up = catch_up
        self._lag_max = lag_max
        self._lineage = lineage
        self._tag = tag  # its producer's: every event it gets from the producer carries it
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._lagging = False
        self._closed = False

    def offer(self, number: int, event: bytes, tail: bytes | None) -> bool:
        """Hand over event ``number`` (``tail``: its id's, event_ids.id_tail); False once this
        reader wants no more from the producer."""
        if self._closed:
            return False
        if self._queue.qsize() >= self._lag_max:
            self._lagging = True
            self._queue.put_nowait(None)
            return False
        self._queue.put_nowait((number, frame(number, event, tail)))
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
            # A client that has no event yet may get any one generation whole; one that has
            # goes on only in its producer's history (a take-over's continuation of it included).
            async with contextlib.aclosing(self._catch_up(self._key, last, self._lineage if last else None,
                                                          self._tag if last else None)) as rest:
                async for data in rest:
                    yield data
        else:
            yield producer_gone()
            yield DONE

    async def close(self) -> None:
        """The client is gone: the producer drops this reader and goes on journaling."""
        self._closed = True


#: Appends events to a journal if this producer still owns it: a producer that stalled
#: past ``LIVE_TTL_MS`` and was taken over must not write on. ``:live`` missing is not a
#: take-over (Redis lost it, or it expired and nobody took over): unless the journal
#: holds events past this producer's, re-claim it and write on. The Idempotency-Key's
#: record, if Redis lost it, is restored the same way (this producer owns the key), so a
#: retry or a re-attach finds the one generation. A journal that lacks events before the
#: batch (Redis lost them) gets nothing appended: the producer is told to send them all
#: again first (status 3), so readers never see events after a hole. Entries up to the
#: journal's last are skipped (a write retried after its reply was lost). The plan lives
#: as long as the journal (a stream running close to the TTL must stay continuable), is
#: written again with a batch that re-writes a lost journal, and goes with the last event.
#: A producer whose process stalled (SIGSTOP, a blocked loop) since its last confirmed
#: write re-claims a missing ``:live`` only until its claim could have expired (that write
#: plus ``LIVE_TTL_MS``, less a margin, on Redis's clock): past that, another gateway may
#: have taken the stream over and Redis lost the evidence with the data (a stalled
#: producer re-claiming then wrote its stale history over the new producer's, which
#: stopped: two generations spliced, then nobody finished the stream). Refused (4), it
#: waits ``RECLAIM_GRACE_S``: a gateway that took the stream over and lives writes its
#: journal back within a refresh period, and this one then finds ``:live`` held (0); if
#: nobody did, it re-claims. A producer that ran all along and only could not reach Redis
#: (Redis down, restarting) re-claims at once: nobody else could take the stream over
#: while Redis was down, and a loss took the plan a take-over needs. (Left open: this
#: gateway cut off from a Redis the others reach for past the TTL, a take-over then, a loss
#: of that Redis's data, and the taker cut off too for the whole grace.)
#: KEYS: stream, live, head, plan, record. ARGV: owner, stream ttl ms, live ttl ms, number
#: of the first event, head, "1" when the batch ends the stream, the request's fingerprint
#: ("": no record to restore), the plan ("": none to restore), the unix ms until which a
#: missing ``:live`` may be re-claimed, the first event this producer has (its history's
#: ``base``: the events before a regenerated stream's first are its client's alone), the
#: Idempotency-Key record's TTL ms when the batch promotes the claim ("": it does not, see
#: below), then (data, state) per event.
#: A claimed stream's first batch promotes it (what gateway/streams/idempotency.py's START
#: does alone, in the same round trip as the first events): only while nobody else owns the
#: key (``:live`` as above, and the record's ``owner``: 0 otherwise, nothing written), it
#: makes the record ``streaming`` with that TTL, and stores the plan (sent with it). A
#: record Redis lost while the claim was pending is restored (status 2).
#: A batch that finds events from its first on while ``:live`` is missing is this
#: producer's own when the record names it the owner: its write reached Redis, its reply did
#: not (a stall, a failover and back), and it goes on (nemesis, Sentinel: it took its own
#: batch for a take-over, stopped, and billed none of the 54 tokens it served).
#: Returns {1 written | 2 written, but Redis had lost :live or the record | 3 nothing
#: written: send events last + 1.. first | 0 lost, last | 4 nothing written: :live missing
#: past the re-claim deadline, last}.
APPEND = """
local owner = redis.call('GET', KEYS[2])
local first = tonumber(ARGV[4])
local last = 0
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if top[1] then last = tonumber(string.match(top[1][1], '%d+$')) end
local status = 1
local promote = ARGV[11] ~= ''
if owner == false then
  -- Events past this batch's first: someone else's (a take-over, which made itself the
  -- record's owner), or this producer's own batch whose reply it never got.
  if last >= first and redis.call('HGET', KEYS[5], 'owner') ~= ARGV[1] then return {0, last} end
  local clock = redis.call('TIME')
  if tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) > tonumber(ARGV[9]) then return {4, last} end
  status = 2
elseif owner ~= ARGV[1] then
  return {0, last}
end
if promote then
  local held = redis.call('HGET', KEYS[5], 'owner')
  if held and held ~= ARGV[1] then return {0, last} end
end
local function restore_record()
  if ARGV[7] ~= '' and redis.call('EXISTS', KEYS[5]) == 0 then
    redis.call('HSET', KEYS[5], 'fp', ARGV[7], 'stream', '1', 'state', 'streaming', 'owner', ARGV[1])
    redis.call('PEXPIRE', KEYS[5], ARGV[2])
    status = 2
  end
end
if math.max(last, tonumber(ARGV[10])) < first - 1 then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  if not promote then restore_record() end
  return {3, math.max(last, tonumber(ARGV[10]))}
end
local n = first
for i = 12, #ARGV, 2 do
  if n > last then redis.call('XADD', KEYS[1], '0-' .. n, 'd', ARGV[i], 's', ARGV[i + 1]) end
  n = n + 1
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[6] == '1' then
  redis.call('DEL', KEYS[4])
elseif ARGV[8] ~= '' then
  redis.call('SET', KEYS[4], ARGV[8], 'PX', ARGV[2])
else
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
if promote then
  if redis.call('EXISTS', KEYS[5]) == 0 then status = 2 end
  redis.call('HSET', KEYS[5], 'fp', ARGV[7], 'stream', '1', 'state', 'streaming', 'owner', ARGV[1])
  redis.call('PEXPIRE', KEYS[5], ARGV[11])
else
  restore_record()
end
return {status, last}
"""

#: Compare-and-delete: a producer lets go of ``:live`` only while it still holds it (one
#: that stalled may since have been taken over). KEYS: live. ARGV: owner.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: Bytes a journal entry costs Redis besides its two values (id, listpack and stream
#: index overhead), measured with MEMORY USAGE on long journals (see journal_quota.py).
ENTRY_OVERHEAD = 16


class JournalLost(Exception):
    """Another gateway took this stream over (this one stalled past ``:live``'s TTL)."""


class Budget(Protocol):
    """The memory a stream's journal may take (gateway/streams/journal_quota.py)."""

    reserved: int
    #: Bytes of its first reservation, to be made with the journal's first write (0: none).
    opening: int

    def opening_call(self) -> tuple[AsyncScript, list[str], list[str | int]]: ...
    def opened(self, reply: list[Any]) -> SluiceError | None: ...
    async def reserve(self, more: int, *, new: bool = False) -> SluiceError | None: ...
    async def grow(self, used: int) -> bool: ...
    def refusal(self) -> SluiceError: ...
    async def settle(self, used: int, hold_ms: int) -> None: ...


class JournalWriter:
    """Produces one resumable stream: journals its events, then hands them to the first client.

    An event reaches the first client only once it is in the journal, so whatever a
    client saw, a gateway taking the stream over (gateway/streams/takeover.py) has too. Writes
    are not batched on a timer: the process's :class:`JournalCommitter` writes every
    pending event of every stream in one pipeline per round trip, so the journal adds
    about one Redis round trip to an event's latency and costs one command per stream
    per round, however many events it carries.

    ``max_events`` bounds the stream's events (its error and ``[DONE]`` aside); ``budget``
    its bytes; ``head`` is what every chunk starts with (stored once, in ``:head``);
    ``fingerprint`` the request's, to restore its Idempotency-Key record should Redis lose it,
    and ``plan`` its plan (gateway/streams/takeover.py), to restore that with the journal.
    The writer keeps a copy of every event it journaled (:class:`JournalHistory`, as many
    bytes as the journal's quota counts for them) and writes the journal again whole when
    Redis lost it.
    The stream is claimed first by its key (gateway/streams/idempotency.py). With
    ``promotion_ttl_ms`` its first write also makes the claim the key's stream (the record
    ``streaming`` with that TTL, the plan stored: see ``APPEND``), and the ``budget``'s first
    reservation (its ``opening``) goes in the same round trip: :meth:`started` says when both
    are done, or why the stream did not begin. Without, the stream is the key's already (a
    take-over; :meth:`Idempotency.promote`).

    >>> claimed_ms = idempotency.hand_over(scope, token)  # this gateway's producer renews :live now
    >>> writer = JournalWriter(committer, scope, ttl_s=3600, owner=token, max_events=bound, fingerprint=fp,
    ...                        plan=plan, budget=quota.budget(...), claimed_ms=claimed_ms, promotion_ttl_ms=ttl)
    >>> first = writer.subscribe(readers.tail)  # before the producer starts
    >>> producer = await start_producer(writer, events, abandon, tap.take)
    >>> if await writer.started() is None:  # promoted and reserved, with its first events
    ...     response = SSEResponse(first.events(), keepalive, first.close)  # the first client reads this
    """

    def __init__(self, committer: JournalCommitter, key: str, *, ttl_s: float, owner: str,
                 max_events: int = 131_072, max_pending: int = 4096, head: bytes = b"",
                 done_ttl_s: float | None = None, budget: Budget | None = None, stored_bytes: int = 0,
                 plan: bytes = b"", fingerprint: str = "", claimed_ms: int | None = None,
                 promotion_ttl_ms: int | None = None) -> None:
        self._committer = committer
        self.key = key
        self._owner = owner
        #: Marks every entry this producer writes (gateway/streams/event_ids.py): its process,
        #: then its claim (gateway/streams/producers.py).
        self.tag = committer.instance + tag_of(owner)
        #: A take-over's first event names the producer of the event before it.
        self._after_tag: bytes | None = None
        self._ttl_ms = int(ttl_s * 1000)
        self._done_ttl_ms = self._ttl_ms if done_ttl_s is None else int(done_ttl_s * 1000)
        self._max = max_events
        self._max_pending = max_pending
        self._head = head
        self._fingerprint = fingerprint
        self._budget = budget
        #: Bytes this stream keeps in Redis: its plan (until it ends) and journal entries (a
        #: taken-over stream's earlier ones included).
        self.stored_bytes = stored_bytes + len(plan)
        self._plan = plan
        self._plan_bytes = len(plan)
        #: Every event journaled so far (1.._written), to write them again if Redis loses them.
        self._history = JournalHistory()
        #: Redis lost the journal's events from this one on: the next batch sends them again.
        self._rewrite_from: int | None = None
        self._pending: list[tuple[bytes, bytes, bytes]] = []  # (event, stored, state): _written+1 .. _produced
        self._in_flight = 0  # events of _pending being written now
        self._written = 0
        self._produced = 0
        self._ended = False  # [DONE] written
        #: Set once the journal's fate is known (its end written, or given up on), before the
        #: producer's clean-up round trips: see :meth:`settled`.
        self._drained = asyncio.Event()
        self._progress = asyncio.Event()  # a write ended (well or not)
        self.last_write = time.monotonic()
        self._failure: RedisError | OSError | JournalLost | None = None
        self._first: FirstReader | None = None
        self._lost_noted = False
        #: When ``:live`` was last set for this producer, at the latest (unix ms): when its
        #: stream was claimed (``claimed_ms``), then when each confirmed batch was sent.
        self._confirmed_ms = now_ms() if claimed_ms is None else claimed_ms
        self._sent_ms = self._confirmed_ms
        #: Refused a re-claim after a stall: it may re-claim from then on (monotonic).
        self._reclaim_after: float | None = None
        #: The producer task, while it waits for the generation's next event: a producer
        #: that lost its stream cancels its generation then, so the engine stops at once.
        self._generating: asyncio.Task[Any] | None = None
        #: The record's TTL for the promotion its next write makes (None: done, or none to make).
        self._promotion_ttl_ms = promotion_ttl_ms
        if promotion_ttl_ms is not None:  # :live was last set by its claim: refreshed as if by a write then
            self.last_write -= max(0.0, (now_ms() - self._confirmed_ms) / 1000)
        #: Set once the stream has begun (promoted, its first reservation made), or failed to.
        self._begun = asyncio.Event()
        self._start_failure: BaseException | None = None
        self._sending = False  # a batch of this writer is in a round now
        self._check_begun()

    def __repr__(self) -> str:
        return f"<JournalWriter {self.key} produced={self._produced} written={self._written}>"

    async def release(self) -> None:
        """Let go of ``:live`` if this producer still holds it (never another's)."""
        with contextlib.suppress(RedisError, OSError):
            await self._committer.release(self.key, self._owner)

    def continue_after(self, number: int, history: JournalHistory, tag: bytes | None = None) -> None:
        """A taken-over stream: its next event is ``number + 1``; ``history`` holds events
        1..``number`` as the journal had them, ``tag`` is event ``number``'s producer's."""
        if self._produced:
            raise RuntimeError("continue_after before the producer starts")
        if history.last != number:
            raise ValueError(f"a history up to event {history.last} to continue after event {number}")
        self._written = self._produced = number
        self._history = history
        self._after_tag = tag if tag != self.tag else None

    def subscribe(self, catch_up: CatchUp, *, lag_max: int = 1024) -> FirstReader:
        """The first client's reader; call it before the producer starts, so it misses nothing."""
        if self._produced:
            raise RuntimeError("subscribe before the producer starts")
        self._first = FirstReader(self.key, catch_up, lag_max, self._head or None, self.tag)
        return self._first

    async def run(self, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]],
                  state: Callable[[], bytes] = lambda: b"", digest: Callable[[], bytes] = lambda: b"") -> None:
        """Journal every event; ``events`` ends with ``[DONE]``. ``state()`` after each event
        gives what a take-over needs of it (the token ids it carries, see takeover.py);
        ``digest()`` the text its client then has, for the event's id (event_ids.py).

        A stream past its bounds (``max_events``, its budget's bytes) stops generating and
        ends with an in-band error, then ``[DONE]``.

        ``abandon`` cleans up the generation if ``events`` never got to run (its own
        ``finally`` only runs once it has started); it must be idempotent.
        """
        if self.lost:  # stopped before it ran (its request gave up before the stream began)
            await events.aclose()  # type: ignore[attr-defined]
            await abandon()
            return
        self._committer.follow(self)
        cut: SluiceError | None = None
        self._generating = asyncio.current_task()
        try:
            async for event in events:
                if event != DONE and self._produced >= self._max:
                    cut = InvalidRequest(
                        f"the stream reached its journal's bound of {self._max} events and was ended there; "
                        "ask for fewer tokens or choices, or stream without an Idempotency-Key",
                        code="stream_too_long")
                    break
                self._add(event, state(), digest())
                if not self._begun.is_set() and not self._sending:
                    await self._committer.write_now(self)  # its first write: its client waits for it
                if self._budget is not None and self.stored_bytes > self._budget.reserved + self._budget.opening:
                    # Its first reservation first: that one replaces whatever the key held.
                    await self._begun.wait()
                    if not self.lost and self.stored_bytes > self._budget.reserved \
                            and not await self._budget.grow(self.stored_bytes):
                        cut = self._budget.refusal()
                        break
                await self._hold_back()
        except asyncio.CancelledError:
            if not self.lost or self._generating is None:
                raise
            self._generating.uncancel()  # this writer's own doing (_lose): end as a lost stream
            raise JournalLost(self.key) from None
        finally:
            self._generating = None
            await events.aclose()  # type: ignore[attr-defined]  # runs the generation's clean-up
            await abandon()
            if cut is not None and not self.lost:
                log.warning("journal %s: %s", self.key, cut.message)
                self._add(error_event(cut), b"")
                self._add(DONE, b"")
            await self._drain()
            self._drained.set()
            self._committer.unfollow(self)
            if not self.lost:
                # Kept a while, should Redis lose them (journal_keeper.py): from the moment the
                # end is stored, not after the round trips below (each may wait out a Cluster's
                # failover, and a loss meanwhile was written back by nobody).
                if self._ended and not self._history.base:
                    self._committer.keeper.keep(Finished(
                        self.key, self._owner, self._fingerprint, self._head, self._history, self._done_ttl_ms,
                        self._budget, self.stored_bytes - self._plan_bytes))
                await self.release()
                if self._budget is not None:
                    kept = self.stored_bytes - self._plan_bytes if self._ended else self.stored_bytes  # plan dropped
                    with contextlib.suppress(RedisError, OSError):
                        await self._budget.settle(kept, self._done_ttl_ms if self._ended else self._ttl_ms)
            if self._first is not None:
                if self.dirty and not self.lost:
                    # Redis was away past DRAIN_S: the journal lacks the stream's last events
                    # and keeps its plan (the key is not settled). The first client goes on
                    # from the journal, as after a hand-over, where a take-over continues the
                    # stream from what it holds (was: "the producer is gone; the rest is lost":
                    # the nemesis, Cluster, a failover that left the stream's slot down 31 s).
                    self._first.hand_over()
                else:
                    self._first.end()

    async def started(self) -> BaseException | None:
        """Once the stream has begun: its first write made the claim the key's stream, and its
        budget's first reservation was made, in one round trip (see the class). None then;
        else why it did not begin, and this writer has stopped (it writes nothing more, its
        generation is cancelled): :class:`JournalLost` (another request owns the key now),
        the quota's refusal (429), or Redis's error. What that write did is the caller's to
        undo (Idempotency.abandon_stream, the budget's ``undo_opening``)."""
        await self._begun.wait()
        return self._start_failure

    async def abort(self) -> None:
        """Stop a writer whose stream has not begun (its request gave up), once a write of it
        that is on its way has been answered, so that what it did can be undone after."""
        if not self.lost:
            self._fail_start(JournalLost(self.key), "its request stopped before the stream began")
        while self._sending:
            self._progress.clear()
            await self._progress.wait()

    def _check_begun(self) -> None:
        if self._promotion_ttl_ms is None and (self._budget is None or not self._budget.opening):
            self._begun.set()

    def _fail_start(self, failure: BaseException, why: str) -> None:
        self._start_failure = failure
        self._lose(why)
        self._begun.set()

    async def settled(self) -> None:
        """Return once the journal's fate is known (:attr:`ended` says which), before the
        producer lets go of ``:live`` and settles its memory reservation: a stream is billed
        then, not after those round trips (a gateway killed while a failing-over Cluster
        held them up had served the stream's end and never logged its bill: nemesis, Cluster)."""
        await self._drained.wait()

    def _add(self, event: bytes, state: bytes, digest: bytes = b"") -> None:
        stored = compact(self._head, event)
        state = mark(state, self.tag, self._after_tag, digest if event != DONE else b"")
        self._after_tag = None
        self._produced += 1
        self._pending.append((event, stored, state))
        self.stored_bytes += len(stored) + len(state) + ENTRY_OVERHEAD
        self._committer.schedule(self)

    async def _hold_back(self) -> None:
        """Only when Redis lags far behind: wait for it, or give up if it keeps failing."""
        while len(self._pending) >= self._max_pending or self.lost:
            if self._failure is not None:
                raise self._failure
            self._progress.clear()
            await self._progress.wait()

    async def _drain(self) -> None:
        """Write what is left, retrying while Redis is down or stalled for up to ``DRAIN_S``
        (a generation often ends within one Redis outage: giving up after a few attempts
        ended its stream without ``[DONE]``, though Redis was back a second later). Past
        that the journal ends early, and a reader's take-over continues it from what it holds
        (the first client's reader included: :meth:`run` hands it over to the journal)."""
        until = time.monotonic() + DRAIN_S
        while self.dirty and not self.lost and self._committer.alive():
            if time.monotonic() > until:
                log.warning("journal %s: Redis unreachable for %.0f s; %d event(s) not written", self.key,
                            DRAIN_S, len(self._pending))
                return
            if self._failure is not None:
                await asyncio.sleep(_RETRY_S)  # Redis is down: do not spin
            self._progress.clear()
            self._committer.schedule(self)
            await self._progress.wait()

    # The committer's side: take a batch, then report how its write went.

    def opening(self) -> tuple[AsyncScript, list[str], list[str | int]] | None:
        """The budget's first reservation while it is to be made: sent in the same round as
        this writer's batch (script, KEYS, ARGV); :meth:`opened` takes its reply."""
        if self._budget is None or not self._budget.opening:
            return None
        return self._budget.opening_call()

    def opened(self, reply: list[Any]) -> None:
        assert self._budget is not None
        refusal = self._budget.opened(reply)  # kept even by a stopped writer: its caller undoes it
        if refusal is not None and not self.lost:
            self._fail_start(refusal, f"its journal's memory was refused: {refusal.message}")
            return
        self._check_begun()

    def batch(self) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and ARGV of ``APPEND`` for everything pending (only ``:live`` when nothing is);
        after Redis lost events, those first, and the plan, all in the same call; until the
        claim is promoted, the promotion and the plan too."""
        self._in_flight = len(self._pending)
        self._sent_ms = now_ms()
        self._sending = True
        ends = bool(self._pending) and self._pending[-1][0] == DONE
        rewrite = self._rewrite_from
        promotion = self._promotion_ttl_ms
        args: list[bytes | str | int] = [
            self._owner, self._done_ttl_ms if ends else self._ttl_ms, LIVE_TTL_MS,
            self._written + 1 if rewrite is None else rewrite, self._head, "1" if ends else "0", self._fingerprint,
            self._plan if rewrite is not None or promotion is not None else b"",
            _NO_DEADLINE_MS if self._may_reclaim() else self._confirmed_ms + LIVE_TTL_MS - RECLAIM_MARGIN_MS,
            self._history.base, "" if promotion is None else promotion]
        if rewrite is not None:
            for stored, state in self._history.since(rewrite):
                args += [stored, state]
        for _, stored, state in self._pending:
            args += [stored, state]
        scope = self.key
        return [stream_key(scope), live_key(scope), keys.journal_head(scope), keys.journal_plan(scope),
                keys.idempotency(scope)], args

    def written(self, result: list[int]) -> None:
        if self.lost:  # final: a reply to a batch sent before it was lost changes nothing
            return
        self.last_write = time.monotonic()
        status, last = int(result[0]), int(result[1])
        if status == 0:
            if self._promotion_ttl_ms is not None:
                self._fail_start(JournalLost(self.key), "another request owns its Idempotency-Key now (this "
                                 "gateway stalled past its claim's TTL)")
            else:
                self._lose("it was taken over by another gateway")
            return
        if status == 4:
            if self._reclaim_after is None:
                self._reclaim_after = time.monotonic() + RECLAIM_GRACE_S
                log.warning("journal %s: Redis lost its claim while this process was stalled for %.1f s; it waits "
                            "%.0f s for a gateway that may have taken the stream over, then re-claims it", self.key,
                            (self._sent_ms - self._confirmed_ms) / 1000, RECLAIM_GRACE_S)
            self._failure = RedisError("waiting to re-claim the stream")  # retried, not spun on
            self._progress.set()
            return
        self._confirmed_ms = self._sent_ms  # :live was set by this batch
        if status in (1, 2):
            self._promotion_ttl_ms = None  # promoted (if it was to be)
        if status == 3:
            # Redis lost events last + 1..: nothing was appended after the hole; write them
            # again, then the pending ones, in the next round. Redis lost the stream's memory
            # reservation with them: reserve it again with the next event (journal_quota.py).
            redis_faults.throttled(("journal lost events",), log.warning, "journal %s: Redis lost events %d..%d; "
                                   "this gateway writes them again and goes on producing it", self.key, last + 1,
                                   self._written)
            self._rewrite_from = last + 1
            if self._budget is not None:
                self._budget.reserved = 0
            self._failure = None
            self._committer.schedule(self)
            self._progress.set()
            return
        if status == 2 and not self._lost_noted:
            self._lost_noted = True
            redis_faults.throttled(("journal re-claimed",), log.warning, "journal %s: Redis lost its :live or key "
                                   "record; this gateway re-claimed it and goes on producing it", self.key)
        self._rewrite_from = None
        batch, first = self._pending[:self._in_flight], self._written + 1
        self._written += len(batch)
        for _, stored, state in batch:
            self._history.add(stored, state)
        self._ended |= bool(batch) and batch[-1][0] == DONE
        del self._pending[:len(batch)]  # only once written: a failed write is retried with the same ids
        self._failure = None
        if self._first is not None:
            for number, (event, _, state) in enumerate(batch, start=first):
                if not self._first.offer(number, event, id_tail(state)):
                    self._first = None
                    break
        self._check_begun()
        self._progress.set()

    def failed(self, exc: RedisError | OSError) -> None:
        if self.lost:
            return
        if not self._begun.is_set():  # as when promote failed alone: the request fails, its caller retries
            self._fail_start(exc, f"its first journal write failed: {exc}")
            return
        self._failure = exc
        redis_faults.report("a journal write failed (it is tried again)", exc, f" (stream {self.key})")
        self._progress.set()

    @property
    def sending(self) -> bool:
        """Whether a batch of it is on its way (in a round not answered yet)."""
        return self._sending

    def round_over(self) -> None:
        """The round that carried this writer's batch has been answered (or failed)."""
        self._sending = False
        self._progress.set()

    def _may_reclaim(self) -> bool:
        """Whether this producer may re-claim a missing ``:live`` whenever (see ``APPEND``)."""
        if self._committer.awake_since(self._confirmed_ms):
            return True
        return self._reclaim_after is not None and time.monotonic() >= self._reclaim_after

    def _lose(self, why: str) -> None:
        """Another gateway produces the stream now (or may): this writer is done for good. It
        writes nothing more, not even after Redis loses the journal (it would write a stale
        history over the new producer's), its first client follows the journal, and its
        generation is cancelled, which frees the engine at once."""
        self._failure = JournalLost(self.key)
        log.warning("journal %s: %s; this gateway stops producing it", self.key, why)
        self._committer.unfollow(self)
        if self._first is not None:
            self._first.hand_over()
            self._first = None
        if self._generating is not None and self._generating is not asyncio.current_task():
            self._generating.cancel()  # (the producer itself, writing its first batch, stops at its next check)
        self._progress.set()

    @property
    def lost(self) -> bool:
        """Whether this producer lost its stream (final)."""
        return isinstance(self._failure, JournalLost)

    @property
    def ended(self) -> bool:
        """Whether this producer wrote the stream's ``[DONE]`` to its journal."""
        return self._ended

    @property
    def dirty(self) -> bool:
        """Whether it has something to write: events, a lost journal's, or its stream's
        beginning (the promotion, the first reservation)."""
        return bool(self._pending) or self._rewrite_from is not None or not self._begun.is_set()


class JournalCommitter:
    """Writes the journals of every stream this gateway process produces, one pipeline per
    round: all pending events of all streams (one ``APPEND`` per stream), plus a ``:live``
    refresh for streams silent for a while (a migration in progress). A round starts as
    soon as the last one returned, so writes batch by themselves under load.

    >>> committer = JournalCommitter(redis)   # one per process
    >>> writer = JournalWriter(committer, scope, ttl_s=3600, owner=token)
    >>> await committer.close()
    """

    def __init__(self, redis: Redis, watch: LossWatch | None = None, instance: bytes = b"",
                 runner: Any = None, keep_bytes: int = KEEP_BYTES) -> None:
        """``runner``: what the rounds and releases run on (the Idempotency-Keys' script
        channel, gateway/streams/idempotency.py; ``redis`` when None). ``keep_bytes``: the
        finished journals' copies this process keeps, at most (journal_keeper.py)."""
        self.redis = redis
        self._runner = runner if runner is not None else redis
        #: This process's name in its producers' tags (gateway/streams/producers.py).
        self.instance = instance
        self._script = self._runner.register_script(APPEND)
        self._release = self._runner.register_script(RELEASE)
        self._followed: set[JournalWriter] = set()
        self._due: dict[JournalWriter, None] = {}  # insertion-ordered set
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._tick = 0.0  # when the ticker last ran (monotonic)
        self._stall_ended_ms = 0  # when the last stall the ticker saw ended (unix ms)
        self.rounds = 0
        #: Finished journals' events, written back should Redis lose them.
        self.keeper = JournalKeeper(redis, watch=watch, keep_bytes=keep_bytes)

    def __repr__(self) -> str:
        return f"<JournalCommitter streams={len(self._followed)} rounds={self.rounds}>"

    def follow(self, writer: JournalWriter) -> None:
        self._followed.add(writer)
        self.keeper.watch()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="journal-committer")
        if self._ticker is None or self._ticker.done():
            self._tick = time.monotonic()
            self._stall_ended_ms = now_ms()  # not watched until now: as if it stalled until now
            self._ticker = asyncio.create_task(self._ticks(), name="journal-stall-watch")

    def awake_since(self, wall_ms: int) -> bool:
        """Whether this process ran without a stall (its loop stopped or blocked for
        ``STALL_S``) since ``wall_ms`` (unix ms), as far as the ticker saw: a stall in
        progress, or ended but not yet noted, counts."""
        return time.monotonic() - self._tick < STALL_S and self._stall_ended_ms < wall_ms

    async def _ticks(self) -> None:
        while self._followed:
            await asyncio.sleep(_TICK_S)
            now = time.monotonic()
            if now - self._tick >= STALL_S:
                self._stall_ended_ms = now_ms()
            self._tick = now

    def produces(self, key: str) -> bool:
        """Whether a writer of this process still produces (or drains) the stream ``key``."""
        return any(writer.key == key and not writer.lost for writer in self._followed)

    def unfollow(self, writer: JournalWriter) -> None:
        self._followed.discard(writer)
        self._due.pop(writer, None)

    def schedule(self, writer: JournalWriter) -> None:
        if writer.lost:
            return
        self._due[writer] = None
        self._wake.set()

    async def release(self, key: str, owner: str) -> bool:
        """Delete ``key``'s ``:live`` if ``owner`` holds it."""
        return bool(await self._release(keys=[live_key(key)], args=[owner]))

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        await self.keeper.close()
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

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
            due, self._due = self._due, {}
            writers = []
            for writer in due:
                if writer.sending:  # its own first round is on its way (write_now): in a later one
                    self._due[writer] = None
                elif not writer.lost and (writer.dirty or writer in self._followed):
                    writers.append(writer)
            if writers:
                await self._round(writers)

    async def write_now(self, writer: JournalWriter) -> None:
        """A round for ``writer`` alone, at once, in its producer's task: a stream's first
        write (its client waits for it) does not wait for the round in flight, nor for this
        committer's task to wake. It writes what ``writer`` has, then the next round goes on."""
        self._due.pop(writer, None)
        try:
            await self._round([writer])
        finally:
            if writer.dirty and not writer.lost:
                self.schedule(writer)

    async def _round(self, writers: list[JournalWriter]) -> None:
        try:
            await self._write(writers)
        finally:
            for writer in writers:
                writer.round_over()

    async def _write(self, writers: list[JournalWriter]) -> None:
        self.rounds += 1
        openings = [(writer, call) for writer in writers if (call := writer.opening()) is not None]
        batches = [writer.batch() for writer in writers]
        calls = [call for _, call in openings] + [(self._script, keys_, args) for keys_, args in batches]
        try:
            results = await self._append_all(calls)
        except (RedisError, OSError) as exc:
            for writer in writers:
                writer.failed(exc)
                writer.round_over()
            await asyncio.sleep(_FAILED_ROUND_PAUSE_S)
            return
        failed = False
        # A stream's first reservation before its batch: a refusal stops it before its events count.
        for (writer, (script, _, _)), result in zip(openings, results[:len(openings)], strict=True):
            if isinstance(result, NoScriptError):  # sent again with the next round
                failed |= not await self._load(writer, script.script)
            elif isinstance(result, BaseException):
                writer.failed(result if isinstance(result, (RedisError, OSError)) else RedisError(repr(result)))
                failed = True
            else:
                writer.opened(result)
        for writer, result in zip(writers, results[len(openings):], strict=True):
            if isinstance(result, NoScriptError):  # Redis restarted or failed over
                failed |= not await self._load(writer, APPEND)
            elif isinstance(result, BaseException):
                # Whatever a gathered call failed with (not only Redis's errors) fails that
                # writer's write, to be retried; it is never a result to read.
                writer.failed(result if isinstance(result, (RedisError, OSError)) else RedisError(repr(result)))
                failed = True
            else:
                writer.written(result)
        for writer in writers:
            writer.round_over()  # (before a pause)
        if failed:  # a Cluster node down fails its calls at once (gathered, not raised): do not spin
            await asyncio.sleep(_FAILED_ROUND_PAUSE_S)

    async def _load(self, writer: JournalWriter, source: str) -> bool:
        """Load a script Redis did not know, and have ``writer`` send its call again."""
        try:
            await self.redis.script_load(source)
        except (RedisError, OSError) as exc:
            writer.failed(exc)
            return False
        self.schedule(writer)
        return True

    async def _append_all(self, calls: list[tuple[AsyncScript, list[str], list[Any]]]) -> list[Any]:
        """Every call of a round (each writer's ``APPEND``, and the first reservation of a
        stream that starts): one pipeline on a single server, so one write and one round
        trip; on a Cluster (whose pipelines refuse scripts) concurrent calls, each to its
        key's node."""
        if isinstance(self.redis, RedisCluster):
            return await asyncio.gather(
                *(script(keys=keys_, args=args) for script, keys_, args in calls), return_exceptions=True
            )
        pipe = self._runner.pipeline(transaction=False)
        for script, keys_, args in calls:
            pipe.evalsha(script.sha, len(keys_), *keys_, *args)
        return list(await pipe.execute(raise_on_error=False))


async def start_producer(
    writer: JournalWriter, events: AsyncIterator[bytes], abandon: Callable[[], Awaitable[None]],
    state: Callable[[], bytes] = lambda: b"", digest: Callable[[], bytes] = lambda: b"",
) -> asyncio.Task[None]:
    task = asyncio.create_task(writer.run(events, abandon, state, digest), name="journal-producer")
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("journal producer failed: %s", task.exception())
