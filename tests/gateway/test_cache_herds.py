"""The caches in front of Redis that every request consults (whether API keys exist, the
fleet's prefill/decode roles, adapters): when an entry goes stale, the requests that find it
so share one read of Redis instead of each making its own. Counted by Redis itself
(``INFO commandstats``), on a private server nothing else talks to."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.admission.adapters import AdapterDirectory
from gateway.admission.tenancy import Tenancy
from gateway.config import GatewaySettings
from gateway.relay.disagg import FleetRoles
from sluice.embedded_redis import EmbeddedRedis

ASKS = 50


@pytest.fixture(scope="module")
def private_url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
async def client(private_url: str) -> AsyncIterator[Redis]:
    redis = Redis.from_url(private_url)
    await redis.config_resetstat()
    try:
        yield redis
    finally:
        await redis.aclose()


async def _calls(redis: Redis, command: str) -> int:
    return int((await redis.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_stale_keys_check_is_one_look_for_a_burst_of_requests(client: Redis, private_url: str) -> None:
    """Regression: each request that found an ``auto`` gateway's "do API keys exist?" answer
    stale asked Redis itself until the first answer came back: at 64 streams a herd of dozens
    of redis-py calls every two seconds, and new pool connections for them."""
    tenancy = Tenancy(client, GatewaySettings(redis_url=private_url, auth="auto"))
    assert await asyncio.gather(*(tenancy.authenticate(None) for _ in range(ASKS))) == [None] * ASKS
    assert await _calls(client, "exists") == 1  # no keys here: the gateway stays open
    assert await tenancy.authenticate(None) is None
    assert await _calls(client, "exists") == 1  # fresh for two seconds


async def test_stale_fleet_roles_are_one_read_for_a_burst_of_requests(client: Redis) -> None:
    """Regression: the same herd on the fleet's roles (read for every request, cached for a
    second): 0.4 registry reads (HGETALL + parsing every worker's record) per one-token request."""
    roles = FleetRoles(client)
    assert await asyncio.gather(*(roles.disaggregated("m") for _ in range(ASKS))) == [False] * ASKS
    assert await _calls(client, "hgetall") == 1
    assert await roles.disaggregated("m", fresh=True) is False  # fresh: read now, not shared
    assert await _calls(client, "hgetall") == 2


async def test_a_stale_adapter_entry_is_one_read_for_a_burst_of_requests(client: Redis) -> None:
    """Regression: the same herd on adapter names (every request's model is looked up)."""
    adapters = AdapterDirectory(client)
    assert await asyncio.gather(*(adapters.parent("m") for _ in range(ASKS))) == [None] * ASKS
    assert await _calls(client, "hget") == 1
