"""The admission scripts, driven in-process through the gateway's Admission against a real
Redis (single server and a three-master cluster): each defect of the old queue has a test
named after it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from engine_worker.registration import Registration
from gateway.admission.queue import Admission, Ask, Lease
from gateway.config import GatewaySettings
from sluice import keys
from sluice.errors import InvalidRequest, RateLimited, Unavailable
from sluice.embedded_redis import EmbeddedRedis
from sluice.redis_pool import create_pool
from sluice.roles import Role
from sluice.script_channel import Packed


@pytest.fixture(params=["single", "cluster"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("redis_url" if request.param == "single" else "redis_cluster_url")


@pytest.fixture
async def redis(url: str) -> AsyncIterator[object]:
    client = await create_pool(url, max_connections=16)
    yield client
    await client.aclose()


class Fleet:
    """Admissions (gateway processes) and registered workers of one fresh model."""

    def __init__(self, redis: object, url: str) -> None:
        self.redis = redis
        self.url = url
        self.model = "t-" + uuid.uuid4().hex[:8]
        self._admissions: list[Admission] = []
        self._workers: list[Registration] = []

    async def worker(self, capacity: int, worker_id: str | None = None,
                     tasks: tuple[str, ...] = ("generate",), role: Role = "both", url: str = "http://127.0.0.1:9",
                     **fields: object) -> str:
        """A registered worker; ``fields``: Registration's other arguments (``record``, say)."""
        reg = Registration(self.redis, model=self.model, worker_id=worker_id or uuid.uuid4().hex[:6],
                           url=url, engine="sim", capacity=capacity, heartbeat_ms=60_000,
                           stats=lambda: {"running": 0}, tasks=tasks, role=role, **fields)  # type: ignore[arg-type]
        await reg.beat()
        self._workers.append(reg)
        return reg.worker_id

    async def gateway(self, **settings: object) -> Admission:
        admission = Admission(self.redis, GatewaySettings(redis_url=self.url, **settings))
        await admission.start()
        self._admissions.append(admission)
        return admission

    def ask(self, **fields: object) -> Ask:
        return Ask(model=self.model, request_id=uuid.uuid4().hex, **fields)  # type: ignore[arg-type]

    async def close(self) -> None:
        for admission in self._admissions:
            await admission.close()


@pytest.fixture
async def fleet(redis: object, url: str) -> AsyncIterator[Fleet]:
    f = Fleet(redis, url)
    yield f
    await f.close()


async def _queued(fleet: Fleet, count: int) -> None:
    """Wait until ``count`` requests wait in the model's queues."""
    async def length() -> int:
        return sum([int(await fleet.redis.zcard(q)) for q in keys.queues(fleet.model)])  # type: ignore[attr-defined]
    for _ in range(500):
        if await length() >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {count} queued (have {await length()})")


