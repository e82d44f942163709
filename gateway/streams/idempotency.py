"""``Idempotency-Key``: the same key within its TTL yields one generation, decided by its owner.

Record ``sl:idem:{scope}``, a hash: ``fp`` (body hash), ``stream`` ("1"/"0"), ``state``,
``owner`` (the token of the request or take-over that decides the key's fate), ``body``
(the completed JSON body, non-streaming only). It shares its hash tag with the journal's
keys (gateway/streams/journal.py), so one script can check both. Whether its owner lives is
``sl:journal:{scope}:live`` (the owner's token, a 3 s TTL the live owner renews), the same
key that says whether a resumable stream's producer lives:

    pending    claimed; the owner admits or generates, renewing ``:live`` (one task per
               process for all its claims). A claim whose ``:live`` expired (its gateway
               died or stalled) is free: a retry claims it at once and runs.
    streaming  a resumable stream has started: its journal and plan exist and its producer
               refreshes ``:live``; a gateway whose reader finds the producer gone takes it
               over (:meth:`Idempotency.take_stream` moves ``owner`` to it).
    done       the generation finished: a retry replays it (JSON) or re-attaches (stream).

Only the current owner settles (``done``, or forgotten after a failure so the client's
retry runs again), in one script that compares ``owner``: a gateway that lost its stream
to a take-over, or its pending claim to a retry, changes nothing.

Redis losing its data (a restart without persistence, a failover, FLUSHALL) loses the
record while its owner still runs. The owner restores it: a pending claim when its stream
starts (the journal's first write promotes it, gateway/streams/journal.py; START alone does the
same), a producer with its next journal write, which re-claims ``:live`` too (at most ~0.5 s
later). Meanwhile a retry waits (``:live`` held, no record: pending), so it attaches to the one
generation.

- first caller: claims the key (and drops the journal of an earlier, failed attempt);
  never a caller with a ``Last-Event-ID`` (it holds events of a generation Redis lost:
  ``stream_history_lost``), nor one that finds an unfinished journal without its record
  (Redis lost the record while the producer was silent: it attaches, see ``CLAIM``);
- a later caller with the same body: waits while the key is pending and its owner lives;
  gets the stored body once done; re-attaches to a stream (see gateway/streams/journal.py), from
  ``Last-Event-ID`` on;
- the same key with a different body: 409.

A finished stream's record and journal that Redis lost come back from the gateway that
produced it (gateway/streams/journal_keeper.py), within a few seconds of the loss. A
client's retry that came first ran the whole request again and was billed twice (nemesis,
Cluster: 7 streams, a failed-over node without the record). So while this process knows
of a loss it may not have seen repaired yet (``unsure``: LossWatch.unsure_s, at most
``API_KEYS_RESTORE_S`` after it, or while it has no fresh look at Redis), a key without a
record does not start a generation; the caller waits, at most ``UNSURE_MAX_S``. A loss
this process has not looked at yet (its watch looks every half second) is caught by one more
look when a key is claimed fresh (``confirm``): the nemesis's one-Redis run billed a
stream twice whose retry came 0.3 s after a restart. On one server that look goes in the
claim's own round trip, right after it on the same connection (LossWatch.confirm_with), so it
still sees at least what the claim saw; on a Cluster (the epoch on another node) it follows
the claim's reply.

A fresh resumable stream waits, before its first event, on two round trips more than a plain
one: the claim (with that look), and the journal's first write, which also promotes the claim
and, in the same pipeline, reserves its journal memory (gateway/streams/journal.py). They were
five: the claim, the look, promote (START), the reservation, the first write.

Every wait of a claim ends within ``CLAIM_MAX_S`` (or the request's deadline, if sooner),
Redis commands included: then ``503`` + ``Retry-After`` ("send it again"), or ``504`` at the
deadline. Nothing has been sent to the client yet, so a longer wait is silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError
from starlette.responses import Response

from gateway.loss_watch import LossWatch
from gateway.streams.journal import DONE, LIVE_TTL_MS, now_ms
from gateway.streams.producers import ProducerBeat, wait_for_producer_s
from sluice import keys
from sluice.errors import Conflict, DeadlineExceeded, InvalidRequest, SluiceError, Unavailable, UpstreamFailed
from sluice.script_channel import ScriptChannel, script_runner

log = logging.getLogger("sluice.gateway")

MAX_KEY_LENGTH = 255
#: How often a waiting caller looks at a pending key again.
_WAIT_S = 0.05
#: The longest a key without a record waits for a write-back after a loss (see the module).
UNSURE_MAX_S = 6.0
#: The longest a claim waits, all of its rounds and Redis commands together, before it
#: answers 503 + Retry-After: no byte has reached the client yet. Its longest designed
#: waits fit (a lost stream's producer, ``wait_for_producer_s``, 10 s, then a write-back,
#: ``UNSURE_MAX_S``); a Cluster command alone may take 12 s (``CLUSTER_COMMAND_DEADLINE_S``).
#: Unbounded, a claim whose every look found a loss went round for as long as a Cluster
#: node was away: the nemesis's clients, which give up on a silent POST after 35 s, got
#: nothing for 35 s (nem-3307, nem-4256).
CLAIM_MAX_S = 20.0

#: KEYS: record, journal, plan, live, head. ARGV: owner, fp, stream, record ttl ms, live
#: ttl ms, the caller's Last-Event-ID, the journal's end event, "1" while unsure (below). The one way a request claims a key, and with it the
#: key's stream: only if it is free (no record, or a pending one, and no ``:live``: nobody
#: admits or produces it). Then, having won, it drops an earlier attempt's journal, plan and
#: head, never under a producer that still writes them. Else returns {fp, state, stream}: a
#: record Redis lost while its owner lives (``:live`` held) reads as pending, the owner
#: restores it (gateway/streams/journal.py).
#: A free key never starts a second generation over events a client may hold:
#: - its journal has events, has not ended and has its plan (Redis lost the record and
#:   ``:live`` while its producer was silent or dead: a key forgotten after a failure has
#:   no plan), or the caller holds events (Last-Event-ID > 0): "streaming", the caller
#:   attaches (its reader takes the stream over if the producer is gone, or gets the
#:   journal's end);
#: - the caller holds events but the journal is gone: "lost", an explicit error (its
#:   events came from a generation a new one would not continue).
#: Only a caller with no events, on a key whose journal ended or was forgotten after a
#: failure, or has none, starts a generation; and while Redis may have lost writes that
#: gateways are writing back (ARGV[8] = '1'), not on a key without a record: "unsure", the
#: caller waits for the write-back.
CLAIM = """
local found = redis.call('HMGET', KEYS[1], 'fp', 'state', 'stream')
if redis.call('EXISTS', KEYS[4]) == 1 then
  if found[2] then return found end
  return {false, 'pending', ARGV[3]}
