"""Cache routing in the admission scripts, on a real Redis (single server and a
three-master cluster): affinity when load allows, the hot-spot guard, a cold worker's
share, queued grants that keep affinity, round robin, and the index's corrections."""

from __future__ import annotations

import asyncio

from gateway.admission.routing import PromptPrefix, RouteCheck
from sluice import keys
from sluice.prefix import BLOCK_TOKENS, block_hashes
from sluice.prefix_index import PrefixIndex
from tests.gateway import test_queue_scripts as queue_tests
from tests.gateway.test_queue_scripts import Fleet, _queued

# The queue tests' fixtures: a fleet on a single Redis and on a Redis Cluster.
url, redis, fleet = queue_tests.url, queue_tests.redis, queue_tests.fleet

SHARED = " ".join(f"sys{i}" for i in range(BLOCK_TOKENS * 20))  # 20 blocks


def _blocks(question: str) -> tuple[str, ...]:
    return tuple(block_hashes(SHARED + " " + " ".join(f"{question}{i}" for i in range(2 * BLOCK_TOKENS))))


async def test_a_shared_prefix_goes_back_to_the_worker_that_holds_it(fleet: Fleet) -> None:
    a, b = await fleet.worker(capacity=8, worker_id="a"), await fleet.worker(capacity=8, worker_id="b")
    gw = await fleet.gateway(routing="cache")
    (first,) = await gw.acquire(fleet.ask(blocks=_blocks("q")))
    assert first.matched_blocks == 0
    await gw.release(first)
    # The second request runs on the holder as the third arrives: the 20 cached blocks
    # still outweigh that load (and its 2 blocks of prefill).
    for question in ("r", "s"):
        (lease,) = await gw.acquire(fleet.ask(blocks=_blocks(question)))
        assert lease.worker_id == first.worker_id
        assert lease.matched_blocks == 20  # the shared blocks, not the other question's
    (other,) = await gw.acquire(fleet.ask(blocks=tuple(block_hashes("z " * 2 * BLOCK_TOKENS))))
    assert other.worker_id == ({a, b} - {first.worker_id}).pop()  # no affinity: least loaded


async def test_hot_spot_guard_spills_a_popular_prefix_to_a_cold_worker(fleet: Fleet) -> None:
    """Regression for the peers' hot spot: one shared system prompt sent everything to
    one worker. Past the guard (half its slots busier than the coolest worker), the
    holder's cache no longer counts and the cold worker gets its share."""
    await fleet.worker(capacity=4, worker_id="a")
    await fleet.worker(capacity=4, worker_id="b")
    gw = await fleet.gateway(routing="cache", route_hot_share=0.5)
    (warm,) = await gw.acquire(fleet.ask(blocks=_blocks("w")))
    await gw.release(warm)
    leases = [(await gw.acquire(fleet.ask(blocks=_blocks(f"q{i}"))))[0] for i in range(4)]
    holder = warm.worker_id
    assert [x.worker_id == holder for x in leases] == [True, True, True, False]
    assert leases[3].matched_blocks == 0
    # The cold worker now holds the prefix too: both are credited from here on.
    matched = await fleet.redis.hget(keys.prefix_index(fleet.model)[0], _blocks("x")[0])  # type: ignore[attr-defined]
    assert set(matched.decode().split()) == {"a", "b"}


async def test_without_affinity_routing_is_least_loaded(fleet: Fleet) -> None:
    await fleet.worker(capacity=4, worker_id="a")
    await fleet.worker(capacity=4, worker_id="b")
    gw = await fleet.gateway(routing="cache")
    workers = [(await gw.acquire(fleet.ask(blocks=tuple(block_hashes(f"{i} " * 2 * BLOCK_TOKENS)))))[0].worker_id
               for i in range(6)]
    assert sorted(workers) == ["a", "a", "a", "b", "b", "b"]


async def test_cache_routing_fills_workers_by_share_not_by_count(fleet: Fleet) -> None:
    """Regression: load was counted in requests, so with no shared prefix a cap-8 worker
    was filled to 100% while a cap-64 worker sat at 12%. Load is now each worker's share
    of its slots: 36 short prompts (no block to share) leave both at the same share."""
    await fleet.worker(capacity=8, worker_id="small")
    await fleet.worker(capacity=64, worker_id="big")
    gw = await fleet.gateway(routing="cache")
    leases = [(await gw.acquire(fleet.ask()))[0] for _ in range(36)]
    small = sum(x.worker_id == "small" for x in leases)
    assert (small, 36 - small) == (4, 32), f"{small} of 8 slots on the small worker"
    for lease in leases:
        await gw.release(lease)