async def test_waiters_share_one_listener(fleet: Fleet) -> None:
    """Regression: each waiter parked its own connection in BLPOP; 400 waiters now cost
    this process one listener, and every one gets its grant in turn."""
    await fleet.worker(capacity=4)
    gw = await fleet.gateway(queue_timeout_s=60, max_queue=1000)
    held = [lease for _ in range(4) for lease in await gw.acquire(fleet.ask())]
    waiters = [asyncio.create_task(gw.acquire(fleet.ask())) for _ in range(400)]
    await _queued(fleet, 400)
    assert gw.grants.waiting(fleet.model) == 400
    served = 0
    pending = list(held)
    while waiters:
        await gw.release(pending.pop())
        done, _ = await asyncio.wait(waiters, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert done, "a released slot reached no waiter"
        for task in done:
            pending.extend(task.result())
            served += 1
            waiters.remove(task)
    for lease in pending:
        await gw.release(lease)
    assert served == 400


async def test_n_generations_are_granted_all_or_nothing(fleet: Fleet) -> None:
    """Regression: two n=2 requests on 2 slots each took one slot and waited for the other."""
    await fleet.worker(capacity=2)
    gw = await fleet.gateway(queue_timeout_s=5)
    a = await gw.acquire(fleet.ask(need=2))
    assert len(a) == 2
    waiting = asyncio.create_task(gw.acquire(fleet.ask(need=2)))
    await _queued(fleet, 1)
    await gw.release(a[0])
    await asyncio.sleep(0.2)
    assert not waiting.done()  # one free slot is not enough: no partial grant
    await gw.release(a[1])
    got = await asyncio.wait_for(waiting, 5)
    assert len(got) == 2 and len({x.lease_id for x in got}) == 2


async def test_more_generations_than_the_fleet_holds_is_400(fleet: Fleet) -> None:
    await fleet.worker(capacity=2)
    gw = await fleet.gateway()
    with pytest.raises(InvalidRequest):
        await gw.acquire(fleet.ask(need=3))


async def test_boosted_requests_skip_the_queue_bound(fleet: Fleet) -> None:
    """Regression: a migration during overload got queue_full mid-stream."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(max_queue=1, queue_timeout_s=5)
    (held,) = await gw.acquire(fleet.ask())
    waiter = asyncio.create_task(gw.acquire(fleet.ask()))
    await _queued(fleet, 1)
    with pytest.raises(RateLimited):
        await gw.acquire(fleet.ask(timeout_s=1))
    migration = asyncio.create_task(gw.acquire(fleet.ask(boost=True, exclude=("gone",))))
    await _queued(fleet, 2)
    await gw.release(held)
    (moved,) = await asyncio.wait_for(migration, 5)  # boosted: served before the older waiter
    assert not waiter.done()
    await gw.release(moved)
    for lease in await asyncio.wait_for(waiter, 5):
        await gw.release(lease)


async def test_urgent_request_behind_a_long_queue_gets_the_next_slot(fleet: Fleet) -> None:
    """Regression: urgent entries beyond the 64-entry scan window stayed queued."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(queue_timeout_s=30, max_queue=1000)
    (held,) = await gw.acquire(fleet.ask())
    normal = [asyncio.create_task(gw.acquire(fleet.ask(priority=5))) for _ in range(100)]
    await _queued(fleet, 100)
    urgent = asyncio.create_task(gw.acquire(fleet.ask(priority=-5)))
    await _queued(fleet, 101)
    await gw.release(held)
    (lease,) = await asyncio.wait_for(urgent, 5)
    assert not any(t.done() for t in normal)
    for task in normal:
        task.cancel()
    await asyncio.gather(*normal, return_exceptions=True)
    await gw.release(lease)


async def test_a_dead_gateways_waiters_get_no_slots(fleet: Fleet) -> None:
    """Regression: a crashed gateway's queued requests kept receiving grants, each idling
    a slot for a whole lease TTL, while live waiters timed out."""
    await fleet.worker(capacity=1)
    live = await fleet.gateway(queue_timeout_s=30, max_queue=1000)
    (held,) = await live.acquire(fleet.ask())
    for _ in range(20):
        await _queue_as_ghost(live, fleet.ask())
    mine = asyncio.create_task(live.acquire(fleet.ask()))
    await _queued(fleet, 21)
    await asyncio.sleep(3.5)  # the dead gateway's liveness (3 s) runs out
    started = time.monotonic()
    await live.release(held)
    (lease,) = await asyncio.wait_for(mine, 5)
    # The bug idled the slot a lease TTL (15 s) per ghost; a loaded CI run took 1.14 s here.
    assert time.monotonic() - started < 2.5
    await live.release(lease)


async def _queue_as_ghost(gw: Admission, ask: Ask) -> None:
    """Queue ``ask`` as a gateway process that dies right after (it never beats, never
    claims its grant, never cancels)."""
    common = [v for lead in gw._common for v in (lead.values if isinstance(lead, Packed) else (lead,))]
    args = ["ghost-" + uuid.uuid4().hex[:6], *common[1:],  # its own gateway id, then the other constants
            ask.request_id, ask.priority, ask.need, 30_000, 1000, "[]", 0, ask.tenant, ask.cost]
    assert (await gw._acquire(keys=keys.admission(ask.model), args=args))[0] == b"queued"


async def test_grant_to_a_gateway_that_just_died_idles_its_slot_briefly(fleet: Fleet) -> None:
    """A grant published to a gateway that died a moment ago must be claimed within the
    liveness TTL, or the reaper takes the slot back (not a whole lease TTL later)."""
    await fleet.worker(capacity=1)
    live = await fleet.gateway(queue_timeout_s=30, lease_ttl_s=60, reap_interval_s=0.2)
    (held,) = await live.acquire(fleet.ask())
    await _queue_as_ghost(live, fleet.ask())
    mine = asyncio.create_task(live.acquire(fleet.ask()))
    await _queued(fleet, 2)
    started = time.monotonic()
    await live.release(held)  # the ghost's entry is first and still counts as alive: it gets the slot
    (lease,) = await asyncio.wait_for(mine, 8)
    assert time.monotonic() - started < 8  # within the 3 s claim window (+ a reap, + slack), not 60 s
    await live.release(lease)


async def test_queue_deadlines_use_redis_time_not_the_gateways(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a gateway 10 s behind Redis had its queued request dropped silently."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(queue_timeout_s=5)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 10)
    (held,) = await gw.acquire(fleet.ask())
    waiter = asyncio.create_task(gw.acquire(fleet.ask()))
    await _queued(fleet, 1)
    await asyncio.sleep(0.3)
    await gw.release(held)
    (lease,) = await asyncio.wait_for(waiter, 3)
    await gw.release(lease)


async def test_worker_named_none_gets_traffic(fleet: Fleet) -> None:
    """Regression: grants were recognised by the substring "none"."""
    await fleet.worker(capacity=1, worker_id="none")
    gw = await fleet.gateway()
    (held,) = await gw.acquire(fleet.ask())
    assert held.worker_id == "none"
    waiter = asyncio.create_task(gw.acquire(fleet.ask()))
    await _queued(fleet, 1)
    await gw.release(held)
    (lease,) = await asyncio.wait_for(waiter, 3)
    assert lease.worker_id == "none"
    await gw.release(lease)


async def test_inflight_is_recounted_from_the_leases(fleet: Fleet) -> None:
    worker = await fleet.worker(capacity=4)
    gw = await fleet.gateway()
    (lease,) = await gw.acquire(fleet.ask())
    await fleet.redis.hset(keys.inflight(fleet.model), worker, 3)  # type: ignore[attr-defined]
    await gw.reap_once(reconcile=True)
    assert int(await fleet.redis.hget(keys.inflight(fleet.model), worker)) == 1  # type: ignore[attr-defined]
    await gw.release(lease)
    assert int(await fleet.redis.hget(keys.inflight(fleet.model), worker)) == 0  # type: ignore[attr-defined]


async def test_renew_reports_leases_that_are_gone(fleet: Fleet) -> None:
    """Regression: RENEW returned its argument count, whatever it renewed."""
    await fleet.worker(capacity=2)
    gw = await fleet.gateway()
    (lease,) = await gw.acquire(fleet.ask())
    lost = await gw._renew(keys=keys.admission(fleet.model), args=gw._args(lease.lease_id, "no-such-lease"))
    assert lost == [b"no-such-lease"]
    await gw.release(lease)


async def test_a_lease_released_while_its_renewal_was_under_way_is_not_reported_lost(fleet: Fleet) -> None:
    """Regression (H100, 4 x 64 one-token streams): the renewal collects this process's
    leases, then waits for Redis; a stream that ends meanwhile releases its lease, and the
    renewal found it gone and logged it as reaped ("expired before renewal"), three times a
    minute. Only a lease a running stream still holds is lost."""
    await fleet.worker(capacity=4)
    gw = await fleet.gateway()
    (ended,) = await gw.acquire(fleet.ask())
    (running,) = await gw.acquire(fleet.ask())
    collected = [ended.lease_id, running.lease_id]  # what the renewal took before its round trip
    await gw.release(ended)
    assert await gw.renew(fleet.model, collected) == []
    await fleet.redis.zrem(keys.admission(fleet.model).leases, running.lease_id)  # type: ignore[attr-defined]  # reaped
    assert await gw.renew(fleet.model, collected) == [running.lease_id]
    await gw.release(running)


async def test_a_flooding_tenant_does_not_starve_another(fleet: Fleet) -> None:
    """Fair share by work within a class: tenant A queues 40 requests, then B queues 4;
    B's requests are served among the next few grants, not after A's backlog."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(queue_timeout_s=60, max_queue=1000)
    (held,) = await gw.acquire(fleet.ask(tenant="A", cost=100))
    tenant_of: dict[asyncio.Task[list[Lease]], str] = {}

    def queue(tenant: str) -> None:
        tenant_of[asyncio.create_task(gw.acquire(fleet.ask(tenant=tenant, cost=100)))] = tenant

    for _ in range(40):
        queue("A")
    await _queued(fleet, 40)
    for _ in range(4):
        queue("B")
    await _queued(fleet, 44)
    order: list[str] = []
    current = held
    for _ in range(12):
        await gw.release(current)
        done, _ = await asyncio.wait(list(tenant_of), timeout=5, return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        order.append(tenant_of.pop(task))
        (current,) = task.result()
    assert order.count("B") == 4, order
    for task in tenant_of:
        task.cancel()
    await asyncio.gather(*tenant_of, return_exceptions=True)
    await gw.release(current)


async def test_requests_that_time_out_are_not_charged_to_their_tenant(fleet: Fleet) -> None:
    """Regression: a tenant was charged at queueing for requests that then timed out, so
    its later requests waited behind every other tenant's (found by the fairness bench)."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(queue_timeout_s=60, max_queue=1000)
    (current,) = await gw.acquire(fleet.ask(tenant="A", cost=100))
    expired = [asyncio.create_task(gw.acquire(fleet.ask(tenant="A", cost=100, timeout_s=0.3))) for _ in range(20)]
    results = await asyncio.gather(*expired, return_exceptions=True)
    assert all(isinstance(r, RateLimited) for r in results)
    tenant_of: dict[asyncio.Task[list[Lease]], str] = {}
    for _ in range(4):
        for tenant in ("B", "A"):
            tenant_of[asyncio.create_task(gw.acquire(fleet.ask(tenant=tenant, cost=100)))] = tenant
            await _queued(fleet, len(tenant_of))
    order: list[str] = []
    for _ in range(8):
        await gw.release(current)
        done, _ = await asyncio.wait(list(tenant_of), timeout=5, return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        order.append(tenant_of.pop(task))
        (current,) = task.result()
    await gw.release(current)
    # A already had one request served (the held slot); after that the two alternate. Charged
    # for its timed-out requests, A would wait until all of B's had gone first.
    assert "A" in order[:3] and order.count("A") == 4, order


async def test_a_tenant_served_at_once_is_charged_like_one_served_from_the_queue(fleet: Fleet) -> None:
    """Requests granted without waiting (the script's empty-queue path) count toward their
    tenant's share: A's five immediate grants put A behind B once both have to wait."""
    await fleet.worker(capacity=5)
    gw = await fleet.gateway(queue_timeout_s=60, max_queue=1000)
    held = [(await gw.acquire(fleet.ask(tenant="A", cost=100)))[0] for _ in range(5)]
    assert not any([int(await fleet.redis.zcard(q)) for q in keys.queues(fleet.model)])  # type: ignore[attr-defined]
    tenant_of: dict[asyncio.Task[list[Lease]], str] = {}
    for tenant in ("A", "A", "B", "B"):
        tenant_of[asyncio.create_task(gw.acquire(fleet.ask(tenant=tenant, cost=100)))] = tenant
        await _queued(fleet, len(tenant_of))
    order: list[str] = []
    for lease in held[:4]:  # each release hands its slot to exactly one waiter
        await gw.release(lease)
        done, _ = await asyncio.wait(list(tenant_of), timeout=5, return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        order.append(tenant_of.pop(task))
        held.append(task.result()[0])
    for lease in held[4:]:
        await gw.release(lease)
    # A's five grants advanced its finish tag past the virtual time: B's head starts
    # earlier, so B goes first though A asked first; then they alternate (start-time fair
    # queuing gives no credit for idle time). Uncharged, A would have gone first.
    assert order == ["B", "A", "B", "A"], order


async def _blocked_script(redis: object) -> None:
    """Wait until a script call sits in Redis, held by CLIENT PAUSE."""
    for _ in range(500):
        if any(c.get("cmd") == "evalsha" and "b" in c.get("flags", "")
               for c in await redis.client_list()):  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no script call ever reached Redis")


@pytest.fixture
async def single(redis_url: str) -> AsyncIterator[Fleet]:
    """A fleet on one plain Redis server (CLIENT PAUSE holds every script call of the
    gateway's one script connection, in order)."""
    client = await create_pool(redis_url, max_connections=16)
    f = Fleet(client, redis_url)
    yield f
    await f.close()
    await client.aclose()


@pytest.mark.parametrize("queued", [False, True], ids=["granted", "queued"])
async def test_a_cancelled_acquire_holds_no_slot_and_leaves_no_queue_entry(single: Fleet, queued: bool) -> None:
    """Regression: a request cancelled while its ACQUIRE was in flight (a client leaving during
    a migration's re-acquire) left what the script did behind: a granted slot held for the
    lease TTL (60 s here), or a queue entry that later took a slot nobody claimed."""
    fleet = single
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(lease_ttl_s=60, queue_timeout_s=30)
    held = (await gw.acquire(fleet.ask()))[0] if queued else None
    if held is None:
        await gw.release((await gw.acquire(fleet.ask()))[0])  # the scripts are loaded
    await fleet.redis.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # type: ignore[attr-defined]
    try:
        task = asyncio.create_task(gw.acquire(fleet.ask(boost=True, exclude=("gone",))))
        await _blocked_script(fleet.redis)
        task.cancel()
    finally:
        await fleet.redis.execute_command("CLIENT", "UNPAUSE")  # type: ignore[attr-defined]
    with pytest.raises(asyncio.CancelledError):
        await task
    if held is not None:
        await gw.release(held)  # its slot goes to the queue's head, if an entry was left there
    # Through the same connection, so after everything the cancelled call left in Redis.
    (lease,) = await gw.acquire(fleet.ask(timeout_s=1))
    assert [m.decode() for m in await fleet.redis.zrange(keys.leases(fleet.model), 0, -1)] == [lease.lease_id]  # type: ignore[attr-defined]
    await gw.release(lease)
    assert not any([int(await fleet.redis.zcard(q)) for q in keys.queues(fleet.model)])  # type: ignore[attr-defined]


async def test_a_grant_recovered_through_cancel_keeps_its_prefill_accounting(fleet: Fleet) -> None:
    """Regression: a grant the waiter only learnt of through CANCEL (its listener never saw
    it) lost its pending prefill, so its first token did not take it off its worker's
    backlog (``sl:{m}:prefill``), which stayed inflated for the whole stream."""
    worker = await fleet.worker(capacity=1)
    gw = await fleet.gateway(routing="cache", queue_timeout_s=30)
    (held,) = await gw.acquire(fleet.ask(blocks=("h1",)))
    waiter = asyncio.create_task(gw.acquire(fleet.ask(blocks=("p1", "p2"), timeout_s=1.5)))
    await _queued(fleet, 1)
    for _ in range(500):
        if fleet.model in gw.grants._loops:
            break
        await asyncio.sleep(0.01)
    gw.grants._loops[fleet.model].cancel()  # deaf: the grant reaches the waiter through CANCEL only
    await gw.release(held)
    (lease,) = await asyncio.wait_for(waiter, 5)
    backlog = keys.prefill(fleet.model)
    assert int(await fleet.redis.hget(backlog, worker) or 0) == 2  # type: ignore[attr-defined]
    gw.prefilled(lease)  # its first token
    for _ in range(500):
        if int(await fleet.redis.hget(backlog, worker) or 0) == 0:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.01)
    assert int(await fleet.redis.hget(backlog, worker) or 0) == 0  # type: ignore[attr-defined]
    await gw.release(lease)


async def test_one_gateway_process_reaps_per_period(single: Fleet) -> None:
    """Regression: every gateway process ran REAP every second for every model ever
    registered: Redis load grew with processes x models. Four processes now cost one reap
    per model per period (and one SET each)."""
    fleet = single
    models = [fleet.model] + [f"{fleet.model}-{i}" for i in range(9)]
    for model in models:
        await Registration(fleet.redis, model=model, worker_id="w", url="http://127.0.0.1:9", engine="sim",
                           capacity=1, heartbeat_ms=60_000, stats=lambda: {}).beat()
    for _ in range(4):
        await fleet.gateway(reap_interval_s=0.1)
    listed = int(await fleet.redis.scard(keys.MODELS))  # type: ignore[attr-defined]  # earlier tests' too
    await fleet.redis.config_resetstat()  # type: ignore[attr-defined]
    window_s = 1.0
    await asyncio.sleep(window_s)  # a measuring window, not a wait for an event
    stats = await fleet.redis.info("commandstats")  # type: ignore[attr-defined]
    reaps = int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0))  # REAP's first call, its alone
    periods = window_s / 0.1 + 1
    assert reaps <= periods * listed * 1.5, (reaps, periods, listed)  # four processes: ~4x that


async def test_a_model_nobody_serves_leaves_the_directory_with_its_keys(fleet: Fleet) -> None:
    """Regression: ``sl:models`` never shrank, so every reaper pass (and /metrics) went over
    every model ever registered, and the keys of a model long gone stayed forever; the
    engine stats of dead workers stayed too. The test reaps itself: the period's lock is
    shared with every other gateway on this Redis, whose reapers run their own settings."""
    stay = await fleet.worker(capacity=2)
    gone = Registration(fleet.redis, model=fleet.model, worker_id="dies", url="http://127.0.0.1:9", engine="sim",
                        capacity=1, heartbeat_ms=50, stats=lambda: {"running": 0})
    await gone.beat()  # and never again: its heartbeat lapses
    gw = await fleet.gateway(reap_interval_s=0.1, model_forget_s=0.5)
    (lease,) = await gw.acquire(fleet.ask())
    await gw.release(lease)
    stats = keys.stats(fleet.model)
    for _ in range(100):
        await gw.reap_once()
        if await fleet.redis.hkeys(stats) == [stay.encode()]:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.05)
    assert await fleet.redis.hkeys(stats) == [stay.encode()]  # type: ignore[attr-defined]
    for reg in fleet._workers:
        await reg.deregister()
    await fleet.redis.hdel(keys.workers(fleet.model), stay, "dies")  # type: ignore[attr-defined]
    for _ in range(100):
        await gw.reap_once()
        if not await fleet.redis.sismember(keys.MODELS, fleet.model):  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.05)
    assert not await fleet.redis.sismember(keys.MODELS, fleet.model)  # type: ignore[attr-defined]
    # Gone, or (a reaper that listed the model just before it was forgotten marked it vacant
    # again) expiring: nothing of a forgotten model stays for good.
    left = [k for k in keys.model_keys(fleet.model) if await fleet.redis.pttl(k) == -1]  # type: ignore[attr-defined]
    assert left == []


