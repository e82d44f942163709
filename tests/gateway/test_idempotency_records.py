"""Idempotency-Key records and who may change them, on a real Redis (one server and a
Cluster), without HTTP: only the key's current owner settles it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from gateway.loss_watch import LossWatch
from gateway.streams import idempotency
from gateway.streams.idempotency import Idempotency
from gateway.streams.journal import LIVE_TTL_MS
from sluice import keys
from sluice.embedded_redis import EmbeddedCluster
from sluice.errors import DeadlineExceeded, Unavailable
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
    assert await records.take_stream(key, "b") == "held", "a lives: no take-over"
    await redis.delete(keys.journal_live(key))  # a stalled past :live's TTL
    assert await records.take_stream(key, "b") == "taken"
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


class HeldWatch:
    """A process's loss watch whose write-backs after a loss do not return (a degraded Cluster
    held nem-4256's gateway's journal keeper 34 s): it sees the first loss, then no later one."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self.watch = LossWatch(redis, check_s=0.05)
        self.released = asyncio.Event()
        self.watch.listen(self._writing_back)

    async def _writing_back(self, lost: bool) -> bool:
        if lost:
            await self.released.wait()
        return True

    async def lose(self) -> str:
        """Redis loses its data (a new registry epoch); returns the new epoch's id."""
        epoch = uuid.uuid4().hex
        await self.redis.hset(keys.EPOCH, mapping={"id": epoch, "at": int(time.time() * 1000)})
        return epoch

    async def seen(self, epoch: str) -> None:
        while self.watch.seen_epoch != epoch:
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> HeldWatch:
        first = await self.lose()
        self.watch.start()
        await self.seen(first)
        await self.seen(await self.lose())  # seen, and writing back from now on
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        await self.watch.close()


def _records(redis: RedisClient, watch: LossWatch) -> Idempotency:
    return Idempotency(redis, ttl_s=60, unsure=watch.unsure_s, watch=watch)


async def _answer(claim: Coroutine[Any, Any, Any], within_s: float) -> Any:
    """The claim's answer (or its error), which must come within ``within_s``: a claim that
    has none by then leaves its client with no byte."""
    task = asyncio.ensure_future(claim)
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        task.cancel()
        pytest.fail(f"the claim had no answer within {within_s} s")
    return task.result()


async def test_a_fresh_claim_while_the_watch_is_held_up_runs_once_the_new_loss_was_waited_for(
    idem, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (nemesis, Cluster: nem-3307, nem-4256, no byte for 35 s): a gateway's loss
    watch, held up writing back after a loss, did not look at Redis again while Redis lost
    more; every claim's look (``confirm``) then found a loss its watch had not seen, let go of
    the key and took it again at once, without end and past its deadline. A loss seen is now
    waited for once; then the claim runs."""
    _, redis = idem
    monkeypatch.setattr(idempotency, "UNSURE_MAX_S", 0.3)
    async with HeldWatch(redis) as held:
        await held.lose()  # unseen by the held watch
        records = _records(redis, held.watch)
        key = uuid.uuid4().hex
        assert await _answer(records.claim(key, "fp", True, time.monotonic() + 8, owner="retry"), 3) is None
        assert await redis.get(keys.journal_live(key)) == b"retry"
        await records.close()


async def test_a_claim_that_finds_a_new_loss_at_every_look_is_told_503_within_claim_max_s(
    idem, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While Redis keeps losing data (FLUSHALLs and failovers one after another), a key
    without a record waits for write-backs each time: its client hears 503 + Retry-After
    within ``CLAIM_MAX_S``, not silence until its deadline."""
    _, redis = idem
    monkeypatch.setattr(idempotency, "UNSURE_MAX_S", 0.3)
    monkeypatch.setattr(idempotency, "CLAIM_MAX_S", 1.5)
    async with HeldWatch(redis) as held:
        async def losing() -> None:
            while True:
                await held.lose()
                await asyncio.sleep(0.1)

        loser = asyncio.create_task(losing())
        records = _records(redis, held.watch)
        started = time.monotonic()
        try:
            with pytest.raises(Unavailable) as refused:
                await _answer(records.claim(uuid.uuid4().hex, "fp", True, time.monotonic() + 30, owner="retry"), 3)
        finally:
            loser.cancel()
            await records.close()
        assert 1.5 <= time.monotonic() - started < 3
        assert refused.value.headers() == {"Retry-After": "1"}


async def test_a_retry_of_a_key_still_pending_is_told_503_within_claim_max_s(
    idem, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry whose first attempt still holds the key (queued, or its claim stuck on Redis)
    waited up to its whole deadline with no byte sent (60 s in the nemesis, whose client gives
    up after 35 s): it is told to come again at ``CLAIM_MAX_S``."""
    records, _ = idem
    monkeypatch.setattr(idempotency, "CLAIM_MAX_S", 1.0)
    key = uuid.uuid4().hex
    assert await records.claim(key, "fp", True, _deadline(), owner="first") is None  # renewed meanwhile
    started = time.monotonic()
    with pytest.raises(Unavailable, match="still running"):
        await _answer(records.claim(key, "fp", True, time.monotonic() + 60, owner="retry"), 2)
    assert time.monotonic() - started >= 1.0


async def test_a_retry_whose_last_round_is_slow_is_still_told_its_key_is_running(
    idem, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round that found the key pending, then one whose answer came past the claim's
    bound (a loaded machine: 50 ms late was enough in CI), is told what the key was found
    doing, not "waiting for Redis"."""
    records, _ = idem
    monkeypatch.setattr(idempotency, "CLAIM_MAX_S", 1.0)
    key = uuid.uuid4().hex
    assert await records.claim(key, "fp", True, _deadline(), owner="first") is None
    script = records._claim
    started = time.monotonic()

    async def slow_near_the_end(**kwargs: Any) -> Any:
        if time.monotonic() - started > 0.8:
            await asyncio.sleep(1.0)  # cut by the claim's bound at 1.05 s
        return await script(**kwargs)

    monkeypatch.setattr(records, "_claim", slow_near_the_end)
    with pytest.raises(Unavailable, match="still running"):
        await _answer(records.claim(key, "fp", True, time.monotonic() + 60, owner="retry"), 2)
    assert 1.0 <= time.monotonic() - started < 3.0  # (the bug waited 20 s)


async def test_a_claim_on_a_stalled_cluster_node_is_told_503_within_claim_max_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Cluster command to a stalled node (SIGSTOP: connected, silent) returns only at the
    command deadline (12 s), and a claim's rounds add such waits up: the claim is cut at
    ``CLAIM_MAX_S`` whatever command it waits on, and its client told to come again."""
    monkeypatch.setattr(idempotency, "CLAIM_MAX_S", 1.0)
    with EmbeddedCluster() as cluster:
        redis = await create_pool(cluster.url)
        records = Idempotency(redis, ttl_s=60)
        key = uuid.uuid4().hex
        node = redis.get_node_from_key(keys.idempotency(key))
        stalled = next(server for server in cluster.servers if server.port == node.port)
        await redis.set(keys.journal_live(key) + ":warm", "1", px=60_000)  # a connection to that node
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable, match="waiting for Redis"):
                await _answer(records.claim(key, "fp", True, time.monotonic() + 60, owner="retry"), 2)
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        assert await redis.get(keys.journal_live(key) + ":warm") is not None  # the client serves on
        await records.close()
        await redis.aclose()
