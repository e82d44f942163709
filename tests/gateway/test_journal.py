"""The journal's producer and the shared reader loop, on a real Redis, without HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis as sync_redis
from redis.asyncio.cluster import RedisCluster

from gateway.streams import event_ids
from gateway.streams.event_ids import frame, mark, tag_of
from gateway.streams.idempotency import Idempotency
from gateway.streams.journal import (
    APPEND,
    DONE,
    LIVE_TTL_MS,
    JournalCommitter,
    JournalLost,
    JournalWriter,
    entry_number,
    live_key,
    start_producer,
    stream_key,
)
from gateway.config import GatewaySettings
from gateway.streams.journal_history import JournalHistory
from gateway.streams.journal_keeper import Finished, JournalKeeper
from gateway.streams.journal_quota import CHUNK_BYTES, RESERVE, JournalQuota, StreamBudget
from gateway.streams.journal_readers import JournalReaders
from sluice import keys
from sluice.errors import DeadlineExceeded, RateLimited
from sluice.redis_pool import RedisClient, create_pool
from sluice.script_channel import ScriptChannel, script_runner


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    """One Redis server, then a Redis Cluster (readers' keys spread over its nodes)."""
    client = await create_pool(request.getfixturevalue(request.param))
    yield client
    await client.aclose()


@pytest.fixture
async def committer(redis: RedisClient) -> AsyncIterator[JournalCommitter]:
    """Its rounds on a script channel of their own, as the gateway's (gateway/relay/serving.py;
    on a Cluster, redis-py's scripts)."""
    runner = script_runner(redis)
    writes = JournalCommitter(redis, runner=runner)
    yield writes
    await writes.close()
    if isinstance(runner, ScriptChannel):
        await runner.aclose()


@pytest.fixture
async def idem(redis: RedisClient) -> AsyncIterator[Idempotency]:
    records = Idempotency(redis, ttl_s=60)
    yield records
    await records.close()


async def _claim(idem: Idempotency, key: str, owner: str, plan: bytes = b"{}") -> bool:
    """Claim ``key``'s stream for ``owner`` as a request with that Idempotency-Key does."""
    claimed = await idem.claim(key, "fp", True, time.monotonic() + 10, owner)
    return claimed is None and await idem.promote(key, owner, "fp", 10, plan)


@pytest.fixture
async def readers(redis: RedisClient) -> AsyncIterator[JournalReaders]:
    loop = JournalReaders(redis, poll_s=0.01, idle_s=0.2)
    yield loop
    await loop.close()


async def _events(n: int) -> AsyncIterator[bytes]:
    for i in range(1, n + 1):
        yield b"data: %d\n\n" % i
    yield DONE


async def _nothing() -> None:
    return None


def _expected(n: int, after: int = 0, owner: str | None = "t") -> list[bytes]:
    """Events after..n as the producer whose claim token is ``owner`` journals them, ids tagged
    with it (gateway/streams/event_ids.py); None: entries written without a mark."""
    tag = None if owner is None else tag_of(owner)
    return [frame(i, b"data: %d\n\n" % i, tag) for i in range(after + 1, n + 1)] + [DONE]


async def test_a_first_reader_that_falls_behind_goes_on_from_the_journal(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t")
    first = writer.subscribe(readers.tail, lag_max=4)
    producer = await start_producer(writer, _events(100), _nothing)
    await producer  # all produced while nobody read
    assert [event async for event in first.events()] == _expected(100)


async def test_readers_of_several_streams_at_any_position_get_the_rest(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    keys = [uuid.uuid4().hex for _ in range(4)]  # on a cluster, in different slots
    for key in keys:
        assert await _claim(idem, key, "t")
        writer = JournalWriter(committer, key, ttl_s=60, owner="t")
        await writer.run(_events(600), _nothing)

    async def read(key: str, after: int) -> list[bytes]:
        return [event async for event in readers.tail(key, after)]

    wanted = [(key, after) for key in keys for after in (0, 10, 599, 600)]
    got = await asyncio.gather(*(read(key, after) for key, after in wanted))  # one loop for all
    assert got == [_expected(600, after) for _, after in wanted]


async def test_readers_of_a_stream_whose_producer_is_gone_get_the_error(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter
) -> None:
    key = uuid.uuid4().hex
    await redis.xadd(stream_key(key), {"d": b"data: 1\n\n"}, id="0-1")
    await redis.delete(live_key(key))
    events = [event async for event in readers.tail(key, 0)]
    assert events[0] == b"id: 1\ndata: 1\n\n"
    assert b"producer is gone" in events[1]
    assert events[2:] == [DONE]
    await redis.delete(stream_key(key))


async def test_a_producer_taken_over_stops_writing_and_its_reader_follows_the_journal(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """A gateway that stalled past ``:live``'s TTL while another took its stream over must
    not write on (two producers would interleave their events)."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "stalled")
    stalled = JournalWriter(committer, key, ttl_s=60, owner="stalled")
    first = stalled.subscribe(readers.tail)
    await redis.set(live_key(key), "taker", px=60_000)  # another gateway took over
    assert await idem.take_stream(key, "third") == "held"

    async def taker() -> None:  # the taker writes events 1..3 and ends the stream
        for number, data in enumerate([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", DONE], start=1):
            await redis.xadd(stream_key(key), {"d": data}, id=f"0-{number}")

    await taker()
    producer = await start_producer(stalled, _events(50), _nothing)
    with contextlib.suppress(JournalLost):  # raised if it noticed before producing everything
        await producer
    assert await redis.xlen(stream_key(key)) == 4
    assert [event async for event in first.events()] == _expected(3, owner=None)  # the taker's, unmarked


async def test_a_journal_past_20000_events_is_not_trimmed_for_late_or_slow_readers(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: XADD MAXLEN ~ 20000 trimmed long journals silently; a re-attach after
    event 10 resumed at 4001, and a slow first client skipped events the same way."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t")
    slow = writer.subscribe(readers.tail, lag_max=4)  # falls behind at once: reads the journal
    await (await start_producer(writer, _events(24_000), _nothing))
    assert await redis.xlen(stream_key(key)) == 24_001
    late = [event async for event in readers.tail(key, 10)]
    assert late == _expected(24_000, 10)
    assert [event async for event in slow.events()] == _expected(24_000)
    await redis.delete(stream_key(key))


async def test_a_reader_gets_an_error_instead_of_a_gap_in_the_journal(
    redis: RedisClient, readers: JournalReaders
) -> None:
    """Regression: a reader whose next event was no longer in the journal got the events
    after the hole as if nothing was missing."""
    key = uuid.uuid4().hex
    for number in [1, 2, 3, 7, 8]:  # 4..6 lost
        await redis.xadd(stream_key(key), {"d": b"data: %d\n\n" % number}, id=f"0-{number}")
    await redis.xadd(stream_key(key), {"d": DONE}, id="0-9")
    await redis.set(live_key(key), "producer", px=60_000)
    from_start = [event async for event in readers.tail(key, 0)]
    assert from_start[:3] == _expected(3, owner=None)[:3]
    assert b"stream_history_lost" in from_start[3] and b"events 4..6" in from_start[3]
    assert from_start[4:] == [DONE]
    after_the_hole = [event async for event in readers.tail(key, 7)]  # id 7 itself was sent
    assert after_the_hole == [b"id: 8\ndata: 8\n\n", DONE]
    inside_the_hole = [event async for event in readers.tail(key, 4)]
    assert b"stream_history_lost" in inside_the_hole[0]
    assert inside_the_hole[1:] == [DONE]
    await redis.delete(stream_key(key), live_key(key))


async def test_a_stream_past_its_event_bound_ends_with_an_error(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t", max_events=50)
    first = writer.subscribe(readers.tail)
    await (await start_producer(writer, _events(100), _nothing))
    got = [event async for event in first.events()]
    assert got[:50] == _expected(50)[:50]
    assert b"stream_too_long" in got[50] and got[51:] == [DONE]
    reattached = [event async for event in readers.tail(key, 48)]
    assert reattached == got[48:51] + [DONE]
    await redis.delete(stream_key(key))


async def test_a_journal_redis_lost_is_written_again_whole_and_its_first_reader_goes_on(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: Redis losing ``:live`` (a restart without persistence, FLUSHALL, a
    failover) was taken for a take-over: every resumable stream in flight ended with
    "producer is gone" while plain streams went on. Then (nemesis seed 7: 187 of 1,740
    resumable streams) the producer wrote on after the hole, and a client re-attaching
    from before the loss got ``stream_history_lost``: now it writes events 1..N again."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t", plan=b"the plan")
    first = writer.subscribe(readers.tail)
    lost = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        for i in range(1, 201):
            if i == 101:  # the first 100 are written: Redis loses them, :live and the plan
                while await redis.xlen(stream_key(key)) < 100:
                    await asyncio.sleep(0.01)
                await redis.delete(stream_key(key), live_key(key), keys.journal_plan(key))
                lost.set()
            if i == 150:  # 1..149 written again, and the plan with them (a take-over needs it)
                while await redis.xlen(stream_key(key)) < 149:
                    await asyncio.sleep(0.01)
                assert await redis.get(keys.journal_plan(key)) == b"the plan"
            yield b"data: %d\n\n" % i
        yield DONE

    producer = await start_producer(writer, events(), _nothing)
    assert [event async for event in first.events()] == _expected(200)
    await producer
    assert await redis.xlen(stream_key(key)) == 201  # 1..200 and [DONE]: none lost
    # A client re-attaching from before the loss gets exactly the rest.
    assert [event async for event in readers.tail(key, 50)] == _expected(200, 50)
    assert [event async for event in readers.tail(key, 100)] == _expected(200, 100)
    assert lost.is_set()
    await redis.delete(stream_key(key))


async def test_a_producer_whose_journal_another_gateway_continued_does_not_write_on(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """``:live`` missing is a re-claim only if nobody wrote past this producer: a gateway
    that stalled while another took its stream over and finished it must not append."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "stalled")
    stalled = JournalWriter(committer, key, ttl_s=60, owner="stalled")
    taken = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        for i in range(1, 51):
            if i == 11:
                while await redis.xlen(stream_key(key)) < 10:
                    await asyncio.sleep(0.01)
                # Another gateway took over after event 10 (made itself the key's owner, as
                # TAKE does), wrote 11..13 and [DONE], let go.
                await redis.hset(keys.idempotency(key), "owner", "taker")
                for number, data in [(11, b"data: x\n\n"), (12, b"data: y\n\n"), (13, DONE)]:
                    await redis.xadd(stream_key(key), {"d": data}, id=f"0-{number}")
                await redis.delete(live_key(key))
                taken.set()
            yield b"data: %d\n\n" % i
        yield DONE

    with contextlib.suppress(JournalLost):
        await (await start_producer(stalled, events(), _nothing))
    assert taken.is_set()
    entries = await redis.xrange(stream_key(key))
    assert [e[0] for e in entries] == [f"0-{n}".encode() for n in range(1, 14)]
    assert entries[-1][1][b"d"] == DONE
    await redis.delete(stream_key(key))


async def test_a_producer_taken_over_never_writes_its_stale_history_after_redis_loses_the_journal(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression (nemesis seed 7, a hang): gateway A stalled, B took its stream over; A,
    back, was told and kept refreshing ``:live``; Redis then lost its data and A re-claimed
    the stream and wrote its stale events 1..7504 over B's 1..20344; B stopped, A's
    generation was stuck in a migration, and the client waited forever. A producer that
    lost its stream is done for good, and its generation is cancelled at once."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "a")
    writer = JournalWriter(committer, key, ttl_s=60, owner="a", plan=b"the plan")
    cancelled = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            for i in range(1, 6):
                yield b"data: %d\n\n" % i
            await asyncio.Event().wait()  # a migration that does not end
        except asyncio.CancelledError:
            cancelled.set()
            raise

    producer = await start_producer(writer, events(), _nothing)
    while await redis.xlen(stream_key(key)) < 5:
        await asyncio.sleep(0.01)
    await redis.set(live_key(key), "b", px=60_000)  # B took the stream over
    with pytest.raises(JournalLost):
        await asyncio.wait_for(producer, 5)  # was: waited for the generation's next event
    assert cancelled.is_set()  # the generation is cancelled: its engine is freed
    await redis.delete(stream_key(key), live_key(key), keys.journal_plan(key))  # Redis lost it all
    await asyncio.sleep(1.5)  # three of the committer's :live refresh periods
    assert await redis.xlen(stream_key(key)) == 0
    assert await redis.get(live_key(key)) is None


def _stall_then_lose(redis: RedisClient, key: str, taker: bool) -> AsyncIterator[bytes]:
    """Events 1..10, with the whole process stalled (no :live refresh) past ``:live``'s TTL
    after event 5, then Redis losing the stream; with ``taker``, a gateway that took the
    stream over during the stall writes its own journal back (events 1..7) half a second
    after this one resumes, as a live producer does within a refresh period."""

    def take_over_back() -> None:
        time.sleep(0.5)
        with sync_redis.Redis(**redis_kwargs) as client:
            client.set(live_key(key), "b", px=60_000)
            for n in range(1, 8):
                client.xadd(stream_key(key), {"d": b"data: b%d\n\n" % n}, id=f"0-{n}")

    redis_kwargs = {"host": "127.0.0.1", "port": _port_of(redis, key)}

    async def events() -> AsyncIterator[bytes]:
        for i in range(1, 6):
            yield b"data: %d\n\n" % i
        while await redis.xlen(stream_key(key)) < 5:
            await asyncio.sleep(0.01)
        time.sleep(LIVE_TTL_MS / 1000 + 0.3)  # the whole process stalls: no :live refresh
        await redis.delete(stream_key(key), live_key(key), keys.journal_plan(key))  # then Redis lost it all
        if taker:
            threading.Thread(target=take_over_back, daemon=True).start()
        for i in range(6, 11):
            yield b"data: %d\n\n" % i
        yield DONE

    return events()


def _port_of(redis: RedisClient, key: str) -> int:
    """The port of the server that holds ``key``'s journal (a Cluster's node, or the one server)."""
    if isinstance(redis, RedisCluster):
        node = redis.get_node_from_key(stream_key(key))
        assert node is not None
        return int(node.port)
    return int(redis.connection_pool.connection_kwargs["port"])


async def test_a_producer_stalled_past_its_claim_gives_a_taker_time_to_re_claim_a_journal_redis_lost(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: a gateway stalled longer than ``:live``'s TTL (SIGSTOP) may have been
    taken over meanwhile, and Redis may have lost that evidence with the data: re-claiming
    at once, it wrote its stale history and its own continuation over what the taker's
    readers had (a splice). It now waits for a taker to re-claim first, and stops."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "a")
    writer = JournalWriter(committer, key, ttl_s=60, owner="a", plan=b"the plan")
    with contextlib.suppress(JournalLost):  # raised if it noticed before its generation ended
        await asyncio.wait_for(await start_producer(writer, _stall_then_lose(redis, key, taker=True), _nothing), 10)
    assert writer.lost
    for _ in range(200):  # the taker's thread set :live before its entries: let it finish
        if await redis.xlen(stream_key(key)) >= 7:
            break
        await asyncio.sleep(0.01)
    entries = await redis.xrange(stream_key(key))
    assert [e[1][b"d"] for e in entries] == [b"data: b%d\n\n" % n for n in range(1, 8)]  # the taker's, untouched
    assert await redis.get(live_key(key)) == b"b"
    await redis.delete(stream_key(key), live_key(key))


async def test_a_producer_stalled_past_its_claim_re_claims_a_journal_redis_lost_when_nobody_took_it(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """The stall and the loss without a taker: after the grace the producer writes the
    journal back whole and finishes the stream (no error for a fault it can repair)."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "a")
    writer = JournalWriter(committer, key, ttl_s=60, owner="a", plan=b"the plan")
    await asyncio.wait_for(await start_producer(writer, _stall_then_lose(redis, key, taker=False), _nothing), 15)
    assert not writer.lost
    assert [event async for event in readers.tail(key, 3)] == _expected(10, 3, owner="a")
    await redis.delete(stream_key(key))


async def test_a_producer_that_lost_live_never_deletes_the_new_owners(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: a producer deleted ``:live`` unchecked when it ended, so one that stalled
    past the TTL after its last write freed the stream another gateway had taken over,
    and a third could take it over too: two producers of one stream."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "stalled")
    stalled = JournalWriter(committer, key, ttl_s=60, owner="stalled")

    async def stall_then_taken_over() -> None:  # the generation's clean-up: the stall
        while await redis.xlen(stream_key(key)) < 6:  # everything written, [DONE] included
            await asyncio.sleep(0.01)
        # This gateway stalled past :live's TTL and another took the stream over meanwhile.
        await redis.set(live_key(key), "taker", px=60_000)

    await stalled.run(_events(5), stall_then_taken_over)
    assert await redis.get(live_key(key)) == b"taker"
    assert await idem.take_stream(key, "third") == "held"
    await redis.delete(stream_key(key), live_key(key))


async def test_two_take_overs_race_and_only_one_produces(redis: RedisClient, committer: JournalCommitter,
                                                        idem: Idempotency) -> None:
    """Two gateways whose readers found the producer gone at the same moment: one claims
    the stream; the other, however late its claim, never produces it as well."""
    key = uuid.uuid4().hex
    await redis.set(keys.journal_plan(key), b"{}", px=60_000)  # a stream that can be continued
    for _ in range(20):
        won = await asyncio.gather(*(idem.take_stream(key, f"taker-{i}") for i in range(2)))
        assert sorted(won) == ["held", "taken"]
        winner, loser = f"taker-{won.index('taken')}", f"taker-{won.index('held')}"
        assert not await committer.release(key, loser)  # the loser lets go of nothing it does not hold
        assert await redis.get(live_key(key)) == winner.encode()
        assert await committer.release(key, winner)
        assert await redis.get(live_key(key)) is None


async def test_a_take_over_claims_nothing_of_a_stream_whose_plan_redis_lost(redis: RedisClient,
                                                                          idem: Idempotency) -> None:
    """Regression (a CI run): a reader whose producer was stopped across a FLUSHALL tried a
    take-over every second; each claimed ``:live`` for a moment before finding no plan, and
    the producer, back to write its journal again, met one such claim, took it for a
    take-over and stopped: the stream was lost. Without its plan nothing is claimed, unless
    the taker has waited for the producer long enough and will forget the stream."""
    key = uuid.uuid4().hex
    assert await idem.take_stream(key, "taker") == "planless"
    assert await redis.get(live_key(key)) is None
    assert await idem.take_stream(key, "taker", planless=True) == "taken"
    assert await redis.get(live_key(key)) == b"taker"
    await redis.delete(live_key(key))


async def test_a_new_attempt_never_takes_a_stream_another_producer_still_writes(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: a new request with the key claimed ``:live`` unchecked (and first deleted
    the journal under it): the producer still writing lost its stream, and its readers
    read on into the new generation, a splice of two."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "first")
    await JournalWriter(committer, key, ttl_s=60, owner="first").run(_events(3), _nothing)
    await idem.settle(key, "first", completed=False)  # it failed: a retry runs it again
    assert await _claim(idem, key, "second")  # a new attempt: the earlier one's journal is dropped
    assert await redis.xlen(stream_key(key)) == 0
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "third") == "attach"
    await redis.delete(keys.idempotency(key))  # Redis lost the record, not the producer's :live
    with pytest.raises(DeadlineExceeded):  # the key's owner lives: a retry waits, never claims it
        await idem.claim(key, "fp", True, time.monotonic() + 0.2, "third")
    assert await redis.get(live_key(key)) == b"second"
    await committer.release(key, "second")
    await redis.delete(stream_key(key), keys.journal_plan(key))


async def test_a_producer_restores_the_key_record_redis_lost(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression: Redis losing its data (FLUSHALL, a restart without persistence) lost the
    Idempotency-Key's record while the producer went on: a re-attach got 404 and a retry
    with the key claimed it afresh, a second generation. The producer's next write
    restores the record (and ``:live``); a retry waiting meanwhile attaches to its stream."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t", fingerprint="fp")
    lost, resume = asyncio.Event(), asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        while await redis.xlen(stream_key(key)) < 1:
            await asyncio.sleep(0.01)
        await redis.delete(keys.idempotency(key), live_key(key), stream_key(key))  # Redis lost it all
        lost.set()
        yield b"data: 2\n\n"
        await resume.wait()
        yield DONE

    producer = await start_producer(writer, events(), _nothing)
    await lost.wait()
    while await redis.xlen(stream_key(key)) < 1:  # event 2 written: the producer wrote on
        await asyncio.sleep(0.01)
    record = await idem.lookup(key)
    assert record is not None and record.get("owner") == "t" and record.get("state") == "streaming", record
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "retry") == "attach"  # not a new generation
    resume.set()
    await producer
    await idem.settle(key, "t", completed=True)  # its owner settles it, as after any stream
    assert (await idem.lookup(key) or {}).get("state") == "done"
    assert await redis.get(live_key(key)) is None
    await redis.delete(stream_key(key))


async def test_a_streams_plan_lives_as_long_as_its_journal_and_goes_with_its_end(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """The plan was set once, for the TTL, at the start: a stream running close to it
    became impossible to take over; and a finished one kept its request body an hour."""
    key = uuid.uuid4().hex

    async def unfinished() -> AsyncIterator[bytes]:
        for i in range(1, 4):
            yield b"data: %d\n\n" % i

    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t")
    await redis.pexpire(keys.journal_plan(key), 2000)  # close to its end
    await writer.run(unfinished(), _nothing)
    assert await redis.pttl(keys.journal_plan(key)) > 50_000
    await idem.settle(key, "t", completed=False)  # it failed: its key is forgotten, a retry runs again
    assert await _claim(idem, key, "u")
    finished = JournalWriter(committer, key, ttl_s=60, owner="u", done_ttl_s=5)
    await finished.run(_events(3), _nothing)
    assert not await redis.exists(keys.journal_plan(key))
    assert 0 < await redis.pttl(stream_key(key)) <= 5000
    await redis.delete(stream_key(key))


def _beginning(committer: JournalCommitter, idem: Idempotency, quota: JournalQuota, key: str, owner: str,
               plan: bytes = b'{"plan": 1}') -> tuple[JournalWriter, StreamBudget]:
    """A claimed stream's writer as a request builds it: promoted, and its journal memory
    reserved, by its first write (gateway/relay/serving.py)."""
    budget = quota.budget(key, "tenant", len(plan), hold_s=60, holder=owner)
    writer = JournalWriter(committer, key, ttl_s=60, owner=owner, fingerprint="fp", plan=plan, budget=budget,
                           claimed_ms=idem.hand_over(key, owner), promotion_ttl_ms=idem.record_ttl_ms(10))
    return writer, budget


async def _first_then(more: asyncio.Event) -> AsyncIterator[bytes]:
    yield b"data: 1\n\n"
    await more.wait()
    yield DONE


async def test_a_claimed_stream_begins_with_its_first_write_promoted_and_reserved(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """One round trip begins a stream: the claim becomes the key's stream (record
    ``streaming``, plan stored) with its first event, and its journal memory is reserved
    alongside (they were two round trips before the first write: promote, then the quota)."""
    key, plan = uuid.uuid4().hex, b'{"plan": 1}'
    for source in (APPEND, RESERVE):  # (a Redis that does not know a script yet costs a round more)
        await redis.script_load(source)
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "t") is None
    assert (await idem.lookup(key) or {}).get("state") == "pending"
    writer, budget = _beginning(committer, idem, JournalQuota(redis, GatewaySettings()), key, "t", plan)
    first = writer.subscribe(readers.tail)
    more = asyncio.Event()
    producer = await start_producer(writer, _first_then(more), _nothing)
    assert await writer.started() is None
    assert committer.rounds == 1  # promotion, reservation and event 1 in one round
    record = await idem.lookup(key)
    assert record is not None and record["state"] == "streaming" and record["owner"] == "t", record
    assert await redis.get(keys.journal_plan(key)) == plan
    assert await redis.xlen(stream_key(key)) == 1
    assert budget.reserved == len(plan) + CHUNK_BYTES
    assert int(await redis.hget(keys.JOURNAL_QUOTA.size, key)) == budget.reserved
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "retry") == "attach"
    more.set()
    await producer
    assert [event async for event in first.events()] == _expected(1)


async def test_a_claim_another_request_took_is_never_promoted_and_its_reservation_is_undone(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """A gateway that stalled past its claim's TTL lost the key to a retry (here: ``:live``
    expired, the retry claimed it): its first write finds the key the retry's and writes
    nothing; the reservation it made in the same round trip is undone, the retry's stays."""
    key = uuid.uuid4().hex
    quota = JournalQuota(redis, GatewaySettings())
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "stalled") is None
    writer, budget = _beginning(committer, idem, quota, key, "stalled")
    await redis.delete(live_key(key))  # its claim expired while it stalled
    retry = Idempotency(redis, ttl_s=60)
    try:
        assert await retry.claim(key, "fp", True, time.monotonic() + 10, "retry") is None
        taken = await quota.open(key, "tenant", 100, hold_s=60)  # the retry's stream reserved first
        held = int(await redis.hget(keys.JOURNAL_QUOTA.size, key))
        more = asyncio.Event()
        producer = await start_producer(writer, _first_then(more), _nothing)
        failure = await writer.started()
        assert isinstance(failure, JournalLost)
        with pytest.raises(JournalLost):
            await producer  # its generation was cancelled before its second event
        assert await redis.xlen(stream_key(key)) == 0 and not await redis.exists(keys.journal_plan(key))
        record = await idem.lookup(key)
        assert record is not None and record["state"] == "pending" and record["owner"] == "retry", record
        assert await budget.undo_opening()
        assert int(await redis.hget(keys.JOURNAL_QUOTA.size, key)) == held == taken.reserved
    finally:
        await retry.close()


async def test_a_stream_whose_first_reservation_is_refused_stops_before_its_first_client_sees_it(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """The quota's 429 comes with the first write: the writer stops there (the request
    undoes what that write did and answers 429, gateway/relay/serving.py)."""
    key = uuid.uuid4().hex
    settings = GatewaySettings(journal_tenant_max_bytes=1 << 20)
    quota = JournalQuota(redis, settings)
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "t") is None
    plan = b"p" * settings.journal_tenant_max_bytes  # with its first chunk, past its tenant's bound
    writer, budget = _beginning(committer, idem, quota, key, "t", plan)
    more = asyncio.Event()
    producer = await start_producer(writer, _first_then(more), _nothing)
    failure = await writer.started()
    assert isinstance(failure, RateLimited) and failure.code == "journal_memory_exceeded"
    with pytest.raises(JournalLost):
        await producer  # its generation was cancelled before its second event
    assert await redis.xlen(stream_key(key)) == 1  # its first round's event, which no client got
    assert budget.reserved == 0 and not await redis.hexists(keys.JOURNAL_QUOTA.size, key)
    assert await idem.abandon_stream(key, "t")  # what serving's undo does
    assert not await redis.exists(stream_key(key), keys.idempotency(key), keys.journal_plan(key), live_key(key))


async def test_a_stream_fast_past_its_first_chunk_grows_its_budget_only_after_its_first_reservation(
    redis: RedisClient, committer: JournalCommitter, idem: Idempotency
) -> None:
    """A generation faster than the first round trip: the budget grows only once its first
    reservation (which replaces whatever the key held) is made, so every byte reserved stays
    counted."""
    key = uuid.uuid4().hex
    assert await idem.claim(key, "fp", True, time.monotonic() + 10, "t") is None
    writer, budget = _beginning(committer, idem, JournalQuota(redis, GatewaySettings()), key, "t")

    burst, more = asyncio.Event(), asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        for i in range(3 * CHUNK_BYTES // 1000):  # three chunks' worth before any reply
            yield b"data: %04d %s\n\n" % (i, b"x" * 1000)
        burst.set()
        await more.wait()
        yield DONE

    producer = await start_producer(writer, events(), _nothing)
    assert await writer.started() is None
    await burst.wait()
    assert budget.reserved > 3 * CHUNK_BYTES
    assert int(await redis.hget(keys.JOURNAL_QUOTA.size, key)) == budget.reserved
    more.set()
    await producer


async def test_the_committer_survives_an_exception_object_in_a_result(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """On a Cluster, the APPENDs are gathered with ``return_exceptions``: a call that failed
    with something other than a Redis error (redis-py's closed-transport ``RuntimeError``
    mid-failover) used to be read as a result (``TypeError``), killing the committer and
    ending every stream of the gateway. It is a failed write, retried."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    append_all, failed_rounds = committer._append_all, []

    async def first_round_fails(batches: list[tuple[list[str], list[bytes | str | int]]]) -> list[object]:
        if not failed_rounds:  # as gather returns a call that raised, nothing written
            failed_rounds.append(batches)
            return [RuntimeError("unable to perform operation on <TCPTransport closed=True>") for _ in batches]
        return await append_all(batches)

    committer._append_all = first_round_fails  # type: ignore[method-assign]
    writer = JournalWriter(committer, key, ttl_s=60, owner="t")
    await writer.run(_events(50), _nothing)
    assert failed_rounds
    assert [event async for event in readers.tail(key, 0)] == _expected(50)


async def test_a_finished_journal_redis_lost_is_written_back_by_its_producer(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression (nemesis seed 7): a client that came back after its stream had ended, and
    Redis had lost the journal meanwhile, got ``stream_history_lost``: no producer was left
    to write it again. Its gateway keeps a finished stream's events a while and writes them
    back, with the key's record, when the registry's epoch says Redis lost its data."""
    key = uuid.uuid4().hex
    assert await _claim(idem, key, "t")
    writer = JournalWriter(committer, key, ttl_s=60, owner="t", fingerprint="fp", head=b"data: {\"id\":1")
    await (await start_producer(writer, _events(50), _nothing))
    await redis.delete(stream_key(key), keys.idempotency(key), keys.journal_head(key))
    await committer.keeper.restore_all()  # what a new epoch makes it do
    assert await redis.xlen(stream_key(key)) == 51
    assert await redis.hget(keys.idempotency(key), "state") == b"done"
    assert [event async for event in readers.tail(key, 5)] == _expected(50, 5)
    # A key claimed again since is left alone.
    await redis.delete(stream_key(key))
    await redis.set(live_key(key), "someone else", px=5_000)
    await committer.keeper.restore_all()
    assert await redis.exists(stream_key(key)) == 0
    await redis.delete(live_key(key), keys.idempotency(key), keys.journal_head(key))


async def test_a_reader_never_goes_on_in_another_history_of_the_same_events(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter, idem: Idempotency
) -> None:
    """Regression (nemesis, Sentinel: nem-4573): gateway A, cut off from the master the others
    reached, went on producing while gateway B took the stream over after event 5 and wrote
    its own events 6.. under the same numbers; Redis then lost its data and A wrote its own
    history back. A client holding B's events up to 8 read A's 9 on: tokens twice, a gap.
    Event ids now name their producer (gateway/streams/event_ids.py): that is an error."""
    key = uuid.uuid4().hex
    a, b = tag_of("a"), tag_of("b")
    history = JournalHistory()
    for n in range(1, 6):  # A's events 1..5, as B's take-over read them back
        await redis.xadd(stream_key(key), {"d": b"data: %d\n\n" % n, "s": mark(b"", a)}, id=f"0-{n}")
        history.add(b"data: %d\n\n" % n, mark(b"", a))
    assert await _claim(idem, key, "b")
    taker = JournalWriter(committer, key, ttl_s=60, owner="b")
    taker.continue_after(5, history, a)

    async def bs() -> AsyncIterator[bytes]:
        for n in range(6, 9):
            yield b"data: B%d\n\n" % n
        yield DONE

    await taker.run(bs(), _nothing)
    stored = {entry_number(i): f[b"s"] for i, f in await redis.xrange(stream_key(key))}
    assert stored[6] == b"~" + b + b"<" + a and stored[7] == b"~" + b  # the take-over names A once
    # A client of A's re-attached after 3 goes on into B's continuation: one history.
    got = [event async for event in readers.tail(key, 3, chain=a)]
    assert got == [frame(4, b"data: 4\n\n", a), frame(5, b"data: 5\n\n", a),
                   *(frame(n, b"data: B%d\n\n" % n, b) for n in range(6, 9)), DONE]
    # Redis loses it all; A, still producing, writes its own history back, 1..10.
    await redis.delete(stream_key(key))
    for n in range(1, 11):
        await redis.xadd(stream_key(key), {"d": b"data: %d\n\n" % n, "s": mark(b"", a)}, id=f"0-{n}")
    await redis.xadd(stream_key(key), {"d": DONE, "s": mark(b"", a)}, id="0-11")
    spliced = [event async for event in readers.tail(key, 8, chain=b)]  # holds B's 6..8
    assert len(spliced) == 2 and b"stream_history_lost" in spliced[0] and spliced[1] == DONE
    # A's own clients, and clients that give no tag (older ids), go on.
    assert [event async for event in readers.tail(key, 8, chain=a)] == _expected(10, 8, owner="a")
    assert [event async for event in readers.tail(key, 8)] == _expected(10, 8, owner="a")
    await redis.delete(stream_key(key))


def test_a_last_event_id_carries_its_producers_tag() -> None:
    assert event_ids.parse("279.3fa9c2d1") == (279, b"3fa9c2d1")
    assert event_ids.parse(" 12 ") == (12, None)  # an id without a tag is not checked
    assert event_ids.parse("12.<script>") == (12, None)  # not one of ours
    assert event_ids.parse("x.3fa9c2d1") == (0, None) and event_ids.parse(None) == (0, None)
    assert event_ids.unmarked(mark(b"0|17|5", b"3fa9c2d1", b"77aa01bc")) == b"0|17|5"
    assert event_ids.marks(b"0|17|5") == (None, None)


def test_a_last_event_id_says_what_its_client_holds_of_a_stream_that_can_be_generated_again() -> None:
    """(gateway/streams/regenerate.py) The id's digest rides in the entry's mark; the tag
    alone still decides which history an event belongs to."""
    state = mark(b"0|17|5", b"3fa9c2d1", b"77aa01bc", b"275.1042.5be0a7c1")
    assert event_ids.marks(state) == (b"3fa9c2d1", b"77aa01bc")
    assert event_ids.unmarked(state) == b"0|17|5"
    assert event_ids.id_tail(state) == b"3fa9c2d1.275.1042.5be0a7c1"
    header = event_ids.frame(279, b"data: x\n\n", event_ids.id_tail(state)).split(b"\n")[0][4:].decode()
    assert event_ids.parse(header) == (279, b"3fa9c2d1")
    assert event_ids.held(header) == ((275,), (1042,), b"5be0a7c1")
    assert event_ids.held("279.3fa9c2d1") is None and event_ids.held("279.3fa9c2d1.x.1.ab") is None
    assert event_ids.held("279.3fa9c2d1.1:2.3.ab") is None  # a count per choice, for every choice


def test_a_stream_of_several_choices_accounts_for_each_in_its_ids() -> None:
    """Each choice's tokens and characters, and one hash over every choice's: the same ids
    give the same hash whichever way the choices' lines interleaved."""
    one, two = event_ids.Account(2), event_ids.Account(2)
    for index, ids, chars in [(0, [5, 7], 4), (1, [9], 2), (0, [3], 1)]:
        one.add(index, ids, chars)
    for index, ids, chars in [(1, [9], 2), (0, [5], 2), (0, [7, 3], 3)]:
        two.add(index, ids, chars)
    assert one.digest() == two.digest()
    tokens, chars, ids_hash = one.digest().split(b".")
    assert (tokens, chars) == (b"3:1", b"5:2")
    assert event_ids.held("8.3fa9c2d1." + one.digest().decode()) == ((3, 1), (5, 2), ids_hash)
    three = event_ids.Account(2)
    three.add(0, [5, 7, 3], 5)
    three.add(1, [8], 2)
    assert three.ids_hash() != one.ids_hash()
    single = event_ids.Account(1)
    single.add(0, [5, 7])  # one choice: the hash of its ids alone (ids given before this change)
    hasher = event_ids.ids_hasher()
    hasher.update(b"5,7,")
    assert single.ids_hash() == hasher.hexdigest().encode()


async def test_a_keeper_drops_its_copies_past_their_time_oldest_first(redis_url: str) -> None:
    """Finished journals are kept ``keep_s`` after their end (or their TTL), then dropped at
    the next look, found at the front: walking all of them at each look was 2 % of a gateway's
    CPU at 1,000 resumable streams a second. A stream kept again is kept from its new end."""
    client = await create_pool(redis_url)
    keeper = JournalKeeper(client, keep_s=10.0)
    now = time.monotonic()

    def ended(scope: str, age_s: float, ttl_s: float = 600.0) -> Finished:
        return Finished(scope, "owner", "fp", b"", JournalHistory(), int(ttl_s * 1000), None, 0,
                        ended_at=now - age_s)

    try:
        for finished in (ended("a", 30), ended("b", 20), ended("c", 5), ended("b", 1), ended("d", 0.5, ttl_s=0.6)):
            keeper.keep(finished)
        await asyncio.sleep(0.2)  # d's TTL runs out
        assert await keeper._after_look(False)
        assert set(keeper._kept) == {"b", "c", "d"}  # a and the first b past keep_s; c, older than d, is not
        assert keeper._kept["b"].ended_at == now - 1
        keeper._keep_s = 3.0
        assert await keeper._after_look(False)
        assert set(keeper._kept) == {"b", "d"}  # c past keep_s; the second b is not, and d is behind it
        keeper._keep_s = 1.0
        assert await keeper._after_look(False)
        assert not keeper._kept  # b past keep_s, then d past its TTL
    finally:
        await keeper.close()
        await client.aclose()
