"""Idempotency-Key records and who may change them, on a real Redis (one server and a
Cluster), without HTTP: only the key's current owner settles it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.loss_watch import LossWatch
from gateway.streams.idempotency import Idempotency
from gateway.streams.journal import LIVE_TTL_MS
from sluice import keys
from sluice.errors import DeadlineExceeded
from sluice.redis_pool import RedisClient, create_pool


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def idem(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Idempotency, RedisClient]]:
    """On one Redis server, then on a Cluster (the record and the journal's keys share a slot)."""
    client = await create_pool(request.getfixturevalue(request.param))
    records = Idempotency(client, ttl_s=60)
    yield records, client
    await records.close()
    await client.aclose()


def _deadline() -> float:
    return time.monotonic() + 30


async def test_a_take_over_moves_the_key_so_the_producer_it_replaced_cannot_settle_it(idem) -> None:
    records, redis = idem
    key = uuid.uuid4().hex
    assert await records.claim(key, "fp", True, _deadline(), owner="a") is None
    assert await records.promote(key, "a", "fp", remaining_s=10, plan=b"{}")
    assert not await records.take_stream(key, "b"), "a lives: no take-over"
    await redis.delete(keys.journal_live(key))  # a stalled past :live's TTL
    assert await records.take_stream(key, "b")
    await records.settle(key, "a", completed=False)  # a wakes and would forget the key
    assert (await records.lookup(key) or {}).get("owner") == "b"
    assert await records.claim(key, "fp", True, _deadline(), owner="c") == "attach"
    await records.settle(key, "b", completed=True)
    assert (await records.lookup(key) or {}).get("state") == "done"


async def test_a_pending_claim_is_free_once_its_owner_stops_renewing_it(idem) -> None:
    records, redis = idem
    key = uuid.uuid4().hex
    assert await records.claim(key, "fp", False, _deadline(), owner="a") is None
    # Renewed while a lives: past several TTLs' worth of renewals it is still a's.
    await asyncio.sleep(LIVE_TTL_MS / 1000 * 1.5)
    assert await redis.get(keys.journal_live(key)) == b"a"
    await records.close()  # a's process stops: nothing renews its claim any more
    waiter = Idempotency(redis, ttl_s=60)  # another gateway's
    try:
        assert await waiter.claim(key, "fp", False, _deadline(), owner="b") is None  # within LIVE_TTL_MS
        await records.settle(key, "a", completed=True, body=b'{"from": "a"}')  # a wakes: too late
        await waiter.settle(key, "b", completed=True, body=b'{"from": "b"}')
        replay = await waiter.claim(key, "fp", False, _deadline(), owner="c")
        assert replay is not None and replay != "attach" and replay.body == b'{"from": "b"}'
    finally:
        await waiter.close()


async def test_a_journal_whose_producer_lives_is_never_claimed_away(idem) -> None:
    """A record Redis lost does not free a key whose stream still has a live producer: the
    claim would drop that journal. A retry waits while the owner lives (it restores the
    record with its next write, see test_journal.py)."""
    records, redis = idem
    key = uuid.uuid4().hex
    await redis.set(keys.journal_live(key), "producer", px=LIVE_TTL_MS)
    await redis.xadd(keys.journal(key), {"d": b"data: {}\n\n", "s": b""}, id="0-1")
    with pytest.raises(DeadlineExceeded):
        await records.claim(key, "fp", True, time.monotonic() + 0.2, owner="retry")
    assert await redis.xlen(keys.journal(key)) == 1
    assert await redis.get(keys.journal_live(key)) == b"producer"


async def test_a_fresh_claim_right_after_a_loss_its_watch_has_not_seen_waits_for_the_write_back(idem) -> None:
    """Regression (nemesis, one Redis: nem-1938 billed twice): a client's retry came 0.3 s
    after Redis lost a finished request's record, before its gateway's watch had looked at
    Redis again (every 0.5 s); the key was free, the request ran again. A fresh claim now
    looks once more, and finding a loss waits for the record's write-back (here 0.5 s later)."""
    _, redis = idem
    await redis.hset(keys.EPOCH, "id", uuid.uuid4().hex)
    watch = LossWatch(redis, check_s=3600)  # it looks once now, and not again in this test
    watch.start()
    try:
        while watch.seen_epoch is None:
            await asyncio.sleep(0.01)
        records = Idempotency(redis, ttl_s=60, unsure=watch.unsure_s, watch=watch)
        key, fp, body = f"{{k{uuid.uuid4().hex}}}", "fp", b'{"answer": 1}'
        assert await records.claim(key, fp, False, _deadline(), "first") is None
        assert await records.settle(key, "first", completed=True, body=body)
        record = await redis.hgetall(keys.idempotency(key))
        await redis.flushall()

        async def write_back() -> None:  # what the producing gateway's keeper does once its watch looked
            await asyncio.sleep(0.5)
            await redis.hset(keys.idempotency(key), mapping=record)

        keeper = asyncio.create_task(write_back())
        answer = await records.claim(key, fp, False, _deadline(), "retry")
        await keeper
        assert answer is not None and bytes(answer.body) == body  # the stored answer, not a second run
        await records.close()
    finally:
        await watch.close()
