"""Journal memory reservations on a real Redis and a Redis Cluster, without HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.config import GatewaySettings
from gateway.streams.journal_quota import CHUNK_BYTES, JournalQuota, StreamBudget, journal_events
from gateway.surfaces.openai import ChatCompletionRequest
from sluice import keys
from sluice.errors import InvalidRequest, RateLimited
from sluice.redis_pool import RedisClient, create_pool

MIB = 1024 * 1024


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    client = await create_pool(request.getfixturevalue(request.param))
    await client.delete(*keys.JOURNAL_QUOTA)
    yield client
    await client.delete(*keys.JOURNAL_QUOTA)
    await client.aclose()


def _settings(**overrides: int) -> GatewaySettings:
    return GatewaySettings(journal_tenant_max_bytes=MIB, journal_max_bytes=2 * MIB, **overrides)


async def test_a_tenant_past_its_bound_is_refused_and_others_are_not(redis: RedisClient) -> None:
    quota = JournalQuota(redis, _settings())
    held = [await quota.open(uuid.uuid4().hex, "greedy", 0, hold_s=60) for _ in range(MIB // CHUNK_BYTES)]
    with pytest.raises(RateLimited) as refused:
        await quota.open(uuid.uuid4().hex, "greedy", 0, hold_s=60)
    assert refused.value.code == "journal_memory_exceeded" and "API key" in refused.value.message
    other = [await quota.open(uuid.uuid4().hex, "other", 0, hold_s=60) for _ in range(MIB // CHUNK_BYTES)]
    with pytest.raises(RateLimited) as full:  # both tenants at their bound: the total is too
        await quota.open(uuid.uuid4().hex, "third", 0, hold_s=60)
    assert "all streams" in full.value.message
    # A stream that ends holds what it wrote; one that never started, nothing.
    await held[0].settle(1000, 60_000)
    await held[1].release()
    assert int(await redis.hget(keys.JOURNAL_QUOTA.tenants, "greedy")) == MIB - 2 * CHUNK_BYTES + 1000
    assert int(await redis.get(keys.JOURNAL_QUOTA.total)) == 2 * MIB - 2 * CHUNK_BYTES + 1000
    assert not await held[2].grow(held[2].reserved + 3 * CHUNK_BYTES)  # past the bound mid-stream
    assert await other[0].grow(0) is False  # the total is still full


async def _open(budget: StreamBudget) -> RateLimited | None:
    """A stream's first reservation, as its journal's first round sends it."""
    script, names, args = budget.opening_call()
    refusal = budget.opened(await script(keys=names, args=args))
    assert refusal is None or isinstance(refusal, RateLimited)
    return refusal


async def _held(redis: RedisClient, scope: str) -> tuple[int, int, int, bytes | None]:
    """The scope's bytes, its tenant's, all tenants', and the scope's holder."""
    quota = keys.JOURNAL_QUOTA
    return (int(await redis.hget(quota.size, scope) or 0), int(await redis.hget(quota.tenants, "t") or 0),
            int(await redis.get(quota.total) or 0), await redis.hget(quota.holder, scope))


async def test_a_failed_promotion_undoes_its_reservation_never_the_one_of_the_request_that_won_the_key(
        redis: RedisClient) -> None:
    """A stream's first reservation goes with its promotion, in one round trip
    (gateway/streams/journal.py); a promotion refused (another request owns the key now: this
    gateway stalled past its claim) undoes it. The request that won the key keeps its own
    reservation whichever of the two reserved first."""
    quota = JournalQuota(redis, _settings())
    scope = uuid.uuid4().hex
    # The winner reserved first; the loser's reservation replaced it, then is undone.
    winner = await quota.open(scope, "t", 1000, hold_s=60)  # (as a new stream's: holder none)
    assert await winner.grow(winner.reserved + 10)  # 10 bytes past its reservation: that and a chunk more
    expected = await _held(redis, scope)
    loser = quota.budget(scope, "t", 500, hold_s=600, holder="loser")
    assert await _open(loser) is None
    assert await _held(redis, scope) == (CHUNK_BYTES + 500, CHUNK_BYTES + 500, CHUNK_BYTES + 500, b"loser")
    assert await winner.grow(winner.reserved + 10)  # the winner grows meanwhile: that stays
    assert await loser.undo_opening()
    size, tenant, total, holder = expected
    grown = CHUNK_BYTES + 10
    assert await _held(redis, scope) == (size + grown, tenant + grown, total + grown, holder)
    assert not await loser.undo_opening()  # once
    # The winner reserved after the loser (it replaced the loser's): the undo leaves it alone.
    scope = uuid.uuid4().hex
    loser = quota.budget(scope, "t", 500, hold_s=600, holder="loser")
    assert await _open(loser) is None
    winner = quota.budget(scope, "t", 2000, hold_s=600, holder="winner")
    assert await _open(winner) is None
    expected = await _held(redis, scope)
    assert expected[0] == CHUNK_BYTES + 2000 and expected[3] == b"winner"
    assert not await loser.undo_opening()
    assert await _held(redis, scope) == expected
    # Nobody else: nothing is left of it.
    before = await _held(redis, "none")
    scope = uuid.uuid4().hex
    alone = quota.budget(scope, "t", 500, hold_s=600, holder="alone")
    assert await _open(alone) is None
    assert await alone.undo_opening()
    assert await _held(redis, scope) == (0, before[1], before[2], None)
    assert not await redis.zscore(keys.JOURNAL_QUOTA.held, scope)


async def test_a_refused_first_reservation_changes_nothing(redis: RedisClient) -> None:
    """Its promotion may have been written in the same round trip: the stream is then
    abandoned (gateway/relay/serving.py) and the earlier attempt's reservation it would have
    replaced stays as it was (a refusal undoes nothing, so it must change nothing)."""
    quota = JournalQuota(redis, _settings())
    scope = uuid.uuid4().hex
    earlier = await quota.open(scope, "t", 0, hold_s=60)
    while await earlier.grow(earlier.reserved + 1):  # the tenant at its bound
        pass
    expected = await _held(redis, scope)
    budget = quota.budget(scope, "t", MIB, hold_s=600, holder="new")
    refusal = await _open(budget)
    assert refusal is not None and refusal.code == "journal_memory_exceeded"
    assert await _held(redis, scope) == expected
    assert not await budget.undo_opening()


async def test_reservations_expire_with_their_journals(redis: RedisClient) -> None:
    quota = JournalQuota(redis, _settings())
    for _ in range(MIB // CHUNK_BYTES):
        await quota.open(uuid.uuid4().hex, "t", 0, hold_s=0.2)
    with pytest.raises(RateLimited):
        await quota.open(uuid.uuid4().hex, "t", 0, hold_s=0.2)
    await asyncio.sleep(0.3)  # the journals they counted are gone by now: nothing to await
    await quota.open(uuid.uuid4().hex, "t", 0, hold_s=60)
    assert int(await redis.hget(keys.JOURNAL_QUOTA.tenants, "t")) == CHUNK_BYTES


async def test_the_quota_keys_expire_with_their_latest_reservation(redis: RedisClient) -> None:
    """Regression (nemesis invariant "no key without TTL"): the five ``sl:{journals}:*``
    keys lived forever, past every journal they counted."""
    quota = JournalQuota(redis, _settings())
    short = await quota.open(uuid.uuid4().hex, "t", 0, hold_s=30)
    await quota.open(uuid.uuid4().hex, "t", 0, hold_s=600)
    names = [keys.JOURNAL_QUOTA.held, keys.JOURNAL_QUOTA.size, keys.JOURNAL_QUOTA.owner,
             keys.JOURNAL_QUOTA.tenants, keys.JOURNAL_QUOTA.total]  # (holder: only while a stream begins)
    for name in names:
        assert 590_000 < await redis.pttl(name) <= 601_000, name  # the latest reservation's, not the first's
    await short.settle(1000, 60_000)  # a later write keeps the longest
    assert all([590_000 < await redis.pttl(name) <= 601_000 for name in names])


def test_a_request_whose_max_tokens_cannot_fit_is_refused() -> None:
    settings = GatewaySettings(journal_max_events=1000)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    assert journal_events(ChatCompletionRequest(**body, max_tokens=100, n=2), settings) == 2 * 102 + 2
    with pytest.raises(InvalidRequest) as refused:
        journal_events(ChatCompletionRequest(**body, max_tokens=600, n=2), settings)
    assert refused.value.param == "max_tokens" and "at most 497 tokens" in refused.value.message
    assert journal_events(ChatCompletionRequest(**body, n=2), settings) == 1000  # capped, in-band past it
