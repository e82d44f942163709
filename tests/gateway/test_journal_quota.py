"""Journal memory reservations on a real Redis and a Redis Cluster, without HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.config import GatewaySettings
from gateway.streams.journal_quota import CHUNK_BYTES, JournalQuota, journal_events
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
             keys.JOURNAL_QUOTA.tenants, keys.JOURNAL_QUOTA.total]
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