async def test_a_queued_request_keeps_its_affinity_when_granted_by_a_release(fleet: Fleet) -> None:
    await fleet.worker(capacity=1, worker_id="a")
    await fleet.worker(capacity=1, worker_id="b")
    gw = await fleet.gateway(routing="cache", queue_timeout_s=10)
    (warm,) = await gw.acquire(fleet.ask(blocks=_blocks("q")))
    await gw.release(warm)
    held = [(await gw.acquire(fleet.ask()))[0] for _ in range(2)]
    waiter = asyncio.create_task(gw.acquire(fleet.ask(blocks=_blocks("r"))))
    await _queued(fleet, 1)
    holder_lease = next(x for x in held if x.worker_id == warm.worker_id)
    await gw.release(holder_lease)
    (granted,) = await asyncio.wait_for(waiter, 5)
    assert granted.worker_id == warm.worker_id and granted.matched_blocks == 20
    for lease in [granted, *held]:
        await gw.release(lease)


async def test_round_robin_takes_turns(fleet: Fleet) -> None:
    for name in "abc":
        await fleet.worker(capacity=8, worker_id=name)
    gw = await fleet.gateway(routing="rr")
    workers = [(await gw.acquire(fleet.ask(blocks=_blocks("q"))))[0].worker_id for _ in range(6)]
    assert sorted(workers[:3]) == ["a", "b", "c"] and workers[3:] == workers[:3]


async def test_engine_events_and_corrections_take_blocks_out_of_the_index(fleet: Fleet) -> None:
    await fleet.worker(capacity=8, worker_id="a")
    await fleet.worker(capacity=8, worker_id="b")
    gw = await fleet.gateway(routing="cache")
    index = PrefixIndex(fleet.redis)
    (first,) = await gw.acquire(fleet.ask(blocks=_blocks("q")))
    await gw.release(first)
    # The engine evicted the prefix's last 5 blocks: the next request matches 15.
    await index.report(fleet.model, first.worker_id,
                       [{"type": "removed", "block_hashes": list(_blocks("q")[15:20])}])
    (second,) = await gw.acquire(fleet.ask(blocks=_blocks("r")))
    assert second.worker_id == first.worker_id and second.matched_blocks == 15
    await gw.release(second)
    # A response reported fewer cached tokens than expected: the rest is corrected away.
    await index.correct(fleet.model, first.worker_id, list(_blocks("r")[5:]))
    (third,) = await gw.acquire(fleet.ask(blocks=_blocks("s")))
    assert third.matched_blocks == 5
    await gw.release(third)


