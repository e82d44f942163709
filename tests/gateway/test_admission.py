"""The shared priority queue: order across replicas, deadlines, cancellation, leases, overload."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from sluice import keys
from tests.conftest import running, wait_for


#: For tests of the admission logic itself: the Lua scripts and the gateway code are the same
#: on a Cluster, reached through its client, whose parts (queueing, grants across gateways,
#: cancelling a queued request, the reaper, the connection bound) the tests left on both
#: topologies exercise. (Each Cluster variant cost the suite 3-9 s.)
SINGLE_ONLY = pytest.mark.parametrize("backend", ["single"], indirect=True)


def _inflight(client, model: str) -> int:
    return sum(int(v) for v in client.hvals(keys.inflight(model)))


def _queued(client, model: str) -> int:
    return sum(client.zcard(q) for q in keys.queues(model))


def _hold_slot(gateway_url: str, model: str, tokens: int) -> threading.Thread:
    """A long streaming request that occupies one slot until it finishes."""

    def run() -> None:
        body = {"model": model, "prompt": "blocker", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", gateway_url + "/v1/completions", json=body, timeout=60) as resp:
                for _ in resp.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the gateway-kill test cuts these streams on purpose

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def _completion_order(gateways: list[str], model: str, plan: list[tuple[str, int]]) -> list[str]:
    """Submit requests (name, priority) 40 ms apart, round-robin over gateways; return finish order."""
    order: list[str] = []
    clients = [openai.AsyncOpenAI(base_url=g + "/v1", api_key="x", max_retries=0, timeout=60) for g in gateways]

    async def one(i: int, name: str, priority: int) -> None:
        await clients[i % len(clients)].completions.create(
            model=model, prompt=name, max_tokens=3, extra_body={"priority": priority, "ignore_eos": True}
        )
        order.append(name)

    tasks = []
    for i, (name, priority) in enumerate(plan):
        tasks.append(asyncio.create_task(one(i, name, priority)))
        await asyncio.sleep(0.04)
    await asyncio.gather(*tasks)
    for c in clients:
        await c.close()
    return order


# Two replicas on a Cluster: grants reach the gateway that queued each request.
@pytest.mark.parametrize(("backend", "replicas"), [("single", 1), ("single", 2), ("cluster", 2)],
                         indirect=["backend"])
async def test_high_priority_admitted_first(start_worker, start_gateway, backend, replicas) -> None:
    model = f"prio-{replicas}"
    start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=10, sim_ttft_ms=0)
    gateways = [start_gateway(redis_at=backend.url).url for _ in range(replicas)]
    blocker = _hold_slot(gateways[0], model, tokens=300)  # 3 s: the plan queues well within it, even under load
    await asyncio.to_thread(wait_for, lambda: _inflight(backend.client, model) == 1, 5, "the blocker")
    plan = [(f"low{i}", 5) for i in range(3)] + [(f"high{i}", -5) for i in range(3)]
    order = await _completion_order(gateways, model, plan)
    blocker.join(10)
    # Across two gateways, requests sent 40 ms apart can reach Redis in another order on a
    # loaded machine (a CI run: high1 before high0); what is tested is that every high one
    # goes before every low one.
    assert (order[:3] if replicas == 1 else sorted(order[:3])) == ["high0", "high1", "high2"], order
    assert sorted(order[3:]) == ["low0", "low1", "low2"], order


def test_queue_timeout_is_429_then_sdk_retry_succeeds(start_worker, start_gateway, backend) -> None:
    model = "qtimeout"
    start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=10, sim_ttft_ms=0)
    gateway = start_gateway(env={"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "0.5"}, redis_at=backend.url)
    # 3 s: the request queues and times out well within it, even under load (a CI run of
    # a1de09f, four test processes on two cores and a Cluster: with 1.2 s the blocker ended
    # before the request's 0.5 s in the queue did, and it was served).
    blocker = _hold_slot(gateway.url, model, tokens=300)
    wait_for(lambda: _inflight(backend.client, model) == 1, 5, "the blocker")
    started = time.monotonic()
    resp = httpx.post(gateway.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 429, f"{resp.status_code} after {time.monotonic() - started:.2f} s"
    assert 0.4 < time.monotonic() - started < 3
    assert 1 <= int(resp.headers["retry-after"]) <= 60
    assert resp.json()["error"]["type"] == "rate_limit_error"
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=5) as client:
        done = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert done.choices[0].finish_reason == "length"
    blocker.join(10)


def test_a_deadline_that_ends_the_queue_wait_is_a_504_not_a_queue_timeout(start_worker, start_gateway,
                                                                          backend) -> None:
    """The queue waits at most the request's time left; when that, not the queue timeout,
    ends the wait, the answer is the deadline's (a re-sent POST with no time left was told
    429 "no capacity within the queue timeout" without waiting at all: the nemesis)."""
    model = "qdeadline"
    start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=10, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)  # queue timeout 30 s
    blocker = _hold_slot(gateway.url, model, tokens=300)
    wait_for(lambda: _inflight(backend.client, model) == 1, 5, "the blocker")
    started = time.monotonic()
    resp = httpx.post(gateway.url + "/v1/completions", headers={"X-Sluice-Timeout-Ms": "800"},
                      json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["type"] == "timeout" and resp.json()["error"]["code"] != "queue_timeout"
    # The queue's own answer; on a loaded machine the request's bound (its deadline and a
    # second's grace) may answer first, while the queue lets go of its entry (a CI run, Cluster).
    message = resp.json()["error"]["message"]
    assert "waited for a slot of 'qdeadline'" in message or "deadline passed before it could be answered" in message
    # Well before the queue's 30 s, whatever the load (3.2 s in a CI run whose four shards,
    # vLLM starting in one, held both cores: Cluster).
    assert 0.7 < time.monotonic() - started < 6
    blocker.join(10)


def test_disconnect_while_queued_and_while_streaming(start_worker, start_gateway, backend) -> None:
    model = "cancel"
    worker = start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)
    body = {"model": model, "prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as streaming:
        lines = streaming.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(lines)
        # A second request queues behind the first; its client gives up after 0.5 s.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/completions",
                       json={"model": model, "prompt": "queued", "max_tokens": 2}, timeout=0.5)
        wait_for(lambda: _queued(backend.client, model) == 0, 3, "the queued request to leave")
        assert _inflight(backend.client, model) == 1
    # The streaming client hung up: the engine aborts and the slot comes back.
    wait_for(lambda: _inflight(backend.client, model) == 0, 2, "the slot to come back")
    wait_for(lambda: running(worker) == 0, 3, "the abort")  # (its own end: 10 s)
    assert backend.client.zcard(keys.leases(model)) == 0


@SINGLE_ONLY
def test_non_streaming_client_that_hangs_up_frees_its_slot(start_worker, start_gateway, backend) -> None:
    """A JSON request runs in the request's own task, with a watcher for its client
    (gateway/relay/rendering.py): a client gone mid-generation still aborts it."""
    model = "cancel-json"
    worker = start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)
    body = {"model": model, "prompt": "long", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: _inflight(backend.client, model) == 0, 3, "the slot to come back")
    wait_for(lambda: running(worker) == 0, 3, "the abort")  # (its own end: 10 s)
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert done.choices[0].finish_reason == "length"


@SINGLE_ONLY
def test_worker_500_before_first_token_is_retried_elsewhere(start_worker, start_gateway, backend) -> None:
    model = "flaky"
    start_worker(model, redis_at=backend.url, sim_fail_first=1000)
    start_worker(model, redis_at=backend.url)
    gateway = start_gateway(redis_at=backend.url)
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
        reference = None
        for _ in range(12):
            resp = client.completions.create(model=model, prompt="same", max_tokens=6, seed=3)
            assert len(resp.choices) == 1 and resp.choices[0].finish_reason == "length"
            assert resp.usage is not None and resp.usage.completion_tokens == 6
            reference = reference or resp.choices[0].text
            assert resp.choices[0].text == reference  # one generation, never a spliced one


def test_sigkill_gateway_its_leases_come_back(start_worker, start_gateway, backend) -> None:
    model = "lease"
    start_worker(model, redis_at=backend.url, sim_max_seqs=4, sim_token_ms=10)
    env = {"SLUICE_GATEWAY_LEASE_TTL_S": "1.5", "SLUICE_GATEWAY_REAP_INTERVAL_S": "0.3"}
    doomed = start_gateway(env=env, redis_at=backend.url)
    start_gateway(env=env, redis_at=backend.url)  # the survivor, whose reaper reclaims the leases
    for _ in range(2):
        _hold_slot(doomed.url, model, tokens=1000)
    wait_for(lambda: _inflight(backend.client, model) == 2, 5, "two leases")
    killed_at = time.monotonic()
    doomed.kill()
    wait_for(lambda: _inflight(backend.client, model) == 0, 8, "the dead gateway's slots")
    # lease TTL, a reap interval (the reap lock is shared with the session's other gateways),
    # and a loaded machine's slack: the bug was never, or 15 s
    assert time.monotonic() - killed_at < 1.5 + 1.0 + 3.0
    assert backend.client.zcard(keys.leases(model)) == 0


@SINGLE_ONLY
async def test_4x_overload_answers_fast_and_clean(start_worker, start_gateway, backend) -> None:
    model = "overload"
    start_worker(model, redis_at=backend.url, sim_max_seqs=4, sim_token_ms=5, sim_ttft_ms=0)
    env = {"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "1", "SLUICE_GATEWAY_MAX_QUEUE": "6"}
    gateway = start_gateway(env=env, redis_at=backend.url)
    statuses: list[int] = []
    durations: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        started = time.monotonic()
        resp = await client.post(
            "/v1/completions",
            json={"model": model, "prompt": f"p{i}", "max_tokens": 40, "ignore_eos": True},
        )
        durations.append(time.monotonic() - started)
        statuses.append(resp.status_code)
        if resp.status_code != 200:
            assert resp.status_code in (429, 503), resp.text
            assert int(resp.headers["retry-after"]) >= 1
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20, limits=limits) as client:
        # Capacity 4 and ~0.2 s per request: 64 at once is far beyond 4x what it can take.
        await asyncio.gather(*(one(client, i) for i in range(64)))
    assert statuses.count(200) >= 4
    assert statuses.count(429) >= 16
    # Nobody waits past the queue timeout plus one generation (and scheduling slack: a CI run of
    # four pytest processes on 2 cores once held this gateway's first answers ~2.4 s).
    assert max(durations) < 1 + 0.5 + 4.0, max(durations)


@SINGLE_ONLY
async def test_clients_sharing_an_x_request_id_never_share_a_slot(start_worker, start_gateway, backend) -> None:
    """Regression: lease ids came from X-Request-Id, so equal ids collided and leaked a slot."""
    model = "same-id"
    start_worker(model, redis_at=backend.url, sim_max_seqs=1, sim_token_ms=5, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answers = await asyncio.gather(*(
            client.post("/v1/completions", headers={"x-request-id": "dup"},
                        json={"model": model, "prompt": f"p{i}", "max_tokens": 5, "ignore_eos": True})
            for i in range(4)
        ))
    assert [a.status_code for a in answers] == [200] * 4
    wait_for(lambda: _inflight(backend.client, model) == 0, 2, "every slot back")


@SINGLE_ONLY
def test_non_streaming_client_that_leaves_frees_the_engine(start_worker, start_gateway, backend) -> None:
    """Regression: a non-streaming request kept generating after its client left."""
    model = "leave-json"
    worker = start_worker(model, redis_at=backend.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/completions", timeout=0.5,
                   json={"model": model, "prompt": "x", "max_tokens": 500, "ignore_eos": True})
    wait_for(lambda: _inflight(backend.client, model) == 0, 2, "the slot")
    wait_for(lambda: running(worker) == 0, 3, "the engine abort")  # (its own end: 10 s)


@SINGLE_ONLY
def test_headroom_only_while_urgent_traffic_is_around(start_worker, start_gateway, backend) -> None:
    model = "headroom"
    start_worker(model, redis_at=backend.url, sim_max_seqs=8, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=backend.url)

    def fill(n: int) -> list[threading.Thread]:
        return [_hold_slot(gateway.url, model, tokens=100) for _ in range(n)]

    threads = fill(8)  # no urgent request yet: all 8 slots are usable
    wait_for(lambda: _inflight(backend.client, model) == 8, 5, "8 default-priority streams")
    for t in threads:
        t.join(15)
    wait_for(lambda: _inflight(backend.client, model) == 0, 5, "the slots back")
    urgent = httpx.post(gateway.url + "/v1/completions",
                        json={"model": model, "prompt": "u", "max_tokens": 1, "priority": -5})
    assert urgent.status_code == 200
    threads = fill(8)  # now one slot in eight is kept for urgent requests
    wait_for(lambda: _queued(backend.client, model) == 1, 5, "one default request queued")
    assert _inflight(backend.client, model) == 7
    for t in threads:
        t.join(15)


def _gateway_connections(client, pid: int) -> int:
    """The most Redis connections any one node holds for the gateway process ``pid``."""
    nodes = client.get_primaries() if hasattr(client, "get_primaries") else [None]
    most = 0
    for node in nodes:
        listing = client.client_list() if node is None else client.client_list(target_nodes=node)
        most = max(most, sum(1 for c in listing if c.get("name") == f"sluice-gateway-{pid}"))
    return most


async def test_600_queued_streams_cost_a_bounded_number_of_connections(start_worker, start_gateway, backend) -> None:
    """Regression: every queued request parked its own Redis connection in BLPOP; past the
    pool's 100, every Redis call of the gateway failed and live workers answered 503."""
    model = "flood"
    # A beat a second (alive 3 s): its 600 streams' scripts on a loaded CI held up a 200 ms
    # beat past its 600 ms, and 64 requests found "no live worker" (2026-12-05).
    start_worker(model, redis_at=backend.url, sim_max_seqs=8, sim_token_ms=2, sim_ttft_ms=0, heartbeat_ms=1000)
    gateway = start_gateway(env={"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "120", "SLUICE_REDIS_MAX_CONNECTIONS": "16"},
                            redis_at=backend.url)
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, await asyncio.to_thread(_gateway_connections, backend.client, gateway.pid))
            await asyncio.sleep(0.1)

    refusals: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": f"p{i}", "max_tokens": 4, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = [line async for line in resp.aiter_lines()]
            if resp.status_code != 200:
                refusals.append(" ".join(lines)[:300])
            return resp.status_code

    watcher = asyncio.create_task(watch())
    limits = httpx.Limits(max_connections=700)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120, limits=limits) as client:
        statuses = await asyncio.gather(*(one(client, i) for i in range(600)))
    done.set()
    await watcher
    # What the gateway said other than access lines: why an attempt failed (a flake on a
    # Cluster, where some requests got "every live worker failed": the cause is not known yet).
    said = [line for line in gateway.log_tail(4000).splitlines() if '"msg":"access ' not in line][-12:]
    assert statuses.count(200) == 600, "\n".join([str(sorted(set(statuses))), *refusals[:2], *said])  # a str: shown whole
    assert 0 < peak <= 16, peak
    wait_for(lambda: _inflight(backend.client, model) == 0, 5, "every slot back")