end
if found[2] and (found[2] ~= 'pending' or found[1] ~= ARGV[2]) then return found end
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if top[1] and (tonumber(ARGV[6]) > 0 or (top[1][2][2] ~= ARGV[7] and redis.call('EXISTS', KEYS[3]) == 1)) then
  return {false, 'streaming', ARGV[3]}
end
if tonumber(ARGV[6]) > 0 then return {false, 'lost', ARGV[3]} end
if ARGV[8] == '1' and not found[2] then return {false, 'unsure', ARGV[3]} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5])
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'stream', ARGV[3], 'state', 'pending', 'owner', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[5])
return 1
"""

#: KEYS: record, live, plan. ARGV: owner, fp, record ttl ms, plan, plan ttl ms, live ttl ms.
#: A claimed stream starts: record ``streaming`` and its plan, in one step, only while
#: ``owner`` still owns the key and nobody else holds ``:live``. A record Redis lost while
#: the claim was pending is restored (nobody claimed the key since: ``:live`` is not theirs).
#: A served stream does this with its first journal write instead (``APPEND``'s promotion,
#: gateway/streams/journal.py, the same checks), saving the round trip; this script serves
#: :meth:`Idempotency.promote`, for a stream started without one.
START = """
local live = redis.call('GET', KEYS[2])
if live and live ~= ARGV[1] then return 0 end
local held = redis.call('HGET', KEYS[1], 'owner')
if held and held ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'stream', '1', 'state', 'streaming', 'owner', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[6])
return 1
"""

#: KEYS: record, live, plan. ARGV: owner, state ('' = forget the key), ttl ms, body ('' =
#: none). Changes the record only if ``owner`` still owns it (a done one is never
#: forgotten; a forgotten stream's plan goes too: nobody is to continue it), and lets go of
#: ``:live`` if ``owner`` holds it, whether or not it still owns the record (Redis may
#: have lost that).
SETTLE = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
local held = redis.call('HMGET', KEYS[1], 'owner', 'state')
if held[1] ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  if held[2] == 'done' then return 0 end
  redis.call('DEL', KEYS[1], KEYS[3])
  return 1
end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'body', ARGV[4]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

#: KEYS: record, live, plan. ARGV: owner, live ttl ms. A take-over: claims the stream's
#: ``:live`` only while no producer holds it, and in the same step makes the taker the key's
#: owner, so the gateway it took the stream from can no longer settle or forget the key.
#: A stream without its plan (Redis lost it) is not claimed (-1) unless ARGV[3] is "1" (the
#: taker waited long enough for its producer and will forget it): nobody could continue it,
#: and its producer, if only stalled, comes back to write it again, and would take even a
#: claim held for a moment for a take-over and stop (a CI run: the reader of a producer
#: stopped 5 s across a FLUSHALL claimed every second, the producer's write met one claim,
#: and the stream was lost).
TAKE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'owner', ARGV[1]) end
return 1
"""

