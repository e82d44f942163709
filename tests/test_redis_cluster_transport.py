"""A Cluster connection closed underneath a command (what redis-py's cluster client does to
a node's connections while it re-learns the topology after a failover) fails that command
as a ``ConnectionError``, never as the ``AttributeError``/``RuntimeError`` of the closed
stream, which the gateway's ``except (RedisError, OSError)`` would let through as a 500.
Run on uvloop, the loop the gateway runs on (its closed transports raise ``RuntimeError``)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any
import time

import pytest
import redis
import uvloop
from redis.asyncio.cluster import RedisCluster

from sluice.embedded_failover import ReplicatedCluster
from sluice import redis_pool
from sluice.redis_pool import BoundedRedisCluster, create_pool

INCR = "return redis.call('INCR', KEYS[1])"


def test_cluster_connection_closed_underneath_a_command_is_a_connection_error(redis_cluster_url: str) -> None:
    _run_bounded(_closed_underneath(redis_cluster_url))


async def _closed_underneath(redis_cluster_url: str) -> None:
    client = await create_pool(redis_cluster_url)
    assert isinstance(client, RedisCluster)
    key = "sl:{closed}:n"
    try:
        await client.set(key, "1")
        node = client.get_node_from_key(key)
        assert node is not None
        connection = node.acquire_connection()
        node.release(connection)  # the idle connection the next command on this node takes
        assert connection.is_connected
        connection._writer.transport.close()  # closed by another task; redis-py has not noticed
        await asyncio.sleep(0)
        # The closed connection fails as a lost one: the client reconnects and serves it.
        assert await client.get(key) == b"1"
    finally:
        await client.aclose()


def test_a_cluster_command_past_its_deadline_fails_and_the_client_serves_on(
    redis_cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Cluster command is bounded as a whole (``CLUSTER_COMMAND_DEADLINE_S``), not only
    its socket reads: a command to a killed master once never returned, retried across nodes
    and topology refreshes. A command held past the deadline (here a blocking read, with the
    deadline shortened) is a ``redis.TimeoutError``, and the client serves the next one."""
    monkeypatch.setattr(redis_pool, "CLUSTER_COMMAND_DEADLINE_S", 0.3)
    _run_bounded(_past_deadline(redis_cluster_url))


async def _past_deadline(redis_cluster_url: str) -> None:
    client = await create_pool(redis_cluster_url)
    key = "sl:{deadline}:s"
    try:
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError, match="did not answer"):
            await client.xread({key: "$"}, block=3000)
        assert time.monotonic() - started < 2.5  # the deadline, not the 3 s block (slack for a loaded machine)
        pipe = client.pipeline()
        pipe.xread({key: "$"}, block=3000)
        with pytest.raises(redis.TimeoutError, match="did not answer"):
            await pipe.execute()
        await client.set(key + "x", "1")
        assert await client.get(key + "x") == b"1"
    finally:
        await client.delete(key + "x")
        await client.aclose()


@pytest.mark.parametrize("server", ["redis_url", "redis_sentinel_url"])
def test_a_connection_closed_before_its_next_command_is_a_connection_error(
    server: str, request: pytest.FixtureRequest
) -> None:
    """Regression (nemesis, full single-server run: one 500): a server that restarted
    closed a pooled connection; the next command's health check wrote to the closed
    transport and uvloop's ``RuntimeError`` went up through ``authenticate`` as "internal
    error in the gateway". One server and Sentinel now fail it as a lost connection,
    which redis-py reconnects."""
    _run_bounded(_closed_before_use(request.getfixturevalue(server)))


async def _closed_before_use(url: str) -> None:
    client = await create_pool(url, max_connections=1)  # one connection: the next command takes it
    assert not isinstance(client, RedisCluster)
    key = "sl:closed-before-use"
    try:
        await client.set(key, "1")
        connection = await client.connection_pool.get_connection()
        await client.connection_pool.release(connection)
        assert connection.is_connected
        connection._writer.transport.close()  # the server went away; redis-py has not noticed
        await asyncio.sleep(0)
        try:  # the gateway answers a lost connection 503 + Retry-After (was: 500)
            assert await client.get(key) == b"1"
        except redis.ConnectionError:
            pass
        assert await client.get(key) == b"1"  # and the next command reconnects
    finally:
        await client.delete(key)
        await client.aclose()