@SINGLE_ONLY
async def test_two_n2_requests_on_two_slots_do_not_deadlock(start_worker, start_gateway, backend) -> None:
    """Regression: each generation was admitted on its own; two n=2 requests took one slot
    each and waited for the second until both timed out."""
    model = "pairs"
    start_worker(model, redis_at=backend.url, sim_max_seqs=2, sim_token_ms=5, sim_ttft_ms=0)
    gateway = start_gateway(env={"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "20"}, redis_at=backend.url)
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        started = time.monotonic()
        answers = await asyncio.gather(*(
            client.completions.create(model=model, prompt=f"p{i}", max_tokens=20, n=2,
                                      extra_body={"ignore_eos": True})
            for i in range(4)
        ))
    assert all(len(a.choices) == 2 for a in answers)
    assert time.monotonic() - started < 10


@SINGLE_ONLY
async def test_urgent_headroom_never_blocks_the_queue(start_worker, start_gateway, backend) -> None:
    """Regression: a normal n=8 queued on a cap-8 worker became ungrantable after one
    urgent request (the reserve left it 7 slots) and everything behind it got 429 with
    8 of 8 slots free; the same n=8 was then refused (400) for a minute. Now the n=8 gets
    the worker once it drains, the request behind it follows, and n=8 stays valid."""
    model = "headroom-n"
    start_worker(model, redis_at=backend.url, sim_max_seqs=8, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(env={"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "8"}, redis_at=backend.url)
    # 3 s: the n=8 below must reach the queue while it runs (at 1.2 s, a loaded machine could
    # be too slow, as test_queue_timeout's blocker was).
    blocker = _hold_slot(gateway.url, model, tokens=150)
    await asyncio.to_thread(wait_for, lambda: _inflight(backend.client, model) == 1, 5, "the blocker")

    refusals: list[str] = []

    async def ask(client: httpx.AsyncClient, n: int, priority: int = 0) -> int:
        body = {"model": model, "prompt": "p", "max_tokens": 2, "n": n, "priority": priority}
        resp = await client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            refusals.append(f"n={n}: {resp.status_code} {resp.text[:300]}")
        return resp.status_code

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        eight = asyncio.create_task(ask(client, 8))
        await asyncio.to_thread(wait_for, lambda: _queued(backend.client, model) == 1, 5, "the n=8 queued")
        assert await ask(client, 1, priority=-5) == 200, refusals  # urgent: the reserve is on from here
        one = asyncio.create_task(ask(client, 1))
        assert [await eight, await one] == [200, 200], (refusals, gateway.log_tail(20))
        assert await ask(client, 8) == 200
    blocker.join(10)
