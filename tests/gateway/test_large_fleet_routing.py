"""Admission on a large fleet (gateway/admission/scripts.py, "Large fleets"): past 4 x
``route_sample`` live workers a plain request is routed among a random sample plus the
holders of its prompt's prefix, and the whole fleet is read only when the sample has no
room. On a real Redis (single server and a three-master cluster)."""

from __future__ import annotations

import asyncio
from collections import Counter

from sluice import keys
from tests.gateway import test_queue_scripts as queue_tests
from tests.gateway.test_queue_scripts import Fleet

url, redis, fleet = queue_tests.url, queue_tests.redis, queue_tests.fleet

WORKERS = 60  # past 4 x 8, the default sample


async def _workers(fleet: Fleet, capacity: int) -> list[str]:
    return [await fleet.worker(capacity=capacity, worker_id=f"w{i:03d}") for i in range(WORKERS)]


async def test_a_large_fleet_fills_every_slot_the_sample_misses_included(fleet: Fleet) -> None:
    """Every slot of the fleet is granted, one by one, with nothing released: the last
    requests find one free slot among 60 workers, which a sample of 8 almost never holds, so
    they are granted through the whole fleet's scan. Then the fleet is full: the next one waits."""
    ids = await _workers(fleet, capacity=2)
    gw = await fleet.gateway(routing="least", queue_timeout_s=0.2)
    leases = [lease for _ in range(2 * WORKERS) for lease in await gw.acquire(fleet.ask())]
    held = Counter(lease.worker_id for lease in leases)
    assert held == dict.fromkeys(ids, 2)  # every slot once, none past its capacity
    inflight = await fleet.redis.hgetall(keys.admission(fleet.model)[2])  # type: ignore[attr-defined]
    assert {k.decode(): int(v) for k, v in inflight.items()} == dict.fromkeys(ids, 2)
    try:
        await gw.acquire(fleet.ask())
        raise AssertionError("a full fleet granted a slot")
    except Exception as exc:  # the queue's timeout: nothing was free
        assert getattr(exc, "code", "") == "queue_timeout", exc
    for lease in leases:
        await gw.release(lease)


async def test_a_large_fleet_spreads_its_load(fleet: Fleet) -> None:
    """Least among a random sample keeps the load even: 120 requests held on 60 workers of 8
    slots land on many workers, and none holds more than a few (the whole fleet's least would
    put exactly 2 on each; a sample of 8 rarely misses by more than one)."""
    await _workers(fleet, capacity=8)
    gw = await fleet.gateway(routing="least")
    leases = [lease for _ in range(120) for lease in await gw.acquire(fleet.ask())]
    held = Counter(lease.worker_id for lease in leases)
    assert len(held) >= 45, held
    assert max(held.values()) <= 4, held
    for lease in leases:
        await gw.release(lease)


async def test_cache_routing_on_a_large_fleet_finds_the_prefix_wherever_it_is(fleet: Fleet) -> None:
    """The workers holding a prompt's prefix join the sample: a prompt served once goes back
    to its worker every time, where a random sample of 8 of 60 would hold it one time in eight."""
    await _workers(fleet, capacity=8)
    gw = await fleet.gateway(routing="cache")
    blocks = tuple(f"blk{i}" for i in range(16))
    (first,) = await gw.acquire(fleet.ask(blocks=blocks))
    await gw.release(first)
    chosen = []
    for _ in range(12):
        (lease,) = await gw.acquire(fleet.ask(blocks=blocks))
        chosen.append(lease.worker_id)
        assert lease.matched_blocks == 16
        await gw.release(lease)
    assert set(chosen) == {first.worker_id}


async def test_with_no_sample_the_whole_fleet_is_read(fleet: Fleet) -> None:
    """``SLUICE_GATEWAY_ROUTE_SAMPLE=0``: least over the whole fleet, exactly as before: 60
    requests on 60 idle workers go one to each."""
    await _workers(fleet, capacity=8)
    gw = await fleet.gateway(routing="least", route_sample=0)
    leases = [lease for _ in range(WORKERS) for lease in await gw.acquire(fleet.ask())]
    assert len({lease.worker_id for lease in leases}) == WORKERS
    for lease in leases:
        await gw.release(lease)


async def test_the_sample_leaves_out_workers_that_do_not_generate(fleet: Fleet) -> None:
    """Regression (review): the sample skipped the task check, so a chat request on a large
    fleet of embedding workers and one generating worker went to an embedding worker."""
    for i in range(WORKERS):
        await fleet.worker(capacity=4, worker_id=f"e{i:03d}", tasks=("embed",))
    generator = await fleet.worker(capacity=4, worker_id="gen")
    gw = await fleet.gateway(routing="least")
    for _ in range(10):
        (lease,) = await gw.acquire(fleet.ask())
        assert lease.worker_id == generator
        await gw.release(lease)


