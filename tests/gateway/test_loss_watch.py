"""The process's one watcher for lost Redis writes (gateway/loss_watch.py): every keeper
hears of a loss once; a keeper whose write-back failed hears of it again at the next look,
the others not."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from gateway.loss_watch import LossWatch, warn_if_evicting
from sluice import keys
from sluice.directory import Directory
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis
from sluice.redis_pool import create_pool


async def until(check: Callable[[], bool], within_s: float = 5.0, what: str = "") -> None:
    """Wait for ``check()`` (polled): a loaded machine may take several of the watch's looks
    for what an idle one does in one (fixed sleeps of 0.2-0.4 s left 0.1-0.2 s of margin)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_loss_reaches_every_listener_and_a_failed_write_back_is_tried_again() -> None:
    with EmbeddedRedis() as server:
        client = await create_pool(server.url)
        watch = LossWatch(client, check_s=0.05)
        heard: dict[str, list[bool]] = {"steady": [], "flaky": []}
        failures = [RedisConnectionError("a node back but not serving yet")]

        async def steady(lost: bool) -> bool:
            heard["steady"].append(lost)
            return True

        async def flaky(lost: bool) -> bool:
            heard["flaky"].append(lost)
            if lost and failures:
                raise failures.pop()
            return True

        watch.listen(steady)
        watch.listen(flaky)
        try:
            await client.hset(keys.EPOCH, "id", "epoch-1")
            watch.start()
            await until(lambda: watch.seen_epoch == "epoch-1", what="the first look")
            await asyncio.sleep(0.2)  # more looks
            assert not any(heard["steady"]) and not any(heard["flaky"])  # the first look is no loss
            assert watch.since_loss_s() == math.inf and watch.unsure_s() == 0
            assert watch.seen_epoch == "epoch-1"
            for calls in heard.values():
                calls.clear()
            await client.hset(keys.EPOCH, "id", "epoch-2")  # Redis lost its data; a new registry
            await until(lambda: heard["flaky"].count(True) >= 2, what="the flaky listener told twice")
            await asyncio.sleep(0.2)  # more looks: nobody is told again
            assert heard["steady"].count(True) == 1  # told once
            assert heard["flaky"].count(True) == 2  # told again after its write-back failed
            # A look already under way when the calls were cleared may still report the old
            # epoch (a CI run on a loaded machine heard [False, True, True]): from the loss on,
            # the failed write-back is told again at the next look.
            told = heard["flaky"][heard["flaky"].index(True):]
            assert told[:2] == [True, True]
            assert watch.since_loss_s() < 5 and watch.unsure_s() > 0
        finally:
            await watch.close()
            await client.aclose()


async def test_an_epoch_without_its_time_counts_from_now_rather_than_failing_every_beat() -> None:
    """A registry epoch holding its id alone (written by hand, or half restored) made the epoch
    script fail on every worker's beat ("arithmetic on a nil value"): no worker registered
    again until someone deleted the key."""
    with EmbeddedRedis() as server:
        client = await create_pool(server.url)
        try:
            await client.hset(keys.EPOCH, "id", "by-hand")
            epoch = await Directory(client).register("m", None)
            assert epoch.id == "by-hand" and 0 <= epoch.age_s < 1
            assert await client.hget(keys.EPOCH, "at") is not None
        finally:
            await client.aclose()


async def test_the_watch_stays_unsure_until_its_write_backs_succeed_and_a_window_after(monkeypatch) -> None:
    """The nemesis, Cluster: a node back but the cluster not serving yet failed every
    write-back for seconds; the restore window, counted from the look that saw the loss, ran
    out first, and two gateways answered 401 for a valid key that the one gateway keeping it
    wrote back a moment later. Now the window counts from the last write-back, and a slow
    listener (hundreds of journals) does not hold back the others (the API keys)."""
    monkeypatch.setattr(keys, "API_KEYS_RESTORE_S", 1.0)
    with EmbeddedRedis() as server:
        client = await create_pool(server.url)
        watch = LossWatch(client, check_s=0.05)
        cluster_down = True
        heard: dict[str, float] = {}

        async def journals(lost: bool) -> bool:
            if lost:
                heard.setdefault("journals", asyncio.get_running_loop().time())
                await asyncio.sleep(0.5)
            return True

        async def api_keys(lost: bool) -> bool:
            if lost:
                heard.setdefault("keys", asyncio.get_running_loop().time())
                if cluster_down:
                    raise RedisConnectionError("The cluster is down")
                heard["keys_written"] = asyncio.get_running_loop().time()
            return True

        watch.listen(journals)
        watch.listen(api_keys)
        try:
            await client.hset(keys.EPOCH, "id", "epoch-1")
            watch.start()
            await until(lambda: watch.seen_epoch == "epoch-1", what="the first look")
            await client.hset(keys.EPOCH, "id", "epoch-2")  # Redis lost its data
            await until(lambda: "keys" in heard, what="the loss seen")
            await asyncio.sleep(1.6)  # past a restore window counted from the look that saw the loss
            assert heard["keys"] - heard["journals"] < 0.1  # side by side, not behind the journals
            assert watch.unsure_s() > 0  # the key write-back still fails: still unsure
            cluster_down = False
            while "keys_written" not in heard:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert watch.unsure_s() > 0  # a window after the write-back, for the other processes'
            await until(lambda: watch.unsure_s() == 0, what="sure again a window after the write-back")
        finally:
            await watch.close()
            await client.aclose()


