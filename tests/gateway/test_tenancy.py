"""API keys, per-key limits across replicas, priority ceilings and request caps.

These run against a private Redis: a key in the shared one would switch every
other test's gateway to authenticated mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
import redis

from engine_worker.engines.sim import SimSequence
from sluice import keys
from sluice.embedded_redis import EmbeddedRedis, free_port
from tests.conftest import ROOT, wait_for

MODEL = "tenant"


@pytest.fixture(scope="module")
def tenant_redis():
    with EmbeddedRedis() as server:
        yield server.url


def _keys(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice", "keys", *args, "--redis-url", redis_url],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def _create(redis_url: str, *flags: str) -> str:
    result = _keys(redis_url, "create", "--name", "test", *flags)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("sk-sluice-") and len(key) > 50
    return key


@pytest.fixture(scope="module")
def tenant(tenant_redis, start_worker, start_gateway):
    worker = start_worker(MODEL, redis_at=tenant_redis, sim_token_ms=0, sim_ttft_ms=0)
    env = {"SLUICE_GATEWAY_MAX_MESSAGES": "3"}
    # The key first: gateways that start with a key enforce keys at once ("auto" auth would
    # otherwise notice it at its next check, up to 2 s later).
    key = _create(tenant_redis, "--tier", "priority")
    gateways = [start_gateway(redis_at=tenant_redis, env=env) for _ in range(2)]
    return worker, gateways, key


def _served(worker) -> int:
    return int(httpx.get(worker.url + "/health").json()["worker"]["served"])


def test_missing_wrong_and_revoked_keys_are_401(tenant, tenant_redis) -> None:
    _, gateways, _ = tenant
    url = gateways[0].url
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-sluice-00000000-nope"}, {"Authorization": "Basic abc"}):
        resp = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
        assert "sk-sluice" not in resp.text  # never echo what was sent
    doomed = _create(tenant_redis)
    with openai.OpenAI(base_url=url + "/v1", api_key=doomed, max_retries=0) as client:
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        prefix = doomed.split("-")[2]
        assert _keys(tenant_redis, "revoke", prefix).returncode == 0
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    listing = _keys(tenant_redis, "list").stdout
    assert prefix in listing and doomed not in listing


def test_valid_key_gets_rate_limit_headers_and_priority_ceiling(tenant, tenant_redis) -> None:
    _, gateways, _ = tenant
    key = _create(tenant_redis, "--tier", "free")  # ceiling 10
    resp = httpx.post(gateways[0].url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": -50})
    assert resp.status_code == 200
    assert resp.headers["x-ratelimit-limit-requests"] == "60"
    assert int(resp.headers["x-ratelimit-remaining-requests"]) == 59
    assert resp.headers["x-sluice-priority"] == "10"
    assert resp.headers["x-sluice-priority-clamped"] == "true"


async def _hammer(urls: list[str], key: str, body: dict, seconds: float, concurrency: int) -> tuple[int, int, float]:
    """Requests from ``concurrency`` users for ``seconds``, and on until one is limited (at
    most 30 s in all): a CI machine loaded by other work once served fewer than the key's
    budget in 4 s (no 429 at all); the expected counts grow with the time taken."""
    ok = limited = 0
    started = time.monotonic()
    stop, latest = started + seconds, started + 30

    def going() -> bool:
        now = time.monotonic()
        return now < stop or (not limited and now < latest)

    async def user(i: int) -> None:
        nonlocal ok, limited
        async with httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=30,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            while going():
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code == 200:
                    ok += 1
                else:
                    assert resp.status_code == 429, resp.text
                    assert int(resp.headers["retry-after"]) >= 1
                    assert "x-ratelimit-remaining-tokens" in resp.headers
                    limited += 1

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    return ok, limited, time.monotonic() - started


async def test_rpm_holds_across_two_gateways(tenant, tenant_redis) -> None:
    _, gateways, _ = tenant
    # Small budgets: a loaded 2-core CI machine must still exhaust them within the 4 s.
    key = _create(tenant_redis, "--rpm", "60", "--tpm", "10000000", "--max-concurrent", "100")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    ok, limited, elapsed = await _hammer([g.url for g in gateways], key, body, 4.0, 12)
    expected = 60 + 60 / 60 * elapsed
    assert limited > 0
    assert abs(ok - expected) <= 0.05 * expected, (ok, expected)


async def test_tpm_holds_across_two_gateways(tenant, tenant_redis) -> None:
    _, gateways, _ = tenant
    key = _create(tenant_redis, "--rpm", "100000", "--tpm", "1200", "--max-concurrent", "100")
    # "x" is 1 prompt token and its estimate (1 char // 4 + 1) too: estimate == usage.
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True}
    ok, limited, elapsed = await _hammer([g.url for g in gateways], key, body, 4.0, 12)
    expected_tokens = 1200 + 1200 / 60 * elapsed
    assert limited > 0
    assert abs(ok * 21 - expected_tokens) <= 0.05 * expected_tokens, (ok * 21, expected_tokens)


async def test_concurrency_cap(tenant, tenant_redis, start_worker) -> None:
    _, gateways, _ = tenant
    key = _create(tenant_redis, "--max-concurrent", "2")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True}
    slow = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=30, headers=slow) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
    codes = sorted(a.status_code for a in answers)
    assert codes.count(429) >= 1 and codes.count(200) >= 2


async def test_keyed_requests_at_once_share_the_gateways_redis_connections(tenant, tenant_redis, start_gateway) -> None:
    """Each keyed request reads its key's record. Through redis-py's pool every request
    waiting for it at once checked out a connection of its own, and the pool opened one for
    each (61 for 64 concurrent streams in loadtest/peers/profile_gateway.py --api-key), up to
    its bound (SLUICE_REDIS_MAX_CONNECTIONS, 64 per process), which every other Redis user of
    the process shares. The record is now read on the connection the per-request scripts
    share."""
    gateway = start_gateway(redis_at=tenant_redis)  # its own pool, grown by nothing before
    key = _create(tenant_redis, "--rpm", "100000", "--tpm", "10000000", "--max-concurrent", "1000")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    client = redis.Redis.from_url(tenant_redis)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=200)) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200  # warm: its channels open
        opened = client.info("stats")["total_connections_received"]
        for _ in range(3):
            answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(48)))
            assert [a.status_code for a in answers] == [200] * 48
        more = client.info("stats")["total_connections_received"] - opened
    client.close()
    assert more < 8, f"{more} Redis connections opened for 144 keyed requests, 48 at a time"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}] * 4}, "messages"),
        ({"max_tokens": 40000}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["x" * 300]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_caps_are_400_and_reach_no_worker(tenant, extra, param) -> None:
    worker, gateways, key = tenant
    before = _served(worker)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}
    resp = httpx.post(gateways[0].url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert _served(worker) == before


def test_open_gateway_refuses_a_public_address(tmp_path) -> None:
    with EmbeddedRedis() as server:
        result = subprocess.run(
            [sys.executable, "-m", "sluice", "gateway", "--host", "0.0.0.0", "--port", "0",
             "--redis-url", server.url],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
    assert result.returncode == 2
    assert "refusing to serve" in result.stderr and "Traceback" not in result.stderr


def test_a_gateway_told_of_a_tokenizer_folder_without_one_refuses_to_start(tmp_path) -> None:
    """It was a traceback from transformers in every gateway process, at each restart."""
    with EmbeddedRedis() as server:
        result = subprocess.run(
            [sys.executable, "-m", "sluice", "gateway", "--port", "0", "--redis-url", server.url],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
            env={**os.environ, "SLUICE_GATEWAY_TOKENIZER": str(tmp_path)},
        )
    assert result.returncode == 2
    assert "no tokenizer there" in result.stderr and "Traceback" not in result.stderr


def test_streams_are_private_to_their_key(tenant, tenant_redis) -> None:
    _, gateways, key = tenant
    other = _create(tenant_redis)
    idem = uuid.uuid4().hex
    body = {"model": MODEL, "prompt": "mine", "max_tokens": 5, "ignore_eos": True, "stream": True}
    first = httpx.post(gateways[0].url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {key}", "Idempotency-Key": idem})
    assert first.status_code == 200
    assert httpx.get(f"{gateways[0].url}/v1/streams/{idem}").status_code == 401
    theirs = httpx.get(f"{gateways[0].url}/v1/streams/{idem}", headers={"Authorization": f"Bearer {other}"})
    assert theirs.status_code == 404
    mine = httpx.get(f"{gateways[0].url}/v1/streams/{idem}", headers={"Authorization": f"Bearer {key}"})
    assert mine.status_code == 200 and mine.text.rstrip().endswith("data: [DONE]")


def test_a_re_attach_is_a_request_of_its_keys_rpm(tenant, tenant_redis) -> None:
    """Regression (review, 2026-12-07): ``GET /v1/streams/<key>`` was charged nothing, so one
    paid stream was read again without end after its key's RPM was spent (24 reads of a
    4.6 MB journal, 171 ms of the gateway's CPU each). Each is now one request of the key's
    RPM (no tokens), and holds none of its concurrency: a key of one concurrent request may
    re-attach while its stream runs."""
    _, gateways, _ = tenant
    key = _create(tenant_redis, "--rpm", "3", "--tpm", "10000000", "--max-concurrent", "1")
    auth = {"Authorization": f"Bearer {key}"}
    idem = uuid.uuid4().hex
    body = {"model": MODEL, "prompt": "read me again", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = f"{gateways[0].url}/v1/streams/{idem}"
    with httpx.stream("POST", gateways[0].url + "/v1/completions", json=body, timeout=60,
                      headers={**auth, "Idempotency-Key": idem}) as first:  # request 1
        assert first.status_code == 200
        during = httpx.get(url, headers=auth, timeout=60)  # request 2, while the stream runs
        assert during.status_code == 200 and during.text.rstrip().endswith("data: [DONE]"), during.text[-300:]
        first.read()
    statuses = [httpx.get(url, headers=auth, timeout=60).status_code for _ in range(3)]
    assert statuses[0] == 200 and 429 in statuses, statuses  # request 3, then the RPM is spent
    refused = httpx.get(url, headers=auth, timeout=60)
    assert refused.status_code == 429 and "requests per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1


def test_short_deadlines_cannot_reset_the_concurrency_cap(tenant, tenant_redis, start_worker) -> None:
    """Regression: a rejected call with a 1 ms deadline shortened the slot set's expiry."""
    _, gateways, _ = tenant
    start_worker("tenant-slow", redis_at=tenant_redis, sim_token_ms=20, sim_ttft_ms=0)
    key = _create(tenant_redis, "--max-concurrent", "1")
    auth = {"Authorization": f"Bearer {key}"}
    long = {"model": "tenant-slow", "prompt": "x", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateways[0].url + "/v1/completions", json=long, headers=auth, timeout=30) as held:
        lines = held.iter_lines()
        next(lines)
        short = httpx.post(gateways[0].url + "/v1/completions", json={**long, "stream": False},
                           headers={**auth, "X-Sluice-Timeout-Ms": "1"})
        assert short.status_code == 429
        time.sleep(1.5)
        again = httpx.post(gateways[0].url + "/v1/completions", json={**long, "stream": False}, headers=auth)
        assert again.status_code == 429


