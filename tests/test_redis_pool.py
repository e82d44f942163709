"""create_pool on a real redis-server, a real three-master cluster and a Sentinel-managed master:
routing, scripts, the bound."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError, RedisClusterException

from sluice.redis_pool import (
    BoundedRedisCluster,
    RedisClient,
    connections_by_name,
    create_pool,
)

#: Two keys of one model: they share the hash tag, so one slot and one node.
PAIR = """
redis.call('SET', KEYS[1], ARGV[1])
return {redis.call('GET', KEYS[1]), redis.call('INCR', KEYS[2])}
"""

BOUND = 4


def _pair(model: str) -> tuple[str, str]:
    return f"sl:{{{model}}}:a", f"sl:{{{model}}}:b"


async def _load(client: RedisClient) -> list[object]:
    """200 commands at once over 20 models: scripts, pipelines, plain and blocking commands."""
    run = uuid.uuid4().hex[:8]
    script = client.register_script(PAIR)

    async def one(i: int) -> object:
        model = f"load-{run}-m{i % 20}"
        a, b = _pair(model)
        match i % 10:
            case 0:
                return await client.blpop([f"sl:{{{model}}}:empty"], timeout=0.2)
            case 1:
                return await client.xread({f"sl:{{{model}}}:stream": "$"}, block=200)
            case 2:
                pipe = client.pipeline(transaction=False)
                pipe.incr(a)
                pipe.incr(b)
                return await pipe.execute()
            case 3 | 4:
                return await script(keys=[a, b], args=[i])
            case _:
                return await client.incr(b)

    return await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)


async def _load_watching(client: RedisClient, url: str, name: str) -> tuple[list[object], int]:
    """The load's results and the most connections ``name`` held on one server meanwhile."""
    observer = await create_pool(url, client_name="observer")
    samples: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            samples.append((await connections_by_name(observer)).get(name, 0))

    try:
        watcher = asyncio.create_task(watch())
        results = await _load(client)
        done.set()
        await watcher
        # Pools keep what they opened, so this last count is the high-water mark too.
        samples.append((await connections_by_name(observer)).get(name, 0))
    finally:
        await observer.aclose()
    return results, max(samples)


@pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url", "redis_sentinel_url"])
async def test_concurrent_commands_wait_for_one_of_max_connections(
    server: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(server)
    name = f"bounded-{uuid.uuid4().hex[:8]}"
    client = await create_pool(url, max_connections=BOUND, client_name=name)
    try:
        results, peak = await _load_watching(client, url, name)
    finally:
        await client.aclose()
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert results[0] is None and results[1] == []  # BLPOP and XREAD BLOCK timed out empty
    assert 1 <= peak <= BOUND


async def test_default_single_server_client_opens_many_connections_then_fails(
    redis_url: str,
) -> None:
    """Why create_pool uses a BlockingConnectionPool: redis-py's default pool opens a
    connection per concurrent command up to 100, then raises instead of waiting."""
    name = f"default-{uuid.uuid4().hex[:8]}"
    client = Redis.from_url(redis_url, client_name=name)
    try:
        results, peak = await _load_watching(client, redis_url, name)
    finally:
        await client.aclose()
    assert peak > BOUND
    assert any(isinstance(r, MaxConnectionsError) for r in results)


async def test_plain_cluster_client_fails_instead_of_waiting(redis_cluster_url: str) -> None:
    """Why create_pool wraps RedisCluster: its exhausted node pools raise MaxConnectionsError."""
    client = RedisCluster.from_url(
        redis_cluster_url.replace("redis+cluster://", "redis://"), max_connections=BOUND
    )
    try:
        results = await _load(client)
    finally:
        await client.aclose()
    assert any(isinstance(r, MaxConnectionsError) for r in results)


async def test_script_runs_on_the_node_owning_its_hash_tag(redis_cluster_url: str) -> None:
    client = await create_pool(redis_cluster_url)
    try:
        assert isinstance(client, BoundedRedisCluster)
        script = client.register_script(PAIR)
        owner: dict[str, str] = {}
        for i in range(20):
            model = f"route-m{i}"
            a, b = _pair(model)
            assert await script(keys=[a, b], args=[i]) == [str(i).encode(), 1]
            slot = await client.cluster_keyslot(a)
            assert slot == await client.cluster_keyslot(b) == client.keyslot(a)
            owner[model] = client.nodes_manager.get_node_from_slot(slot).name
        primaries = client.get_primaries()
        assert set(owner.values()) == {node.name for node in primaries}
        for node in primaries:
            direct = Redis(host=node.host, port=int(node.port), decode_responses=True)
            try:
                stored = set(map(str, await direct.keys("sl:{route-m*")))
            finally:
                await direct.aclose()
            assert stored == {key for m, n in owner.items() if n == node.name for key in _pair(m)}
        with pytest.raises(RedisClusterException, match="same key slot"):
            await script(keys=["sl:{route-m0}:a", "sl:{route-m1}:a"], args=[0])
    finally:
        await client.aclose()


async def test_plain_url_is_one_server_on_a_blocking_pool(redis_url: str) -> None:
    client = await create_pool(redis_url, max_connections=7, client_name="plain-url")
    try:
        assert type(client) is Redis
        assert isinstance(client.connection_pool, BlockingConnectionPool)
        assert client.connection_pool.max_connections == 7
        assert (await connections_by_name(client))["plain-url"] == 1
    finally:
        await client.aclose()
