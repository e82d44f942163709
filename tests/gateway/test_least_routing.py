"""Least-loaded routing (``SLUICE_GATEWAY_ROUTING=least``) on a real Redis (single server and
a three-master cluster): why it showed 3.4x round robin's TTFT on one H200 (issue 24), and
that it no longer does what caused it.

The cause, in the admission script: least took the single lowest load, ties to the
registry's first worker. In a closed loop the worker a request just left is the least
loaded for its user's next request (its slot was just freed), so every user went back to
the worker it left, forever: the users that the start's burst put on one worker together
prefilled together, decoded together, finished together and came back together, in
lockstep (four such cohorts on one GPU, prefilling at the same time). Least now takes the
workers within one request of the lowest load in turn, from a counter in Redis shared by
every gateway, so balanced workers are taken as round robin takes them.
"""

from __future__ import annotations

from gateway.admission.queue import Admission
from tests.gateway import closed_loop
from tests.gateway import test_queue_scripts as queue_tests
from tests.gateway.test_queue_scripts import Fleet

url, redis, fleet = queue_tests.url, queue_tests.redis, queue_tests.fleet


async def test_least_sends_ties_to_every_worker_not_the_registrys_first(fleet: Fleet) -> None:
    """Regression: equal loads went to the first worker registered, every time."""
    for worker_id in ("a", "b", "c"):
        await fleet.worker(capacity=8, worker_id=worker_id)
    gw = await fleet.gateway(routing="least")
    chosen = []
    for _ in range(6):  # one request at a time: every worker idle at each choice
        (lease,) = await gw.acquire(fleet.ask())
        chosen.append(lease.worker_id)
        await gw.release(lease)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"], chosen


async def test_least_still_fills_the_least_loaded_worker_first(fleet: Fleet) -> None:
    """Taking near-equal workers in turn keeps least's point: a worker more than one
    request below the others gets every request until it is within one of them."""
    await fleet.worker(capacity=8, worker_id="a")
    await fleet.worker(capacity=8, worker_id="b")
    gw = await fleet.gateway(routing="least")
    held = [(await gw.acquire(fleet.ask(exclude=("b",))))[0] for _ in range(5)]
    assert {x.worker_id for x in held} == {"a"}
    after = [(await gw.acquire(fleet.ask()))[0] for _ in range(6)]
    assert [x.worker_id for x in after[:4]] == ["b"] * 4
    assert sorted(x.worker_id for x in after[4:]) == ["a", "b"]  # 5/5: equal again, taken in turn
    for lease in held + after:
        await gw.release(lease)


async def _closed_loop(fleet: Fleet, routing: str, shape: closed_loop.Shape, **settings: object) -> closed_loop.Outcome:
    """The closed loop through two gateways (one counter in Redis serves both)."""
    gateways: list[Admission] = [await fleet.gateway(routing=routing, **settings),
                                 await fleet.gateway(routing=routing, **settings)]
    fleet.model = f"{fleet.model}-{routing}"  # a fresh model: its own workers and counters
    for i in range(shape.workers):
        await fleet.worker(capacity=shape.capacity, worker_id=f"w{i}")
    return await closed_loop.run(gateways, fleet.model, shape)


async def test_least_keeps_no_closed_loop_in_lockstep(fleet: Fleet) -> None:
    """Regression, in virtual time (tests/gateway/closed_loop.py: 4 engines sharing one
    device, 64 users, equal 1,500-token prompts, 32 tokens out, as on the H200): least
    pinned every user to one worker (all 100% of returns went back) and every request of
    a cohort waited for the whole cohort's prefill (TTFT p50 = p90). Now least spreads the
    returns and its TTFT is within 1.2x of round robin's, p50 and p90, where both balance."""
    shape = closed_loop.Shape(requests=640)
    rr = await _closed_loop(fleet, "rr", shape)
    least = await _closed_loop(fleet, "least", shape)
    assert least.same_worker < 0.8, f"{least.same_worker:.0%} of returning users went back where they were"
    assert least.ttft_p50_s <= 1.2 * rr.ttft_p50_s, (least.ttft_p50_s, rr.ttft_p50_s)
    assert least.ttft_p90_s <= 1.2 * rr.ttft_p90_s, (least.ttft_p90_s, rr.ttft_p90_s)
    assert least.ttft_p90_s > least.ttft_p50_s  # not one cohort-wide wait for everyone


async def test_least_with_no_spread_is_the_old_least_for_measuring(fleet: Fleet) -> None:
    """``SLUICE_GATEWAY_ROUTE_LEAST_SPREAD=0`` takes the least loaded alone: the closed loop
    is pinned again (what the GPU bench compares the default against)."""
    pinned = await _closed_loop(fleet, "least", closed_loop.Shape(requests=320), route_least_spread=0)
    assert pinned.same_worker == 1.0