def test_prompt_lists_are_capped_by_generations(tenant) -> None:
    """Regression: one request with 400 prompts filled the queue with 400 admissions."""
    worker, gateways, key = tenant
    before = _served(worker)
    resp = httpx.post(gateways[0].url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": ["a"] * 400, "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt"
    assert _served(worker) == before


def test_generations_count_against_the_concurrency_cap(tenant, tenant_redis) -> None:
    _, gateways, _ = tenant
    key = _create(tenant_redis, "--max-concurrent", "4")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    too_many = httpx.post(gateways[0].url + "/v1/completions", json={**body, "n": 5}, headers=auth)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    ok = httpx.post(gateways[0].url + "/v1/completions", json={**body, "n": 4}, headers=auth)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_dead_gateways_generations_stop_counting(tenant, tenant_redis, start_worker, start_gateway) -> None:
    """Regression: a killed gateway's running generations held the key's concurrency
    slots until their whole deadline (up to an hour)."""
    _, gateways, _ = tenant
    start_worker("tenant-long", redis_at=tenant_redis, sim_token_ms=20, sim_ttft_ms=0)
    doomed = start_gateway(redis_at=tenant_redis, env={"SLUICE_GATEWAY_LEASE_TTL_S": "1.5"})
    key = _create(tenant_redis, "--max-concurrent", "2")
    auth = {"Authorization": f"Bearer {key}"}
    long = {"model": "tenant-long", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 2}
    held = httpx.stream("POST", doomed.url + "/v1/completions", json=long, headers=auth, timeout=30)
    lines = held.__enter__().iter_lines()
    next(lines)
    short = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(gateways[0].url + "/v1/completions", json=short, headers=auth).status_code == 429
    doomed.kill()
    with contextlib.suppress(httpx.HTTPError):
        held.__exit__(None, None, None)
    deadline = time.monotonic() + 4
    while httpx.post(gateways[0].url + "/v1/completions", json=short, headers=auth).status_code != 200:
        assert time.monotonic() < deadline, "the dead gateway's generations still count"
        time.sleep(0.1)


async def test_fair_share_charges_real_work_not_the_declared_max_tokens(tenant, tenant_redis, start_worker) -> None:
    """Regression: fair queuing charged each request its declared max_tokens and never
    corrected it: against a tenant sending max_tokens=32768, the one that omitted it got
    9 of the first 10 grants for equal real work. Two rounds of 10 queued requests per
    tenant on a one-slot worker, all with the same prompt and seed (equal real work):
    omitted vs 32768 (the charge at grant), then exactly the output's length vs 250 (the
    correction at release). The first 10 grants go 5 and 5."""
    _, gateways, _ = tenant
    model = "tenant-fair"
    start_worker(model, redis_at=tenant_redis, sim_max_seqs=1, sim_token_ms=1, sim_ttft_ms=0)
    prompt = "fair share"
    seed = next(s for s in range(1000) if SimSequence(prompt, s).natural_length <= 40)
    length = SimSequence(prompt, seed).natural_length
    holder = {"Authorization": f"Bearer {_create(tenant_redis, '--tier', 'priority')}"}
    queued = redis.Redis.from_url(tenant_redis)

    async def one(client: httpx.AsyncClient, key: str, max_tokens: int | None, order: list[str]) -> None:
        body = {"model": model, "prompt": prompt, "seed": seed, **({"max_tokens": max_tokens} if max_tokens else {})}
        resp = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == length, resp.text
        order.append(key)

    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=60) as client:
        for limits in ((None, 32768), (length, 250)):
            tenants = [_create(tenant_redis, "--tier", "priority") for _ in limits]
            order: list[str] = []
            async with contextlib.AsyncExitStack() as hold:  # the worker's one slot, until all are queued
                blocker = await hold.enter_async_context(client.stream(
                    "POST", "/v1/completions", headers=holder,
                    json={"model": model, "prompt": "hold", "max_tokens": 30000, "ignore_eos": True, "stream": True}))
                lines = blocker.aiter_lines()  # kept: a dropped iterator closes the stream
                await anext(lines)
                requests = [asyncio.create_task(one(client, key, limit, order))
                            for _ in range(10) for key, limit in zip(tenants, limits, strict=True)]
                await asyncio.to_thread(wait_for, lambda: sum(queued.zcard(q) for q in keys.queues(model)) == 20,
                                        20, "20 queued requests")
            await asyncio.gather(*requests)
            first = order[:10]
            assert first.count(tenants[0]) == 5, [tenants.index(k) for k in order]
    queued.close()