async def test_a_reap_that_comes_after_the_model_was_forgotten_leaves_nothing_for_good(fleet: Fleet) -> None:
    """Regression (CI): a reaper that had listed a model just before another forgot it ran
    the vacancy check on the model's deleted keys and marked it vacant again, with no TTL:
    ``sl:{model}:vacant`` outlived the model for good."""
    gw = await fleet.gateway(reap_interval_s=60, model_forget_s=0.5)
    assert await gw.reaper._vacancy(keys=keys.model_keys(fleet.model), args=[500]) == 0
    vacant = keys.model_keys(fleet.model)[-1]
    assert 0 < await fleet.redis.pttl(vacant) <= 60_000  # type: ignore[attr-defined]
async def test_urgent_headroom_never_makes_a_queued_request_ungrantable(fleet: Fleet) -> None:
    """Regression: a normal n=8 queued on a cap-8 worker became ungrantable once an urgent
    request arrived (the reserve left 7 slots to it), and every tenant behind it waited
    out its queue timeout with 8 of 8 slots free. It now gets the worker once all 8 are
    free; the request behind it follows."""
    await fleet.worker(capacity=8)
    gw = await fleet.gateway(queue_timeout_s=30)
    (held,) = await gw.acquire(fleet.ask(tenant="B", cost=1000))  # B's next request starts after A's
    eight = asyncio.create_task(gw.acquire(fleet.ask(tenant="A", need=8)))
    await _queued(fleet, 1)
    (urgent,) = await gw.acquire(fleet.ask(tenant="U", priority=-5))  # the reserve is on from here
    one = asyncio.create_task(gw.acquire(fleet.ask(tenant="B")))
    await _queued(fleet, 2)
    await gw.release(urgent)
    await gw.release(held)
    leases = await asyncio.wait_for(eight, 5)
    assert len(leases) == 8 and not one.done()
    for x in leases[:2]:  # one slot for B, one still kept for urgent requests
        await gw.release(x)
    (lease,) = await asyncio.wait_for(one, 5)
    for x in [*leases[2:], lease]:
        await gw.release(x)


