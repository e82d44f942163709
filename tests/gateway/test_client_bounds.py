"""What one client can grow: names it sends are bounded, and naming a model nobody serves
creates no Redis state and no per-process cache entry that outlives the request."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import Proc


@pytest.fixture(scope="module")
def client(private_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(private_redis.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def gateway(private_redis: EmbeddedRedis, start_worker, start_gateway) -> Proc:
    start_worker("sim", redis_at=private_redis.url, sim_token_ms=1, sim_ttft_ms=0)
    gw = start_gateway(redis_at=private_redis.url)
    body = {"model": "sim", "prompt": "warm", "max_tokens": 2}
    assert httpx.post(gw.url + "/v1/completions", json=body, timeout=10).status_code == 200
    return gw


def _rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def _keys(client: redis.Redis) -> set[bytes]:
    return {k for k in client.keys("*") if k != b"sl:reaper"}  # the reap period's lock comes and goes


def test_a_megabyte_model_name_is_a_400_and_grows_nothing(gateway: Proc, client: redis.Redis) -> None:
    """Regression: 30 requests with 1 MB model names took a gateway from 76 MB to 1.58 GB
    RSS (per-model caches of keys and packed script calls) and Redis by 104 MB (a key per
    name that never expired); each got a 404 echoing the whole name."""
    rss, memory, before = _rss_mb(gateway.pid), client.info("memory")["used_memory"], _keys(client)
    big = "m" * 2**20
    for i in range(30):
        resp = httpx.post(gateway.url + "/v1/completions", json={"model": f"{big}{i}", "prompt": "x"}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
        assert len(resp.content) < 1024
    assert _rss_mb(gateway.pid) - rss < 100  # was +1,500 MB
    assert client.info("memory")["used_memory"] - memory < 2**20  # was +104 MB
    assert _keys(client) - before == set()


def test_invented_models_leave_no_keys(gateway: Proc, client: redis.Redis) -> None:
    """Regression: every invented model name left a key that never expired (200 names, 200
    keys), and a grant listener that held a Redis connection for 10 s."""
    before = _keys(client)
    # One connection for all 400 calls: a new one per call was most of this test's time.
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        for i in range(200):
            resp = http.post("/v1/completions", json={"model": f"invented-{i}", "prompt": "x"})
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
            assert http.get(f"/v1/models/invented-{i}").status_code == 404
    assert _keys(client) - before == set()  # (keys of model "sim" may come and go meanwhile)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": "sim", "prompt": "x", "user": "u" * 257}, "user"),
    # 1,025 spellings of token 1: a map the engine would take (its ids are in the vocabulary).
    ("/v1/completions", {"model": "sim", "prompt": "x", "logit_bias": {"0" * i + "1": 1 for i in range(1025)}},
     "logit_bias"),
    ("/v1/completions", {"model": "s{im}", "prompt": "x"}, "model"),
    ("/v1/chat/completions", {"model": "m" * 257, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/responses", {"model": "sim", "input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("/v1/responses", {"model": "sim", "input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
])
def test_client_named_fields_are_bounded(gateway: Proc, path: str, body: dict[str, object], param: str) -> None:
    """Siblings of the model name: fields a client names that the old gateway took at any size."""
    resp = httpx.post(gateway.url + path, json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_megabyte_name_asked_of_the_models_route_is_a_small_404(gateway: Proc) -> None:
    resp = httpx.get(f"{gateway.url}/v1/models/{'m' * 60_000}", timeout=10)
    assert resp.status_code == 404 and len(resp.content) < 1024


def test_a_client_that_leaves_while_sending_its_body_is_not_a_server_error(gateway: Proc) -> None:
    """Regression (nemesis, Sentinel run: 3 "unhandled error" log entries): a client that
    closed its connection in the middle of its request body raised starlette's
    ClientDisconnect through the handler, logged as an internal error (a 500 nobody read)."""
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"model": "' + b"x" * 1000)
        time.sleep(0.3)  # the gateway is reading the body when the client goes
    time.sleep(1.0)
    log = gateway.log_path.read_text(errors="replace")
    assert "ClientDisconnect" not in log and "unhandled error" not in log, gateway.log_tail()