def test_generations_a_failover_forgot_count_again(tenant, tenant_redis, start_worker, start_gateway) -> None:
    """Regression: the concurrency renewal touched existing members only (ZADD XX), so a
    generation whose member Redis lost (a failover that lost the last writes, a restart)
    stopped counting for the rest of its life, and the key could run past its cap."""
    start_worker("tenant-lost", redis_at=tenant_redis, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=tenant_redis, env={"SLUICE_GATEWAY_LEASE_TTL_S": "1.5"})
    key = _create(tenant_redis, "--max-concurrent", "1")
    auth = {"Authorization": f"Bearer {key}"}
    long = {"model": "tenant-lost", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    running = keys.rate_limits(key.removeprefix("sk-sluice-")[:8])[1]
    client = redis.Redis.from_url(tenant_redis)
    with httpx.stream("POST", gateway.url + "/v1/completions", json=long, headers=auth, timeout=30) as held:
        lines = held.iter_lines()  # kept: a dropped generator would close the stream
        next(lines)
        assert client.zcard(running) == 1
        client.delete(running)  # what the promoted replica never received
        deadline = time.monotonic() + 4
        while client.zcard(running) == 0:  # the next renewal (every 0.5 s) puts it back
            assert time.monotonic() < deadline, "the forgotten generation no longer counts"
            time.sleep(0.05)
        short = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert httpx.post(gateway.url + "/v1/completions", json=short, headers=auth).status_code == 429
    client.close()


def test_a_gateway_started_while_redis_is_away_waits_for_it_then_says_why(tmp_path) -> None:
    """Regression: a gateway started while Redis restarted or failed over died at once with
    a traceback (its start-up check's ConnectionError), and one whose Redis never came
    said nothing useful. It waits ``redis_startup_wait_s`` for Redis, logging that it does,
    then refuses with a message."""
    port, gateway_port = free_port(), free_port()
    argv = [sys.executable, "-m", "sluice", "gateway", "--port", str(gateway_port),
            "--redis-url", f"redis://127.0.0.1:{port}/0"]
    refused = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={**os.environ, "SLUICE_GATEWAY_REDIS_STARTUP_WAIT_S": "1"})
    assert refused.returncode == 2
    assert "Redis did not answer" in refused.stderr and "Traceback" not in refused.stderr
    server = EmbeddedRedis(port)
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        gateway = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: "waiting up to 30 s" in log.read_text(), 30, "the gateway to say it waits for Redis")
        assert gateway.poll() is None
        server.start()

        def ready() -> bool:
            assert gateway.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"http://127.0.0.1:{gateway_port}/health", timeout=1).status_code == 200
            return False

        wait_for(ready, 30, "the gateway to start once Redis answers")
    finally:
        gateway.kill()
        gateway.wait()
        server.stop()
