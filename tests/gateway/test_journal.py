"""The journal's producer and the shared reader loop, on a real Redis, without HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.journal import (
    DONE,
    JournalCommitter,
    JournalLost,
    JournalWriter,
    live_key,
    start_producer,
    stream_key,
)
from gateway.journal_readers import JournalReaders
from sluice.redis_pool import RedisClient, create_pool


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    """One Redis server, then a Redis Cluster (readers' keys spread over its nodes)."""
    client = await create_pool(request.getfixturevalue(request.param))
    yield client
    await client.aclose()


@pytest.fixture
async def committer(redis: RedisClient) -> AsyncIterator[JournalCommitter]:
    writes = JournalCommitter(redis)
    yield writes
    await writes.close()


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


def _expected(n: int, after: int = 0) -> list[bytes]:
    return [b"id: %d\ndata: %d\n\n" % (i, i) for i in range(after + 1, n + 1)] + [DONE]


async def test_a_first_reader_that_falls_behind_goes_on_from_the_journal(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter
) -> None:
    key = uuid.uuid4().hex
    writer = JournalWriter(committer, key, ttl_s=60, owner="t")
    assert await writer.claim()
    first = writer.subscribe(readers.tail, lag_max=4)
    producer = await start_producer(writer, _events(100), _nothing)
    await producer  # all produced while nobody read
    assert [event async for event in first.events()] == _expected(100)


async def test_readers_of_several_streams_at_any_position_get_the_rest(
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter
) -> None:
    keys = [uuid.uuid4().hex for _ in range(4)]  # on a cluster, in different slots
    for key in keys:
        writer = JournalWriter(committer, key, ttl_s=60, owner="t")
        assert await writer.claim()
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
    redis: RedisClient, readers: JournalReaders, committer: JournalCommitter
) -> None:
    """A gateway that stalled past ``:live``'s TTL while another took its stream over must
    not write on (two producers would interleave their events)."""
    key = uuid.uuid4().hex
    stalled = JournalWriter(committer, key, ttl_s=60, owner="stalled")
    assert await stalled.claim()
    first = stalled.subscribe(readers.tail)
    await redis.set(live_key(key), "taker", px=60_000)  # another gateway took over
    assert not await JournalWriter(committer, key, ttl_s=60, owner="third").claim(take_over=True)

    async def taker() -> None:  # the taker writes events 1..3 and ends the stream
        for number, data in enumerate([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", DONE], start=1):
            await redis.xadd(stream_key(key), {"d": data}, id=f"0-{number}")

    await taker()
    producer = await start_producer(stalled, _events(50), _nothing)
    with contextlib.suppress(JournalLost):  # raised if it noticed before producing everything
        await producer
    assert await redis.xlen(stream_key(key)) == 4
    assert [event async for event in first.events()] == _expected(3)