#: KEYS: record, live, plan, journal, head. ARGV: owner. A taker that found the stream
#: cannot be continued (its plan, or events of its journal, lost) forgets it whole, while
#: it holds ``:live`` (nobody else writes the journal then): what is left of the journal
#: goes too, else a re-sent POST holding events would attach to it again. A done record stays.
ABANDON = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
local held = redis.call('HMGET', KEYS[1], 'owner', 'state')
if held[2] ~= 'done' and (not held[1] or held[1] == ARGV[1]) then redis.call('DEL', KEYS[1]) end
return 1
"""

def scoped(owner: str, key: str) -> str:
    """The name a client's Idempotency-Key gets in Redis: private to its API key.

    Hashing also keeps arbitrary client text out of Redis key names.
    """
    return hashlib.sha256(f"{owner}\0{key}".encode()).hexdigest()[:40]


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _late(deadline: float, what: str) -> SluiceError:
    """A claim that waited as long as it may: 504 at the request's deadline, else 503 with
    Retry-After (the wait ended at ``CLAIM_MAX_S``; sent again, the request may find the key
    settled)."""
    if time.monotonic() >= deadline:
        return DeadlineExceeded(f"the request with this Idempotency-Key {what}")
    return Unavailable(f"the request with this Idempotency-Key {what} (past {CLAIM_MAX_S:g} s); "
                       "send it again", retry_after_s=1)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class Idempotency:
    """The records of Idempotency-Keys, and the pending claims this process holds.

    >>> idem = Idempotency(redis, ttl_s=3600)
    >>> if await idem.claim(scope, fp, stream=False, deadline=d, owner=token) is None:
    ...     body = ...  # generate; the claim's ``:live`` is renewed meanwhile
    ...     await idem.settle(scope, token, completed=True, body=body)
    """

    def __init__(self, redis: Redis, ttl_s: float, unsure: Callable[[], float] = lambda: 0.0,
                 watch: LossWatch | None = None) -> None:
        self._redis = redis
        self._unsure = unsure  # seconds writes Redis lost may still be on their way back
        #: Looks at Redis when a key is claimed fresh: False when it lost data this process has
        #: not seen yet (LossWatch.confirm).
        self._watch = watch
        self._ttl_ms = int(ttl_s * 1000)
        #: What a resumable stream's scripts run on, the claim's look and the journal's
        #: writes included (gateway/streams/journal.py): one connection of its own on a
        #: plain server (sluice/script_channel.py), not one of the pool's per call (a
        #: resumable request made five of those round trips, and a request waiting for one
        #: at once opened a connection of its own: loadtest/peers/README.md).
        self.runner: Any = script_runner(redis)
        self._claim = self.runner.register_script(CLAIM)
        self._settle = self.runner.register_script(SETTLE)
        self._take = self.runner.register_script(TAKE)
        self._abandon = self.runner.register_script(ABANDON)
        self._start = self.runner.register_script(START)
        #: Pending claims of this process, (key, owner) -> when their ``:live`` was last set or
        #: renewed, at the latest (unix ms, as it was sent).
        self._held: dict[tuple[str, str], int] = {}
        self._renewing: asyncio.Task[None] | None = None
        #: This process's beat, and whether a lost stream's producer still runs.
        self.producers = ProducerBeat(redis, watch)

    def __repr__(self) -> str:
        return f"<Idempotency held={len(self._held)}>"

    @staticmethod
    def check_key(key: str) -> str:
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable characters")
        return key

    async def claim(
        self, key: str, fp: str, stream: bool, deadline: float, owner: str, after: int = 0, *,
        regenerate: bool = False, tag: bytes | None = None,
    ) -> Response | Literal["attach", "regenerate"] | None:
        """None when ``owner`` now owns the key and must generate (its ``:live`` is renewed
        until :meth:`hand_over` or :meth:`settle`); "attach" to re-attach to the key's stream;
        else the stored answer to send. ``after``: the caller's Last-Event-ID; a caller that
        holds events never starts a new generation (``stream_history_lost`` instead), unless it
        can be checked against what it holds (``regenerate``, gateway/streams/regenerate.py):
        then, once no producer wrote the stream back in time, or at once when the producer that
        ``tag`` (the caller's last event's) names is gone (gateway/streams/producers.py),
        ``owner`` owns the key and generates it again ("regenerate"). Answers within ``CLAIM_MAX_S``, or by ``deadline``
        if that comes first: past it, :class:`Unavailable` (503, send it again), or
        :class:`DeadlineExceeded` at the deadline."""
        give_up = min(deadline, time.monotonic() + CLAIM_MAX_S)
        # What the claim last waited for, which the cut below tells: a round whose command is
        # still unanswered at the cut, after one that found the key pending, is told "still
        # running" (a loaded machine's slow round trip, 50 ms past the end of the last pause,
        # said "waiting for Redis" about a key Redis had just answered for: a CI run).
        waited = ["is waiting for Redis"]
        try:
            # A wait ends itself at ``give_up``, saying what it waited for; this cuts, just
            # after, a Redis command still unanswered (a stalled node, a failover). A round
            # that had won the key then leaves its ``:live`` to expire (3 s), as a gateway
            # that died would.
            async with asyncio.timeout(give_up + _WAIT_S - time.monotonic()) as bound:
                return await self._claim_by(key, fp, stream, deadline, give_up, owner, after, regenerate, tag,
                                            waited)
        except TimeoutError:
            if not bound.expired():
                raise
            raise _late(deadline, waited[0]) from None

    async def _claim_by(
        self, key: str, fp: str, stream: bool, deadline: float, give_up: float, owner: str, after: int,
        regenerate: bool, tag: bytes | None, waited: list[str],
    ) -> Response | Literal["attach", "regenerate"] | None:
        """:meth:`claim`'s rounds; each wait ends at ``give_up``, and leaves what it waited for
        in ``waited``."""
        names = [keys.idempotency(key), keys.journal(key), keys.journal_plan(key), keys.journal_live(key),
                 keys.journal_head(key)]
        lost_until: float | None = None
        unsure_until: float | None = None
        fresh_after: int | None = None  # a regenerating caller's Last-Event-ID, once it claims afresh
        first = True
        while True:
            ttl_ms = self._ttl_ms + int(max(0.0, deadline - time.monotonic()) * 1000)
            cautious = self._unsure() > 0 and (unsure_until is None or time.monotonic() < unsure_until)
            args = [owner, fp, int(stream), ttl_ms, LIVE_TTL_MS, after, DONE, int(cautious)]
            sent_ms = now_ms()
            confirmed: bool | None = None  # the watch's look, when it came with the claim
            if first and not cautious and self._watch is not None:
                found, confirmed = await self._claim_and_look(names, args)
            else:  # a round after waiting: rare, and its look (if it wins) follows it
                found = await self._claim(keys=names, args=args)
            first = False
            if found == 1:
                if not cautious and self._watch is not None and not (
                        confirmed if confirmed is not None else await self._watch.confirm()):
                    # Redis lost data moments ago, unseen by this process until now: the key's
                    # record may be on its way back from its producer. Let go, and wait as unsure.
                    log.info("Idempotency-Key %s: Redis lost data moments ago; waiting for its record to be "
                             "written back before running it", key)
                    await self.settle(key, owner, completed=False)
                    # A loss seen now gets its own wait, even after one for an earlier loss
                    # ran out: claiming again at once went round without end while every
                    # look found a loss (the nemesis, Cluster: nem-3307, nem-4256).
                    unsure_until = time.monotonic() + UNSURE_MAX_S
                    await self._pause(give_up, deadline, waited, "is waiting for Redis's data to be written back")
                    continue
                self._hold(key, owner, sent_ms)
                return None if fresh_after is None else "regenerate"
            stored_fp, state, stored_stream = (_text(v) for v in found)
            if state == "unsure":
                if unsure_until is None:
                    unsure_until = time.monotonic() + UNSURE_MAX_S
                    log.info("Idempotency-Key %s has no record while Redis may have lost it: waiting for "
                             "its gateway to write it back", key)
                await self._pause(give_up, deadline, waited, "is waiting for Redis's data to be written back")
                continue
            if state == "lost":
                # Redis lost the stream: a producer that still runs re-claims it, and writes
                # its journal again, within ``:live``'s refresh period; give it that long.
                # Not when its producer's process is known to be gone.
                lost_until = lost_until or time.monotonic() + wait_for_producer_s()
                if time.monotonic() < min(lost_until, deadline) and not await self.producers.gone(tag):
                    await self._pause(give_up, deadline, waited,
                                      "is waiting for its stream's producer to write it back")
                    continue
                if regenerate and fresh_after is None:
                    fresh_after, after = after, 0  # the next round claims the key for a new generation
                    continue
                raise UpstreamFailed(
                    f"the stream this Last-Event-ID ({after}) belongs to is no longer known (Redis lost it, or it "
                    "failed): it cannot be resumed; send the request without Last-Event-ID to run it again",
                    code="stream_history_lost")
            if (stored_fp is not None and stored_fp != fp) or stored_stream != str(int(stream)):
                raise Conflict("this Idempotency-Key was used with a different request body")
            if state == "done" and not stream:
                body = await self._redis.hget(keys.idempotency(key), "body")
                if body is not None:
                    return Response(body, media_type="application/json", headers={"idempotent-replayed": "true"})
            elif state != "pending":  # a stream that has started (or ended): follow its journal
                return "attach"
            # Pending, and its owner lives: wait. If it dies, its :live expires within
            # LIVE_TTL_MS and a later round claims the key here.
            await self._pause(give_up, deadline, waited, "is still running")

    @staticmethod
    async def _pause(give_up: float, deadline: float, waited: list[str], what: str) -> None:
        """Wait before the claim's next round; at ``give_up``, tell the caller instead."""
        waited[0] = what
        left_s = give_up - time.monotonic()
        if left_s > 0:
            await asyncio.sleep(min(_WAIT_S, left_s))
        if time.monotonic() >= give_up:
            raise _late(deadline, what)

    async def _claim_and_look(self, names: list[str], args: list[str | int]) -> tuple[object, bool | None]:
        """``CLAIM``, and the loss watch's look right after it in the same round trip (one
        server: a pipeline, answered in order); the look's answer only when the claim won the
        key. On a Cluster, or when Redis had to be sent the script again, the look is left to
        follow the claim (None)."""
        assert self._watch is not None
        if isinstance(self._redis, RedisCluster):
            return await self._claim(keys=names, args=args), None
        pipe = self.runner.pipeline(transaction=False)
        pipe.evalsha(self._claim.sha, len(names), *names, *args)
        read = self._watch.confirm_with(pipe)
        found, *look = await pipe.execute(raise_on_error=False)
        if isinstance(found, NoScriptError):  # Redis restarted or flushed its scripts: the look came first
            return await self._claim(keys=names, args=args), None
        if isinstance(found, BaseException):
            raise found
        if found != 1 or read is None:
            return found, None
        failed = next((reply for reply in look if isinstance(reply, BaseException)), None)
        if failed is not None:
            raise failed
        return found, read(look)

    def hand_over(self, key: str, owner: str) -> int:
        """The claim's stream starts: its journal's producer renews ``:live`` from now on, and
        makes the claim the key's stream with its first write (gateway/streams/journal.py,
        ``APPEND``). When ``:live`` was last set for the claim, at the latest (unix ms;
        0 when this process no longer holds the claim: a renewal found another's token)."""
        return self._held.pop((key, owner), 0)

    def record_ttl_ms(self, remaining_s: float) -> int:
        """How long a streaming key's record lives: as long as its journal may."""
        return self._ttl_ms + int(max(0.0, remaining_s) * 1000)

    async def promote(self, key: str, owner: str, fp: str, remaining_s: float, plan: bytes) -> bool:
        """Start the claim's stream without its first journal write (a served stream has its
        first write do this, in the same round trip: gateway/streams/journal.py's
        ``Promotion``): the record now lives as long as the journal may, the stream's
        ``plan`` (gateway/streams/takeover.py) is stored, and the journal's producer renews
        ``:live`` from here on. False if ``owner`` lost the key meanwhile (it stalled past
        ``:live``'s TTL and a retry claimed it): then it must not touch the journal."""
        self._held.pop((key, owner), None)
        ttl_ms = self.record_ttl_ms(remaining_s)
        names = [keys.idempotency(key), keys.journal_live(key), keys.journal_plan(key)]
        return bool(await self._start(keys=names, args=[owner, fp, ttl_ms, plan, self._ttl_ms, LIVE_TTL_MS]))

    async def settle(self, key: str, owner: str, completed: bool, body: bytes | None = None) -> bool:
        """The owner's decision: ``done`` (a retry replays it) or, after a failure, forgotten
        (a retry runs again). Nothing changes if ``owner`` no longer owns the key (or Redis
        lost its record): then False."""
        self._held.pop((key, owner), None)
        try:
            settled = await self._settle(
                keys=[keys.idempotency(key), keys.journal_live(key), keys.journal_plan(key)],
                args=[owner, "done" if completed else "", self._ttl_ms, b"" if body is None else body],
            )
        except (RedisError, OSError) as exc:
            log.warning("could not settle Idempotency-Key %s: %s", key, exc)
            return False
        if not settled:
            log.info("Idempotency-Key %s is another request's to settle now, or Redis lost its record", key)
        return bool(settled)

    async def abandon_stream(self, key: str, owner: str) -> bool:
        """Forget the stream ``key``, journal and all, that its taker ``owner`` found cannot be
        continued: a client holding events of it re-sends its POST, which then runs it again
        (gateway/streams/regenerate.py) instead of attaching to the rest of it, which would
        tell it the same again (nemesis, Sentinel). False if ``owner`` no longer holds it."""
        self._held.pop((key, owner), None)
        names = [keys.idempotency(key), keys.journal_live(key), keys.journal_plan(key), keys.journal(key),
                 keys.journal_head(key)]
        return bool(await self._abandon(keys=names, args=[owner]))

    async def take_stream(self, key: str, owner: str, *,
                          planless: bool = False) -> Literal["taken", "held", "planless"]:
        """Take the stream ``key`` over if no producer holds it (``taken``: ``owner`` then
        produces it, or forgets it, and decides the key's fate); ``held``: a producer holds
        it; ``planless``: Redis lost its plan, and nothing was claimed (see ``TAKE``), unless
        ``planless`` asked to claim it all the same."""
        took = await self._take(keys=[keys.idempotency(key), keys.journal_live(key), keys.journal_plan(key)],
                                args=[owner, LIVE_TTL_MS, "1" if planless else "0"])
        return "taken" if took == 1 else "held" if took == 0 else "planless"

    async def lookup(self, key: str) -> dict[str, str] | None:
        """The record's fields, with ``live``: whether its owner (or producer) lives; only
        ``live`` when Redis lost the record of an owner that lives (it restores it)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(keys.idempotency(key))
        pipe.exists(keys.journal_live(key))
        raw, live = await pipe.execute()
        if not raw and not live:
            return None
        return {**{_text(k) or "": _text(v) or "" for k, v in raw.items()}, "live": "1" if live else ""}

    async def close(self) -> None:
        self._held.clear()
        await self.producers.close()
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        if isinstance(self.runner, ScriptChannel):
            await self.runner.aclose()

    def _hold(self, key: str, owner: str, set_ms: int) -> None:
        self._held[key, owner] = set_ms
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew(), name="idempotency-renewal")

    async def _renew(self) -> None:
        """One task per process renews the ``:live`` of every pending claim it holds, one
        round trip per interval. A claim whose ``:live`` holds another token now was lost
        (this gateway stalled past the TTL): it is dropped, and its request learns it at
        its journal's first write (or :meth:`promote`) or :meth:`settle`. (Renewing someone else's ``:live`` once, or one
        that was just deleted, is harmless: its owner renews it anyway.)"""
        while self._held:
            await asyncio.sleep(LIVE_TTL_MS / 1000 / 3)
            held = list(self._held)
            pipe = self._redis.pipeline(transaction=False)
            for key, _ in held:
                pipe.get(keys.journal_live(key))
                pipe.pexpire(keys.journal_live(key), LIVE_TTL_MS)
            sent_ms = now_ms()
            try:
                results = await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("could not renew %d Idempotency-Key claim(s): %s", len(held), exc)
                continue
            missing = []
            for (key, owner), found in zip(held, results[::2], strict=True):
                if found is None:
                    missing.append((key, owner))  # Redis lost it: missing is not taken
                elif (key, owner) not in self._held:
                    continue  # settled or handed over meanwhile
                elif _text(found) != owner:
                    log.warning("Idempotency-Key %s: this gateway lost its claim (it stalled past its TTL)", key)
                    del self._held[key, owner]
                else:
                    self._held[key, owner] = sent_ms
            with contextlib.suppress(RedisError, OSError):
                for key, owner in missing:
                    if (key, owner) in self._held:  # not settled meanwhile
                        sent_ms = now_ms()
                        if await self._redis.set(keys.journal_live(key), owner, nx=True, px=LIVE_TTL_MS) \
                                and (key, owner) in self._held:
                            self._held[key, owner] = sent_ms