async def test_whether_n_fits_does_not_depend_on_urgent_traffic(fleet: Fleet) -> None:
    """Regression: the same n=8 on a cap-8 worker was 200 before an urgent request and 400
    (too_big) for a minute after it."""
    await fleet.worker(capacity=8)
    gw = await fleet.gateway(queue_timeout_s=5)
    for _ in range(2):
        leases = await gw.acquire(fleet.ask(need=8))
        assert len(leases) == 8
        for lease in leases:
            await gw.release(lease)
        (urgent,) = await gw.acquire(fleet.ask(priority=-5))
        await gw.release(urgent)
    with pytest.raises(InvalidRequest):
        await gw.acquire(fleet.ask(need=9))


async def test_a_request_too_big_only_for_the_workers_live_now_is_a_503_to_retry(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (the nemesis, 6 workers of 8 slots): a resumable stream's n=16 was told 400
    "the live workers hold 8: lower n" while Redis came back from a restart and the other
    workers had not beaten since; a client does not retry a 400. The most slots the live
    workers held lately (REAP's) tell a fleet missing workers from one too small: 503 with
    Retry-After, until that is older than CAPACITY_KEPT_S (a fleet scaled down for good)."""
    from gateway.admission import queue

    await fleet.worker(capacity=8)
    await fleet.worker(capacity=8)
    gw = await fleet.gateway(queue_timeout_s=5)
    await gw.reap_once()
    gone = fleet._workers[-1]
    gone._registered = True  # as start() leaves it (these beat by hand)
    await gone.deregister()  # one of the two is gone for now
    with pytest.raises(Unavailable) as short:
        await gw.acquire(fleet.ask(need=16))
    assert short.value.retry_after_s and "16 lately" in short.value.message, short.value.message
    with pytest.raises(InvalidRequest):
        await gw.acquire(fleet.ask(need=17))  # more than the fleet ever held
    monkeypatch.setattr(queue, "CAPACITY_KEPT_S", 0.0)
    await asyncio.sleep(0.01)
    await gw.reap_once()  # the fleet of one worker is the fleet now
    with pytest.raises(InvalidRequest):
        await gw.acquire(fleet.ask(need=16))


async def test_a_request_no_generating_fleet_could_hold_stays_400_while_an_embedding_worker_is_missing(
    fleet: Fleet,
) -> None:
    """The note is of the generating workers' slots: with an embedding worker gone, n=17 on two
    8-slot generating workers is still a 400 (counting every worker's slots, it was a 503
    whenever any worker was missing)."""
    await fleet.worker(capacity=8)
    await fleet.worker(capacity=8)
    await fleet.worker(capacity=8, tasks=("embed",))
    gw = await fleet.gateway(queue_timeout_s=5)
    await gw.reap_once()
    embedder = fleet._workers[-1]
    embedder._registered = True  # as start() leaves it (these beat by hand)
    await embedder.deregister()
    with pytest.raises(InvalidRequest):
        await gw.acquire(fleet.ask(need=17))


async def test_a_request_too_big_for_a_registry_rebuilding_after_a_loss_is_a_503(private: Fleet) -> None:
    """Regression: right after Redis lost its data, the first worker to beat again was the
    whole fleet in the registry, and a request needing more than its slots got 400 (so did a
    task whose workers had not beaten yet); now 503 registry_rebuilding, as an unknown model.
    (A Redis of its own: the loss marks the registry rebuilding for every test on it.)"""
    fleet = private
    await fleet.worker(capacity=8)
    await fleet.worker(capacity=8)
    gw = await fleet.gateway(queue_timeout_s=5)
    leases = await gw.acquire(fleet.ask(need=16))
    for lease in leases:
        await gw.release(lease)
    await fleet.redis.flushall()  # type: ignore[attr-defined]
    await fleet._workers[0].beat()  # one of the two has beaten since
    with pytest.raises(Unavailable) as rebuilding:
        await gw.acquire(fleet.ask(need=16))
    assert rebuilding.value.code == "registry_rebuilding", rebuilding.value.message
    with pytest.raises(Unavailable) as untasked:
        await gw.acquire(fleet.ask(task="embed"))
    assert untasked.value.code == "registry_rebuilding", untasked.value.message


async def test_fair_share_is_corrected_with_real_usage(fleet: Fleet) -> None:
    """Regression: fair queuing charged each request its estimate and never corrected it:
    for equal real work (20 tokens each), the tenant whose estimate was 250 got 1 of the
    first 10 grants. Each release now puts the real usage in place of the estimate before
    its slot is handed on, and the two tenants alternate."""
    await fleet.worker(capacity=1)
    gw = await fleet.gateway(queue_timeout_s=60, max_queue=1000)
    (current,) = await gw.acquire(fleet.ask(tenant="C"))
    tenant_of: dict[asyncio.Task[list[Lease]], str] = {}
    for _ in range(6):
        for tenant, cost in (("A", 20), ("B", 250)):
            tenant_of[asyncio.create_task(gw.acquire(fleet.ask(tenant=tenant, cost=cost)))] = tenant
    await _queued(fleet, 12)
    order: list[str] = []
    for _ in range(10):
        await gw.release(current, {"prompt_tokens": 4, "completion_tokens": 16})
        done, _ = await asyncio.wait(list(tenant_of), timeout=5, return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        order.append(tenant_of.pop(task))
        (current,) = task.result()
    assert order == ["A", "B"] * 5, order
    for task in tenant_of:
        task.cancel()
    await asyncio.gather(*tenant_of, return_exceptions=True)
    await gw.release(current)


async def test_a_request_the_fleet_can_no_longer_hold_does_not_block_the_queue(fleet: Fleet) -> None:
    """Regression (a sibling of the urgent-headroom one): an n=8 queued on two cap-4 workers
    could never be granted once one of them left, and held back every request behind it
    until its queue timeout. It now gets 503 at once and the next request is served."""
    await fleet.worker(capacity=4, worker_id="a")
    await fleet.worker(capacity=4, worker_id="b")
    gw = await fleet.gateway(queue_timeout_s=30)
    (held,) = await gw.acquire(fleet.ask(tenant="B", cost=1000))  # B's next request starts after A's
    eight = asyncio.create_task(gw.acquire(fleet.ask(tenant="A", need=8)))
    await _queued(fleet, 1)
    one = asyncio.create_task(gw.acquire(fleet.ask(tenant="B")))
    await _queued(fleet, 2)
    # The held slot's worker leaves (its heartbeat ran out): 4 slots live, the n=8 needs 8.
    await fleet.redis.hset(keys.alive(fleet.model), held.worker_id, 0)  # type: ignore[attr-defined]
    await gw.release(held)
    with pytest.raises(Unavailable):
        await asyncio.wait_for(eight, 5)
    (lease,) = await asyncio.wait_for(one, 5)
    assert lease.worker_id != held.worker_id
    await gw.release(lease)


async def test_requests_go_only_to_workers_serving_their_task(fleet: Fleet) -> None:
    """A model served by a generating worker and an embedding one: each request is granted a
    slot only on a worker serving its task, and a task nobody serves is a 400 naming it."""
    await fleet.worker(capacity=4, worker_id="gen", tasks=("generate", "tokenize"))
    await fleet.worker(capacity=4, worker_id="emb", tasks=("embed", "score", "tokenize"))
    gw = await fleet.gateway(queue_timeout_s=5)
    embeds = [lease for _ in range(4) for lease in await gw.acquire(fleet.ask(task="embed"))]
    generations = [lease for _ in range(4) for lease in await gw.acquire(fleet.ask())]
    assert {x.worker_id for x in embeds} == {"emb"}
    assert {x.worker_id for x in generations} == {"gen"}
    for lease in embeds + generations:
        await gw.release(lease)
    with pytest.raises(InvalidRequest) as refused:
        await gw.acquire(fleet.ask(task="classify"))  # type: ignore[arg-type]
    assert refused.value.code == "task_not_served" and "classify" in refused.value.message


async def test_a_waiting_embedding_does_not_hold_back_generations(fleet: Fleet) -> None:
    """Regression: the queue's scan stopped at the first tenant head it could not grant; an
    embedding request waiting for the (full) embedding worker held back every generation
    behind it while the generating worker sat idle. It is now passed over, and the slots it
    waits for are kept for it: a release of the embedding worker goes to it."""
    await fleet.worker(capacity=1, worker_id="gen")
    await fleet.worker(capacity=1, worker_id="emb", tasks=("embed",))
    gw = await fleet.gateway(queue_timeout_s=30)
    (busy,) = await gw.acquire(fleet.ask(task="embed", tenant="A"))
    waiting = asyncio.create_task(gw.acquire(fleet.ask(task="embed", tenant="A")))
    await _queued(fleet, 1)
    (generation,) = await asyncio.wait_for(gw.acquire(fleet.ask(tenant="B")), 5)
    assert generation.worker_id == "gen"
    assert not waiting.done()
    await gw.release(busy)
    (embedding,) = await asyncio.wait_for(waiting, 5)
    assert embedding.worker_id == "emb"
    await gw.release(embedding)
    await gw.release(generation)


async def test_a_queued_hop_waits_for_a_worker_of_its_role(fleet: Fleet) -> None:
    """Prefill/decode hops (gateway/relay/disagg.py) take only workers of their role, also
    when granted from the queue: a free prefill slot is no slot for a waiting decode hop.
    Decode hops are boosted, as the gateway sends them (their prefill hop already waited)."""
    await fleet.worker(capacity=1, worker_id="pre", role="prefill")
    await fleet.worker(capacity=1, worker_id="dec", role="decode")
    gw = await fleet.gateway(queue_timeout_s=30)
    (decoding,) = await gw.acquire(fleet.ask(role="decode", boost=True))
    assert decoding.worker_id == "dec"
    waiting = asyncio.create_task(gw.acquire(fleet.ask(role="decode", boost=True)))
    await _queued(fleet, 1)
    (prefilling,) = await asyncio.wait_for(gw.acquire(fleet.ask(role="prefill")), 5)
    assert prefilling.worker_id == "pre"
    await gw.release(prefilling)  # its release hands the slot on, in the same script: not to the decode hop
    assert sum([int(await fleet.redis.zcard(q)) for q in keys.queues(fleet.model)]) == 1  # type: ignore[attr-defined]
    await gw.release(decoding)
    (granted,) = await asyncio.wait_for(waiting, 5)
    assert granted.worker_id == "dec"
    (whole,) = await gw.acquire(fleet.ask())  # a whole request: any worker
    for lease in (granted, whole):
        await gw.release(lease)


@pytest.fixture
async def private() -> AsyncIterator[Fleet]:
    """A fleet on a Redis server of its own: nothing else's commands in its ``commandstats``
    (the suite's other workers and gateways beat on the shared one throughout)."""
    server = EmbeddedRedis().start()
    client = await create_pool(server.url, max_connections=16)
    f = Fleet(client, server.url)
    yield f
    await f.close()
    await client.aclose()
    server.stop()


async def test_what_a_request_costs_redis_does_not_grow_with_the_fleet(private: Fleet) -> None:
    """Regression: ACQUIRE read each worker's liveness and slot count with a call per worker,
    and each RELEASE, with nobody waiting, read every worker again to hand its slot on: the
    Redis CPU an admitted request costs grew with the workers (64: 535 µs a request, 256:
    2,918; ``loadtest/admission_cost.py``), and with it the ceiling on the whole fleet's
    admission rate. The registry's reads a request makes are now the same for 1 worker or 33.
    On a server of its own: on the shared one, the other tests' processes' reads during the
    measured requests counted too (a loaded CI run: 90 and 265)."""
    fleet = private
    await fleet.worker(capacity=4)
    gw = await fleet.gateway()

    async def reads_for(requests: int) -> int:
        """HGET and HGETALL calls (scripts' own included) for ``requests`` admitted one at a time."""
        async def calls() -> int:
            stats = await fleet.redis.info("commandstats")  # type: ignore[attr-defined]
            return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("hget", "hgetall"))
        before = await calls()
        for _ in range(requests):
            (lease,) = await gw.acquire(fleet.ask())
            await gw.release(lease)
        return await calls() - before

    one = await reads_for(10)
    for _ in range(32):
        await fleet.worker(capacity=4)
    many = await reads_for(10)
    # Before: 2 x 32 more per ACQUIRE and as many per RELEASE, 1,280 more in all.
    assert many - one < 40, (one, many)


async def test_a_worker_that_beat_again_between_acquire_and_the_gateway_s_look_is_asked_again(fleet: Fleet) -> None:
    """Regression (CI, a loaded Cluster: 210 of 600 requests refused): ACQUIRE found the only
    worker's heartbeat lapsed and answered 'none'; the worker beat again before the gateway
    counted the live workers, and the request was refused with "every live worker failed
    this request" though no worker had been tried. It is asked again, and granted."""
    worker = await fleet.worker(capacity=1)
    gw = await fleet.gateway()
    await fleet.redis.hset(keys.alive(fleet.model), worker, 1)  # type: ignore[attr-defined]  # lapsed long ago
    ask_once = gw._ask

    async def ask_then_beat(ask: Ask, timeout_s: float) -> list[object]:
        answer = await ask_once(ask, timeout_s)
        await fleet._workers[0].beat()  # the worker's next beat lands just after ACQUIRE
        return answer

    gw._ask = ask_then_beat  # type: ignore[method-assign]
    (lease,) = await gw.acquire(fleet.ask())
    assert lease.worker_id == worker
    await gw.release(lease)


async def test_admission_routes_from_facts_records_and_workers_without_facts(fleet: Fleet) -> None:
    """A worker that serves generation alone, in both roles, without adapters is routed from
    its facts ("<capacity> <url>": no JSON decoded at each request), any other from its
    record; a worker of a version before the facts (its record and heartbeat only) is still
    granted, and the reap gives it facts. Each lease names its worker's own URL."""
    async def worker(worker_id: str, **fields: object) -> str:
        return await fleet.worker(2, worker_id, url=f"http://127.0.0.1:9/{worker_id}", **fields)  # type: ignore[arg-type]

    workers = [await worker("plain"), await worker("tasks", tasks=("generate", "embed")),
               await worker("prefill", role="prefill"),
               await worker("lora", record=lambda: {"loras": [], "lora_max": 2}), await worker("older")]
    routing = keys.routing(fleet.model)
    facts = await fleet.redis.hgetall(routing)  # type: ignore[attr-defined]
    assert facts[b"plain"] == b"2 http://127.0.0.1:9/plain"
    for worker in (b"tasks", b"prefill", b"lora"):
        assert facts[worker] == await fleet.redis.hget(keys.workers(fleet.model), worker)  # type: ignore[attr-defined]
    await fleet.redis.hdel(routing, "older")  # type: ignore[attr-defined]
    gw = await fleet.gateway()
    leases = await gw.acquire(fleet.ask(need=10))  # every slot of the five
    assert sorted(lease.worker_id for lease in leases) == sorted(2 * workers)
    assert all(lease.url == f"http://127.0.0.1:9/{lease.worker_id}" for lease in leases)
    for lease in leases:
        await gw.release(lease)
    await gw.reap_once()
    assert await fleet.redis.hget(routing, "older") == b"2 http://127.0.0.1:9/older"  # type: ignore[attr-defined]


async def test_the_reap_mends_stale_facts_and_drops_those_of_workers_gone(fleet: Fleet) -> None:
    """Facts that differ from their worker's record (a worker id run again by a version that
    writes none) are made again from the record by the next reap; a worker whose heartbeat a
    gateway deleted (nothing answered at its address) leaves the registry at the next reap,
    and one whose heartbeat lapsed at the next request. A beat puts everything back."""
    stale, unreachable, lapsed = [await fleet.worker(capacity=2) for _ in range(3)]
    gw = await fleet.gateway()
    routing = keys.routing(fleet.model)
    await fleet.redis.hset(routing, stale, "9 http://127.0.0.1:1/stale")  # type: ignore[attr-defined]
    await gw.unreachable(Lease(model=fleet.model, lease_id="x", worker_id=unreachable, url=""))
    await gw.reap_once()
    assert await fleet.redis.hget(routing, stale) == b"2 http://127.0.0.1:9"  # type: ignore[attr-defined]
    for key in (keys.workers(fleet.model), routing):
        assert unreachable.encode() not in await fleet.redis.hkeys(key)  # type: ignore[attr-defined]
    await fleet.redis.hset(keys.alive(fleet.model), lapsed, 1)  # type: ignore[attr-defined]  # lapsed long ago
    (lease,) = await gw.acquire(fleet.ask())
    assert lease.worker_id == stale
    await gw.release(lease)
    assert sorted(await fleet.redis.hkeys(routing)) == [stale.encode()]  # type: ignore[attr-defined]
    for registration in fleet._workers:
        await registration.beat()
    assert len(await fleet.redis.hkeys(routing)) == 3  # type: ignore[attr-defined]
