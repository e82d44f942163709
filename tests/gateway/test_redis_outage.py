"""Redis goes away and comes back: 503 + Retry-After meanwhile, running streams finish,
and everything recovers without a restart and without leaked slots."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from sluice import keys
from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import wait_for, worker_alive


@pytest.fixture
def private_redis():
    server = EmbeddedRedis().start()
    holder = {"server": server}
    yield holder
    holder["server"].stop()


def test_redis_outage_and_recovery(private_redis, start_worker, start_gateway) -> None:
    server = private_redis["server"]
    model = "outage"
    worker = start_worker(model, redis_at=server.url, sim_token_ms=10, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    result: dict[str, object] = {}
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": model, "prompt": "outage", "max_tokens": 150, "ignore_eos": True, "stream": True}
        lines = result["lines"] = []
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)  # type: ignore[attr-defined]
                    streaming.set()
        streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(10), "the stream never started"
    server.stop()

    started = time.monotonic()
    resp = httpx.post(gateway.url + "/v1/completions", json={"model": model, "prompt": "x"}, timeout=10)
    assert resp.status_code == 503
    assert int(resp.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 3
    assert httpx.get(gateway.url + "/ready").status_code == 503

    thread.join(10)
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]  # type: ignore[index]

    private_redis["server"] = EmbeddedRedis(port=server.port).start()
    client = redis.Redis.from_url(server.url)
    try:
        deadline = time.monotonic() + 5
        while httpx.get(gateway.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "gateway did not recover"
            time.sleep(0.1)
        # The restarted Redis is empty: the worker is back once its next heartbeat registers it.
        wait_for(lambda: worker_alive(client, model, worker.name), 10, "the worker to register again")
        ok = httpx.post(gateway.url + "/v1/completions",
                        json={"model": model, "prompt": "back", "max_tokens": 3}, timeout=10)
        assert ok.status_code == 200
        assert sum(int(v) for v in client.hvals(keys.inflight(model))) == 0
        assert client.zcard(keys.leases(model)) == 0
    finally:
        client.close()
    assert worker.alive() and gateway.alive()