async def test_a_write_back_failing_for_good_keeps_the_watch_unsure_for_a_bounded_time(monkeypatch) -> None:
    """A listener whose write-back never succeeds (not a loss on its way back any more) must
    not leave unknown keys and models at 503 for good: the watch is unsure for
    REGISTRY_REBUILD_S at most, then the restore window runs out as after any loss."""
    monkeypatch.setattr(keys, "API_KEYS_RESTORE_S", 0.5)
    monkeypatch.setattr(keys, "REGISTRY_REBUILD_S", 2.0)
    with EmbeddedRedis() as server:
        client = await create_pool(server.url)
        watch = LossWatch(client, check_s=0.05)

        async def broken(lost: bool) -> bool:
            if lost:
                raise RedisConnectionError("fails for good")
            return True

        watch.listen(broken)
        try:
            await client.hset(keys.EPOCH, "id", "epoch-1")
            watch.start()
            await until(lambda: watch.seen_epoch == "epoch-1", what="the first look")
            await client.hset(keys.EPOCH, "id", "epoch-2")
            await until(lambda: watch.since_loss_s() < math.inf, what="the loss seen")
            await asyncio.sleep(1.0)
            assert watch.unsure_s() > 0  # past the restore window: its write-back is still owed
            # owed for longer than REGISTRY_REBUILD_S: no longer unsure
            await until(lambda: watch.unsure_s() == 0, within_s=8, what="no longer unsure")
        finally:
            await watch.close()
            await client.aclose()


async def test_a_redis_that_may_evict_is_named_at_start(caplog) -> None:
    """Any policy but ``noeviction`` drops Sluice's live state unseen by the watch: said once,
    at start; ``noeviction`` (the embedded Redis's) says nothing."""
    with EmbeddedRedis() as server:
        client = await create_pool(server.url)
        try:
            with caplog.at_level("WARNING", logger="sluice.loss"):
                await warn_if_evicting(client)
                assert not caplog.records, [r.getMessage() for r in caplog.records]
                await client.config_set("maxmemory-policy", "allkeys-lru")
                await warn_if_evicting(client)
            assert [r.getMessage() for r in caplog.records] == [
                "Redis's maxmemory-policy is allkeys-lru: under memory pressure it evicts Sluice's leases, queues "
                "and resumable streams unseen; set maxmemory-policy noeviction"]
        finally:
            await client.aclose()


async def test_a_cluster_is_asked_its_eviction_policy_too(redis_cluster_url: str, caplog) -> None:
    client = await create_pool(redis_cluster_url)
    try:
        with caplog.at_level("DEBUG", logger="sluice.loss"):
            await warn_if_evicting(client)
        assert not caplog.records, [r.getMessage() for r in caplog.records]  # read, and noeviction
    finally:
        await client.aclose()


async def test_a_full_confirm_sees_a_cluster_node_that_restarted_empty() -> None:
    """Regression (review, 2026-12-07): on a Cluster :meth:`LossWatch.confirm` reads the epoch
    alone, so a node that restarted empty (the epoch on another) went unseen until the next
    regular look; a re-attach told "nothing lost for 10 s, so nobody writes your stream
    back" acted on that. ``confirm(full=True)`` asks every master which process it is."""
    with EmbeddedCluster() as cluster:
        client = await create_pool(cluster.url)
        watch = LossWatch(client, check_s=3600)  # one regular look, at start
        try:
            await client.hset(keys.EPOCH, "id", "epoch-1")
            watch.start()
            await until(lambda: watch.seen_epoch == "epoch-1", what="the first look")
            epoch_port = client.get_node_from_key(keys.EPOCH).port
            node = next(server for server in cluster.servers if server.port != epoch_port)
            node.shutdown(save=False)
            node.start()  # back empty, with its slots (nodes.conf)
            assert await watch.confirm(), "the epoch alone told the loss: the test shows nothing"
            for _ in range(100):  # the client reconnects to the node that came back
                try:
                    confirmed = await watch.confirm(full=True)
                    break
                except (RedisError, OSError):
                    await asyncio.sleep(0.1)
            assert confirmed is False, "a node that restarted empty went unseen"
            assert watch.since_loss_s() < 5
        finally:
            await watch.close()
            await client.aclose()
