"""The Redis master dies (SIGKILL) under streaming load: Sentinel or the Cluster promotes its
replica, and the gateway and workers move to it by themselves.

Checked: admission serves again (a new request gets a 200) within the issue's goal of
10 s after the kill; every stream that was running when the master died ends complete and
equal to the simulator's reference; every other request is either served exactly or
refused with a 503 + Retry-After, never a hang, a gap or a changed text. Prints the time to
serve again (``-s``), the figure the README quotes.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest
import redis

from sluice import keys
from sluice.commands.bench_resilience import reference_words
from sluice.embedded_failover import EmbeddedSentinel, ReplicatedCluster, wait_until
from sluice.embedded_redis import EmbeddedRedis
from sluice.redis_url import sync_client

pytestmark = pytest.mark.chaos

MODEL = "failover"
CLIENTS = 8
#: The issue's goal: after a Sentinel or Cluster failover, admission serves again within 10 s.
SERVE_AGAIN_S = 10.0


async def _stream(client: httpx.AsyncClient, i: int, tokens: int = 0,
                  running: set[int] | None = None) -> dict[str, object]:
    """One stream, checked against the simulator's reference; ``running`` holds ``i`` from
    its first content chunk to its end."""
    running = set() if running is None else running
    tokens = tokens or 30 + (i * 7) % 30
    messages = [{"role": "user", "content": f"failover {i}"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "seed": i, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    words: list[str] = []
    errors: list[object] = []
    finish, done = None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"i": i, "status": resp.status_code, "retry_after": resp.headers.get("retry-after"),
                    "started": started, "first": None, "ended": time.monotonic()}
        first = None
        try:
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    data = orjson.loads(line[6:])
                    if "error" in data:
                        errors.append(data["error"])
                        continue
                    if first is None:
                        first = time.monotonic()
                        running.add(i)
                    choice = data["choices"][0]
                    words += (choice["delta"].get("content") or "").split()
                    finish = choice["finish_reason"] or finish
        finally:
            running.discard(i)
    exact = words == reference_words(messages, i, tokens) and finish == "length" and done and not errors
    return {"i": i, "status": 200, "exact": exact, "errors": errors, "done": done, "started": started,
            "first": first, "ended": time.monotonic()}


def _serve_again(base_url: str, killed_at: float) -> float:
    """Seconds from the kill to the first new request served (200)."""
    body = {"model": MODEL, "prompt": "are you back", "max_tokens": 2}
    while True:
        try:
            if httpx.post(base_url + "/v1/completions", json=body, timeout=5).status_code == 200:
                return time.monotonic() - killed_at
        except httpx.HTTPError:
            pass
        assert time.monotonic() - killed_at < SERVE_AGAIN_S, "admission did not serve again in time"
        time.sleep(0.05)


@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_admission_serves_again_after_the_redis_master_is_killed_under_load(
    topology: str, request: pytest.FixtureRequest, start_worker, start_gateway,
) -> None:
    deployment: EmbeddedSentinel | ReplicatedCluster = request.getfixturevalue(
        "sentinel_redis" if topology == "sentinel" else "replicated_cluster")
    flags = {"sim_token_ms": 25, "sim_ttft_ms": 5, "sim_max_seqs": 16}
    for _ in range(2):
        start_worker(MODEL, redis_at=deployment.url, **flags)
    gateway = start_gateway(redis_at=deployment.url)
    stop = threading.Event()
    results: list[dict[str, object]] = []
    running: set[int] = set()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            async def client_loop(c: int) -> None:
                n = 0
                while not stop.is_set():
                    results.append(await _stream(client, c * 1000 + n, running=running))
                    n += 1
                    if results[-1]["status"] != 200:
                        await asyncio.sleep(0.2)  # what Retry-After asks, shortened

            await asyncio.gather(*(client_loop(c) for c in range(CLIENTS)))

    loader = threading.Thread(target=asyncio.run, args=(load(),), daemon=True)
    loader.start()
    try:
        deadline = time.monotonic() + 20
        # Load is flowing, and streams are mid-way when the master dies (on a loaded machine
        # the clients may be between requests at any one instant: CI met none running once).
        while sum(1 for r in results if r["status"] == 200) < CLIENTS or len(running) < 2:
            assert time.monotonic() < deadline, (len(running), results[:3])
            time.sleep(0.01)
        killed_at = time.monotonic()
        killed = _kill_model_master(deployment)
        seconds = _serve_again(gateway.url, killed_at)
        print(f"\nREDIS FAILOVER topology={topology} serve_again_s={seconds:.2f}")
        time.sleep(2)  # streams admitted by the new master run a while too
    finally:
        stop.set()
        loader.join(60)
    assert not loader.is_alive(), "a client hung"
    deployment.wait_promoted(killed)

    in_flight = [r for r in results if r["status"] == 200 and r["started"] < killed_at < r["ended"]]
    assert in_flight, "no stream was running when the master died"
    assert all(r["exact"] for r in in_flight), [r for r in in_flight if not r["exact"]][:3]
    after = [r for r in results if r["status"] == 200 and r["started"] > killed_at + seconds]
    assert after and all(r["exact"] for r in after)
    # Nothing else: a 503 with Retry-After while there was no master, or exact text.
    for r in results:
        if r["status"] == 200:
            assert r["exact"] or all(e.get("type") for e in r["errors"]), r  # type: ignore[union-attr]
        else:
            assert r["status"] == 503 and r["retry_after"], r
    print(f"REDIS FAILOVER topology={topology} streams={len(results)} in_flight_at_kill={len(in_flight)} "
          f"exact={sum(1 for r in results if r.get('exact'))} refused={sum(1 for r in results if r['status'] != 200)} "
          f"in_band_errors={sum(1 for r in results if r.get('errors'))}")


def _range_of(cluster: ReplicatedCluster, key: str) -> int:
    """The index (in slot order) of the slot range that holds ``key``."""
    with redis.Redis(port=cluster.master_ports()[0]) as client:
        slot = int(client.cluster("KEYSLOT", key))
        ranges = sorted(client.execute_command("CLUSTER", "SLOTS"))
    return next(i for i, r in enumerate(ranges) if r[0] <= slot <= r[1])


def _streams_in_background(base_url: str, ids: range, results: list[dict[str, object]]) -> threading.Thread:
    """Long streams (about 5 s): they outlive the failover and their leases' renewals."""
    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            results.extend(await asyncio.gather(*(_stream(client, i, tokens=200) for i in ids)))

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_a_failover_that_lost_writes_serves_again_and_its_slot_counts_converge(
    topology: str, request: pytest.FixtureRequest, start_worker, start_gateway,
) -> None:
    """The replica misses the last writes (its link cut while they were made), then the master
    dies: the promoted replica is Redis as it was a moment earlier. The leases, tenancy
    charges and queue state of the streams admitted in that moment are gone; streams
    released in it hold their slots again. Checked: workers re-register, admission serves
    again, every stream finishes exact, and once they are done no slot stays taken."""
    deployment: EmbeddedSentinel | ReplicatedCluster = request.getfixturevalue(
        "sentinel_redis" if topology == "sentinel" else "replicated_cluster")
    flags = {"sim_token_ms": 25, "sim_ttft_ms": 5, "sim_max_seqs": 16}
    for _ in range(2):
        start_worker(MODEL, redis_at=deployment.url, **flags)
    gateway = start_gateway(redis_at=deployment.url, env={
        "SLUICE_GATEWAY_LEASE_TTL_S": "2", "SLUICE_GATEWAY_REAP_INTERVAL_S": "0.3"})
    client = sync_client(deployment.url)
    results: list[dict[str, object]] = []
    before = _streams_in_background(gateway.url, range(0, 4), results)
    wait_until(lambda: _leases(client) >= 4, 20, "the first streams to be admitted")
    with deployment.replication_cut():
        during = _streams_in_background(gateway.url, range(100, 104), results)
        wait_until(lambda: _leases(client) >= 8, 20, "the streams admitted while the replica missed writes")
        killed_at = time.monotonic()
        killed = _kill_model_master(deployment)
    seconds = _serve_again(gateway.url, killed_at)
    print(f"\nREDIS LOSSY FAILOVER topology={topology} serve_again_s={seconds:.2f}")
    before.join(60)
    during.join(60)
    assert len(results) == 8 and all(r["exact"] for r in results), results
    deployment.wait_promoted(killed)
    # Lost leases were reported, not silently ignored: by the renewal, or by the loss watch,
    # which leases them again (Admission.after_look), whichever saw the loss first.
    log_text = gateway.log_path.read_text()
    assert "expired before renewal" in log_text or "leased again" in log_text
    wait_until(lambda: _leases(client) == 0 and _slots_taken(client) == 0, 30, "every slot to be free again")
    assert int(client.hlen(keys.workers(MODEL))) == 2  # the workers re-registered themselves
    client.close()


def _kill_model_master(deployment: EmbeddedSentinel | ReplicatedCluster) -> EmbeddedRedis:
    """SIGKILL the master that holds this model's keys."""
    if isinstance(deployment, EmbeddedSentinel):
        return deployment.kill_master()
    return deployment.kill_master(_range_of(deployment, keys.workers(MODEL)))


def _leases(client: redis.Redis | redis.RedisCluster) -> int:
    return int(client.zcard(keys.leases(MODEL)))


def _slots_taken(client: redis.Redis | redis.RedisCluster) -> int:
    return sum(int(v) for v in client.hvals(keys.inflight(MODEL)))