def test_route_check_measures_the_routers_error() -> None:
    words = 6 * BLOCK_TOKENS + 16
    prefix = PromptPrefix(tuple(block_hashes("w " * words)), words)  # 6 full blocks
    exact = RouteCheck.of(prefix, 6, {"prompt_tokens": words, "cached_tokens": 6 * BLOCK_TOKENS}, resumed=0)
    assert (exact.expected, exact.error, exact.held_blocks) == (6 * BLOCK_TOKENS, 0, 6)
    # A real engine with 1.25 tokens per word held only the first half.
    tokens = words * 5 // 4
    half = RouteCheck.of(prefix, 6, {"prompt_tokens": tokens, "cached_tokens": 3 * BLOCK_TOKENS * 5 // 4}, resumed=0)
    assert (half.expected, half.held_blocks) == (6 * BLOCK_TOKENS * 5 // 4, 3)
    assert half.error == 3 * BLOCK_TOKENS * 5 // 4
    # Resumed tokens (migration) are not part of the prefix.
    resumed = RouteCheck.of(prefix, 6, {"prompt_tokens": words + 10, "cached_tokens": 6 * BLOCK_TOKENS}, resumed=10)
    assert resumed.error == 0


async def test_a_retry_or_migration_goes_to_another_holder_of_its_prefix(fleet: Fleet) -> None:
    """A re-admission (the failed worker excluded, boosted) keeps preferring the prefix:
    of the two workers left, the one that also holds it wins over the idle cold one."""
    for name in "abc":
        await fleet.worker(capacity=8, worker_id=name)
    gw = await fleet.gateway(routing="cache")
    index = PrefixIndex(fleet.redis)
    await index.report(fleet.model, "a", [{"type": "stored", "block_hashes": list(_blocks("q"))}])
    await index.report(fleet.model, "b", [{"type": "stored", "block_hashes": list(_blocks("q")[:20])}])
    busy = [(await gw.acquire(fleet.ask(exclude=("a", "c"))))[0] for _ in range(2)]  # b is the busier
    (moved,) = await gw.acquire(fleet.ask(blocks=_blocks("r"), exclude=("a",), boost=True))
    assert moved.worker_id == "b" and moved.matched_blocks == 20
    for lease in [moved, *busy]:
        await gw.release(lease)


def test_a_resumed_payload_routes_on_the_same_prefix() -> None:
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "hi"}]
    first = PromptPrefix.of({"messages": messages})
    resumed = PromptPrefix.of({"messages": messages, "resume_token_ids": [1, 2, 3]})
    assert first == resumed and len(first.blocks) == 20


async def _prefill(fleet: Fleet) -> dict[str, int]:
    """Each worker's pending prefill, in blocks, as the admission scripts count it."""
    raw = await fleet.redis.hgetall(keys.prefill(fleet.model))  # type: ignore[attr-defined]
    return {k.decode(): int(v) for k, v in raw.items()}


def _unique_blocks(tag: str) -> tuple[str, ...]:
    return tuple(block_hashes(" ".join(f"{tag}{i}" for i in range(22 * BLOCK_TOKENS))))


async def test_a_holder_with_a_prefill_backlog_loses_to_an_idle_worker(fleet: Fleet) -> None:
    """Regression for affinity under overload: the worker holding a prefix got every
    request of its group however much prefill it already owed. Its backlog (88 uncached
    blocks of four other requests, at a quarter block each, plus their slots) now
    outweighs the 20 blocks it would save."""
    await fleet.worker(capacity=8, worker_id="a")
    await fleet.worker(capacity=8, worker_id="b")
    index = PrefixIndex(fleet.redis)
    await index.report(fleet.model, "a", [{"type": "stored", "block_hashes": list(_blocks("q")[:20])}])
    gw = await fleet.gateway(routing="cache")
    backlog = [(await gw.acquire(fleet.ask(blocks=_unique_blocks(t), exclude=("b",))))[0] for t in "wxyz"]
    assert await _prefill(fleet) == {"a": 88}
    # A gateway that ignores the backlog keeps the request on the holder.
    blind = await fleet.gateway(routing="cache", route_prefill_weight=0)
    (stays,) = await blind.acquire(fleet.ask(blocks=_blocks("r")))
    assert stays.worker_id == "a" and stays.matched_blocks == 20
    assert await _prefill(fleet) == {"a": 90}
    await blind.release(stays)
    (lease,) = await gw.acquire(fleet.ask(blocks=_blocks("q")))
    assert lease.worker_id == "b" and lease.matched_blocks == 0
    assert await _prefill(fleet) == {"a": 88, "b": 22}
    for held in [*backlog, lease]:
        await gw.release(held)
    assert await _prefill(fleet) == {}
    # Backlog gone: affinity again (both workers hold the prefix by now).
    (back,) = await gw.acquire(fleet.ask(blocks=_blocks("s")))
    assert back.matched_blocks == 20
    await gw.release(back)


async def test_generations_on_one_worker_count_their_prefill_once(fleet: Fleet) -> None:
    await fleet.worker(capacity=4, worker_id="a")
    gw = await fleet.gateway(routing="cache")
    leases = await gw.acquire(fleet.ask(blocks=_blocks("q"), need=3))
    assert {x.worker_id for x in leases} == {"a"}
    assert await _prefill(fleet) == {"a": 22}
    for lease in leases:
        await gw.release(lease)
    assert await _prefill(fleet) == {}


async def test_round_robin_counts_no_prefill_and_least_counts_requests(fleet: Fleet) -> None:
    await fleet.worker(capacity=4, worker_id="a")
    rr = await fleet.gateway(routing="rr")
    (lease,) = await rr.acquire(fleet.ask(blocks=_blocks("q")))
    assert await _prefill(fleet) == {}
    await rr.release(lease)
    least = await fleet.gateway(routing="least")
    (lease,) = await least.acquire(fleet.ask(blocks=_blocks("q")))
    assert (lease.prefill_blocks, await _prefill(fleet)) == (1, {"a": 1})  # one request, not its blocks
    await least.release(lease)
    assert await _prefill(fleet) == {}


async def test_least_does_not_send_a_returning_batch_back_to_one_worker(fleet: Fleet) -> None:
    """Regression for least's waves on one H200 (issue 24, run of 2026-12-03: 2.5-3.2x round
    robin's TTFT p90): in a closed loop, the requests that started together on a worker
    finish together; their users come back at once and the worker they just left is the
    least loaded for each of them, so counting slots alone sent the whole batch back to it,
    to queue in its front end and prefill one after another. A request not yet past its
    first token weighs 1 + 12 (SLUICE_GATEWAY_ROUTE_LEAST_PENDING_WEIGHT, gateway/config.py):
    the first user back makes that worker the busier one, and the batch alternates."""
    await fleet.worker(capacity=32, worker_id="a")
    await fleet.worker(capacity=32, worker_id="b")
    gw = await fleet.gateway(routing="least")
    first = [(await gw.acquire(fleet.ask()))[0] for _ in range(16)]
    assert sorted(x.worker_id for x in first) == ["a"] * 8 + ["b"] * 8
    for lease in first:
        gw.prefilled(lease)
    await gw.report_prefilled()  # every first token is out: they all decode
    assert await _prefill(fleet) == {}
    for lease in first:
        if lease.worker_id == "a":
            await gw.release(lease)  # a's batch ends; its eight users come back at once
    back = [(await gw.acquire(fleet.ask()))[0] for _ in range(8)]
    assert [x.worker_id for x in back] == ["a", "b"] * 4
    for lease in [x for x in first if x.worker_id == "b"] + back:
        await gw.release(lease)


async def test_the_reaper_gives_back_a_dead_gateways_prefill_and_recounts(fleet: Fleet) -> None:
    await fleet.worker(capacity=8, worker_id="a")
    await fleet.worker(capacity=8, worker_id="b")
    dying = await fleet.gateway(routing="cache", lease_ttl_s=0.5)
    (orphan,) = await dying.acquire(fleet.ask(blocks=_unique_blocks("x")))
    assert await _prefill(fleet) == {orphan.worker_id: 22}
    await dying.close()  # stops renewing: its lease expires
    gw = await fleet.gateway(routing="cache", reap_interval_s=3600)  # reaps when told only
    (kept,) = await gw.acquire(fleet.ask(blocks=_unique_blocks("y"), exclude=(orphan.worker_id,)))
    for _ in range(100):  # until the orphan's lease has expired and is reaped
        await gw.reap_once(reconcile=False)
        if not await fleet.redis.zscore(keys.leases(fleet.model), orphan.lease_id):  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.05)
    assert await _prefill(fleet) == {kept.worker_id: 22}
    # Counts that drifted (a lost write, a hand edit) are rebuilt from the leases.
    await fleet.redis.hset(keys.prefill(fleet.model), mapping={"a": 99, "b": 7})  # type: ignore[attr-defined]
    await fleet.redis.hset(keys.admission(fleet.model).lease_prefill, "no-such-lease", 5)  # type: ignore[attr-defined]
    await gw.reap_once(reconcile=True)
    assert await _prefill(fleet) == {kept.worker_id: 22}
    assert not await fleet.redis.hexists(keys.admission(fleet.model).lease_prefill, "no-such-lease")  # type: ignore[attr-defined]
    await gw.release(kept)
    assert await _prefill(fleet) == {}


async def test_a_first_token_takes_its_prefill_off_once(fleet: Fleet) -> None:
    """The engine has prefilled a request once its first token is out: its blocks leave
    the worker's backlog then, not when its lease ends; the release does not take them
    off a second time."""
    await fleet.worker(capacity=8, worker_id="a")
    gw = await fleet.gateway(routing="cache")
    first, second = [(await gw.acquire(fleet.ask(blocks=_unique_blocks(t))))[0] for t in "xy"]
    assert (first.prefill_blocks, second.prefill_blocks) == (22, 22)
    assert await _prefill(fleet) == {"a": 44}
    gw.prefilled(first)
    for _ in range(200):
        if await _prefill(fleet) == {"a": 22}:
            break
        await asyncio.sleep(0.01)
    assert await _prefill(fleet) == {"a": 22}
    await gw.release(first)
    assert await _prefill(fleet) == {"a": 22}  # the second one's, still owed
    await gw.release(second)
    assert await _prefill(fleet) == {}
