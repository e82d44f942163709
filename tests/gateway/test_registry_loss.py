"""Redis loses its data (FLUSHALL here; a restart without persistence or a failover does the
same to the keys): requests queued at that moment are queued again, and a model whose
workers have not beaten since is a 503 to retry, not a 404."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
import redis

from sluice import keys
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis
from sluice.redis_url import sync_client
from tests.conftest import wait_for, worker_alive


class PrivateRedis:
    """A redis-server of the test's own, which it may restart empty on the same port."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis().start()
        self.url = self.server.url
        self.client = redis.Redis.from_url(self.url)

    def lose_data(self, how: str) -> None:
        if how == "flushall":
            self.client.flushall()
            return
        port = self.server.port
        self.server.stop()  # no persistence: it comes back empty
        self.server = EmbeddedRedis(port=port).start()
        self.client.connection_pool.disconnect()


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    r = PrivateRedis()
    yield r
    r.client.close()
    r.server.stop()


@pytest.fixture
def client(private_redis: PrivateRedis) -> redis.Redis:
    return private_redis.client


def _queued(client: redis.Redis, model: str) -> int:
    return sum(int(client.zcard(q)) for q in keys.queues(model))


def _inflight(client: redis.Redis, model: str) -> int:
    return sum(int(v) for v in client.hvals(keys.inflight(model)))


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_requests_queued_when_redis_loses_its_data_are_queued_again(
    private_redis, client, start_worker, start_gateway, loss,
) -> None:
    """Regression: a request queued when Redis lost its data (a flush, a restart without
    persistence) waited its whole queue timeout and got 429, while requests arriving after
    the loss were served at once."""
    model = "requeue"
    start_worker(model, redis_at=private_redis.url, sim_max_seqs=1, sim_token_ms=10, sim_ttft_ms=0)
    gateway = start_gateway(env={"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "30"}, redis_at=private_redis.url)
    results: dict[str, httpx.Response] = {}

    def post(name: str, tokens: int) -> None:
        body = {"model": model, "prompt": name, "max_tokens": tokens, "ignore_eos": True}
        results[name] = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)

    blocker = threading.Thread(target=post, args=("blocker", 500))  # ~5 s on the only slot
    blocker.start()
    wait_for(lambda: _inflight(client, model) == 1, 30, "the blocker to hold the slot")  # a loaded CI: >10 s once
    waiter = threading.Thread(target=post, args=("waiter", 3))
    waiter.start()
    wait_for(lambda: _queued(client, model) == 1, 10, "the waiter to queue")

    private_redis.lose_data(loss)
    # The running stream holds its slot again, and the waiter waits behind it, queued again.
    wait_for(lambda: _inflight(client, model) == 1 and _queued(client, model) == 1, 10,
             "the blocker's slot leased again and the waiter queued again")

    waiter.join(40)
    blocker.join(40)
    assert results["blocker"].status_code == 200
    assert results["waiter"].status_code == 200, results["waiter"].text  # was 429 after 30 s
    assert "queueing 1 waiting request(s) again" in gateway.log_tail(200)
    assert _inflight(client, model) == 0 and client.zcard(keys.leases(model)) == 0


def test_a_model_unknown_just_after_redis_lost_its_data_is_503_not_404(
    private_redis, client, start_worker, start_gateway,
) -> None:
    """Regression: until its workers' next heartbeat, a model Redis forgot was a 404
    model_not_found, which SDKs do not retry; now a 503 with Retry-After, both from a
    gateway that served the model and from one that never did (the registry is young)."""
    model = "rebuild"
    worker = start_worker(model, redis_at=private_redis.url, sim_token_ms=1, sim_ttft_ms=0)
    served = start_gateway(redis_at=private_redis.url)
    body = {"model": model, "prompt": "x", "max_tokens": 2}
    assert httpx.post(served.url + "/v1/completions", json=body, timeout=10).status_code == 200

    os.kill(worker.pid, signal.SIGSTOP)  # no heartbeat can re-register the model meanwhile
    try:
        client.flushall()
        resp = httpx.post(served.url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        # Within a beat, a gateway that knew the old epoch marks the new one as following a loss.
        wait_for(lambda: client.hget(keys.EPOCH, "lost") is not None, 5, "the new epoch to be marked")
        fresh = start_gateway(redis_at=private_redis.url)  # never served it: the epoch is new
        resp = httpx.post(fresh.url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "registry_rebuilding"
        resp = httpx.get(fresh.url + "/v1/models/" + model, timeout=10)
        assert resp.status_code == 503, resp.text
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: worker_alive(client, model, worker.name), 10, "the worker to register again")
    assert httpx.post(fresh.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_a_model_one_cluster_node_lost_is_503_not_404(start_worker, start_gateway) -> None:
    """Regression (CI, test_key_data_loss on a Cluster): a node restarted empty lost the
    model's directory entry and its workers, while the epoch, on another node, stayed as it
    was; a gateway that had never served the model answered 404 model_not_found (SDKs do not
    retry it) until the worker's next beat. The gateway saw other servers answer, and now
    says 503 registry_rebuilding meanwhile."""
    with EmbeddedCluster() as cluster:
        client = sync_client(cluster.url)
        port_of = lambda key: client.get_node_from_key(key).port  # noqa: E731
        lost_port = port_of(keys.MODELS)
        assert lost_port != port_of(keys.EPOCH)
        # A model whose keys live with the directory: one node's loss takes both.
        model = next(m for m in (f"nodeloss{i}" for i in range(1000)) if port_of(keys.workers(m)) == lost_port)
        worker = start_worker(model, redis_at=cluster.url, sim_token_ms=0, sim_ttft_ms=0)
        gateway = start_gateway(redis_at=cluster.url)
        body = {"model": model, "prompt": "x", "max_tokens": 2}
        os.kill(worker.pid, signal.SIGSTOP)  # no heartbeat can register the model again meanwhile
        try:
            node = next(server for server in cluster.servers if server.port == lost_port)
            node.shutdown(save=False)
            node.start()  # back empty, with its slots (nodes.conf)
            # 20 s: a CI run of four shards side by side took more than 10 (its node came back late).
            wait_for(lambda: "Redis may have lost writes" in gateway.log_tail(50), 20,
                     "the gateway to see other servers answer")
            resp = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "registry_rebuilding"
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        wait_for(lambda: httpx.post(gateway.url + "/v1/completions", json=body, timeout=10).status_code == 200,
                 15, "the worker to register again")
        client.close()