def test_cluster_master_killed_under_concurrent_scripts_raises_only_connection_errors(
    replicated_cluster: ReplicatedCluster,
) -> None:
    _run_bounded(_master_killed_under_load(replicated_cluster))


def _run_bounded(main: Coroutine[Any, Any, None], limit_s: float = 100) -> None:
    """Run ``main`` on a uvloop of its own thread and wait at most ``limit_s`` for it; the
    test's assertions are ``main``'s. In full suite runs (2026-12-02, and CI of 2026-12-03)
    this test hung for good after its work was done: closing a connection to the killed
    master that redis-py's cluster client left behind never returned, and the suite's
    timeout, a signal, never fired while uvloop ran (it swallows what the handler raises).
    A thread that never ends is left behind; the test fails on time or passes on ``main``'s
    outcome, whatever the loop's teardown does after."""
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def run() -> None:
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(main)
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)
        finally:
            done.set()
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.wait(leftover, timeout=5))
        loop.close()

    threading.Thread(target=run, daemon=True, name="cluster-kill").start()
    assert done.wait(limit_s), f"the scenario did not end within {limit_s} s"
    if outcome[0] is not None:
        raise outcome[0]


async def _master_killed_under_load(replicated_cluster: ReplicatedCluster) -> None:
    client = await create_pool(replicated_cluster.url, max_connections=16)
    incr = client.register_script(INCR)
    names = [f"sl:{{kill{n}}}:n" for n in range(12)]  # spread over every master
    foreign: list[BaseException] = []
    killed = asyncio.Event()
    served_after = {name: 0 for name in names}

    async def hammer(name: str) -> None:
        deadline = time.monotonic() + 30
        while served_after[name] < 20 and time.monotonic() < deadline:
            try:
                await incr(keys=[name])
                if killed.is_set():
                    served_after[name] += 1
            except redis.RedisError:
                await asyncio.sleep(0.01)
            except Exception as exc:  # what the gateway cannot tell from a bug
                foreign.append(exc)

    try:
        for name in names:
            await incr(keys=[name])
        with redis.Redis(port=replicated_cluster.master_ports()[0]) as direct:
            direct.wait(1, 2000)
        workers = [asyncio.create_task(hammer(name)) for name in names for _ in range(4)]
        await asyncio.sleep(0.3)
        old = replicated_cluster.kill_master(0)
        killed.set()
        await asyncio.gather(*workers)
        replicated_cluster.wait_promoted(old)
        assert foreign == []
        assert all(count >= 20 for count in served_after.values())  # every slot served again
    finally:  # bounded: see _run_bounded
        await asyncio.wait({asyncio.ensure_future(client.aclose())}, timeout=5)


def test_a_cluster_no_node_of_which_answers_is_a_connection_error() -> None:
    """redis-py reports a cluster none of whose nodes answers as ``RedisClusterException``,
    which is no ``RedisError``: the gateway's loops that live through outages caught only
    ``RedisError``/``OSError`` and died of it (the nemesis, Cluster: every node stalled at
    once). Commands and pipelines raise ``redis.ConnectionError`` instead."""
    async def main() -> None:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        client = BoundedRedisCluster.from_url(f"redis://127.0.0.1:{port}", socket_connect_timeout=0.5)
        try:
            with pytest.raises(redis.ConnectionError, match="cannot be connected"):
                await client.get("k")
            pipe = client.pipeline(transaction=False)
            pipe.get("k")
            with pytest.raises(redis.ConnectionError, match="cannot be connected"):
                await pipe.execute()
        finally:
            await client.aclose()

    _run_bounded(main())