async def test_the_sample_leaves_out_workers_whose_heartbeat_stopped(fleet: Fleet) -> None:
    """Two thirds of a large fleet stop beating: every slot granted is a live worker's, the
    dead ones drawn into samples are passed over (and tidied by the whole fleet's scan)."""
    ids = await _workers(fleet, capacity=2)
    dead, live = ids[:40], ids[40:]
    alive_key = keys.admission(fleet.model)[1]
    for worker_id in dead:
        await fleet.redis.hset(alive_key, worker_id, 0)  # type: ignore[attr-defined]  # its beat expired long ago
    gw = await fleet.gateway(routing="least", queue_timeout_s=0.2)
    leases = [lease for _ in range(2 * len(live)) for lease in await gw.acquire(fleet.ask())]
    assert Counter(lease.worker_id for lease in leases) == dict.fromkeys(live, 2)
    try:
        await gw.acquire(fleet.ask())
        raise AssertionError("a slot of a dead worker was granted")
    except Exception as exc:
        assert getattr(exc, "code", "") == "queue_timeout", exc
    assert not {k.decode() for k in await fleet.redis.hkeys(alive_key)} & set(dead)  # type: ignore[attr-defined]
    for lease in leases:
        await gw.release(lease)


async def _held_fleet(fleet: Fleet) -> tuple[object, list]:
    """A large fleet of one slot per worker, every slot held."""
    await _workers(fleet, capacity=1)
    gw = await fleet.gateway(routing="least", queue_timeout_s=30, reap_interval_s=60)
    return gw, [lease for _ in range(WORKERS) for lease in await gw.acquire(fleet.ask())]


async def test_a_full_large_fleet_hands_each_freed_slot_to_the_queue_in_order(fleet: Fleet) -> None:
    """Every slot held, ten requests waiting: each release hands its slot to the next one in
    line, through a sample with the freed worker in it (the whole fleet is not read)."""
    gw, held = await _held_fleet(fleet)
    waiting = []
    for k in range(10):
        waiting.append(asyncio.create_task(gw.acquire(fleet.ask())))
        await queue_tests._queued(fleet, k + 1)
    for k in range(10):
        freed = held.pop()
        await gw.release(freed)
        (lease,) = await asyncio.wait_for(waiting[k], 5)
        assert lease.worker_id == freed.worker_id  # the only free slot
        assert not any(w.done() for w in waiting[k + 1:])  # and only the next in line got it
        held.append(lease)
    for lease in held:
        await gw.release(lease)


async def test_a_request_a_sample_cannot_judge_is_judged_on_the_whole_fleet(fleet: Fleet) -> None:
    """A waiting request for twelve slots on a full large fleet of one slot per worker: a
    release's sample (9 workers) can neither serve it nor tell that no worker can (503 "none"
    from a sample was the risk), so the pump reads the whole fleet for it: it waits through
    eleven releases and is granted at the twelfth, with no reap."""
    gw, held = await _held_fleet(fleet)
    many = asyncio.create_task(gw.acquire(fleet.ask(need=12)))
    await queue_tests._queued(fleet, 1)
    for _ in range(11):
        await gw.release(held.pop())
    await asyncio.sleep(0.1)
    assert not many.done()
    await gw.release(held.pop())
    assert len(await asyncio.wait_for(many, 5)) == 12
    for lease in held + many.result():
        await gw.release(lease)


async def test_a_release_on_a_worker_of_another_task_hands_its_slot_on(fleet: Fleet) -> None:
    """Review: a large fleet's release on an embedding worker went through a sample of
    generating workers, and the embedding request waiting for that slot was passed over
    until the next reap."""
    gw, held = await _held_fleet(fleet)
    await fleet.worker(capacity=1, worker_id="embedder", tasks=("embed",))
    (embedding,) = await gw.acquire(fleet.ask(task="embed"))
    plain = asyncio.create_task(gw.acquire(fleet.ask()))
    await queue_tests._queued(fleet, 1)
    waiting = asyncio.create_task(gw.acquire(fleet.ask(task="embed", tenant="another")))  # a head of its own
    await queue_tests._queued(fleet, 2)
    await gw.release(embedding)
    (lease,) = await asyncio.wait_for(waiting, 5)
    assert lease.worker_id == "embedder"
    await gw.release(lease)
    await gw.release(held.pop())
    held.extend(await asyncio.wait_for(plain, 5))
    for lease in held:
        await gw.release(lease)
