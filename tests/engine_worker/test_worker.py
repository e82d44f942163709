"""The worker process: drain on SIGTERM, abort on disconnect."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis

from engine_worker.config import WorkerSettings
from engine_worker.worker import served_name
from sluice import keys
from sluice.models import ModelError
from sluice.embedded_redis import EmbeddedRedis, free_port
from tests.conftest import Proc, _env, running, wait_for, worker_alive


def test_gateway_disconnect_aborts_engine_request(start_worker, start_gateway) -> None:
    worker = start_worker("abort-test", sim_token_ms=20)
    gateway = start_gateway()
    body = {"model": "abort-test", "prompt": "long", "max_tokens": 500, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert running(worker) == 1
    wait_for(lambda: running(worker) == 0, 3.0, "the engine to abort after the client left")  # (10 s to its end)


def test_workers_and_gateways_leave_their_start_up_heap_out_of_garbage_collection(start_worker, start_gateway) -> None:
    """The worker, whose process holds the engine's frontend (vLLM's: 650k objects once
    started, a 255 ms full collection on the CPU machine), never froze its start-up heap as
    the gateway did, so a full collection would stall every stream on it; vLLM's own server
    freezes its heap. Both say how many objects they left out, once serving. (Found looking
    for a TTFT tail on an H100; not shown to be its cause.)"""
    worker = start_worker("gc-test")
    gateway = start_gateway()

    def frozen(proc: Proc) -> int:
        line = next((x for x in proc.log_path.read_text(errors="replace").splitlines()
                     if "left out of the garbage collector" in x), "")
        return int(line.split('"msg":"', 1)[-1].split()[0]) if line else 0

    wait_for(lambda: frozen(worker) > 10_000 and frozen(gateway) > 10_000, 10.0,
             "both processes to report their frozen start-up heap")


def test_sigterm_drains_in_flight_then_exits(start_worker, start_gateway, redis_client) -> None:
    model = "drain-test"
    worker = start_worker(model, sim_token_ms=30)  # a 3 s stream
    gateway = start_gateway()
    result: dict[str, object] = {}

    def stream() -> None:
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
            chunks = client.completions.create(model=model, prompt="p", max_tokens=100, stream=True)
            result["chunks"] = [c for c in chunks if c.choices]

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 5
    while running(worker) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.process.terminate()
    # Deregistered at once, so no new request is routed here (a loaded CI run took more
    # than the 0.2 s this test once allowed)...
    wait_for(lambda: not redis_client.hexists(keys.workers(model), worker.name), 2.0,
             "the worker to leave the registry on SIGTERM")
    assert thread.is_alive(), "the stream ended before the worker left the registry"
    # ...but the stream already running finishes whole.
    thread.join(10)
    chunks = result["chunks"]
    assert len(chunks) == 100 and chunks[-1].choices[0].finish_reason == "length"  # type: ignore[index]
    assert worker.process.wait(10) == 0


def test_worker_rejects_bad_internal_request(start_worker) -> None:
    worker = start_worker("bad-internal")
    resp = httpx.post(worker.url + "/internal/generate", content=b'{"model": 1}')
    assert resp.status_code == 400
    assert set(orjson.loads(resp.content)["error"]) == {"message", "type", "param", "code"}


def test_metrics_and_heartbeat_carry_engine_stats(start_worker, redis_client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    worker = start_worker("metrics-test", sim_max_seqs=7)
    httpx.post(worker.url + "/internal/generate",
               json={"request_id": "m1", "model": "metrics-test", "prompt": "x", "max_tokens": 3})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(worker.url + "/metrics").text)}
    assert families["sluice_worker_capacity"].samples[0].value == 7
    assert families["sluice_worker_requests"].samples[0].value >= 1
    assert "sluice_engine_running_requests" in families
    beat = orjson.loads(redis_client.hget(keys.stats("metrics-test"), worker.name))
    assert set(beat) >= {"running", "waiting", "kv_usage", "prefix_queries", "prefix_hits"}
    record = orjson.loads(redis_client.hget(keys.workers("metrics-test"), worker.name))
    assert record["capacity"] == 7


def test_a_worker_refuses_a_model_name_the_gateways_would_refuse() -> None:
    """Names are bounded at the gateway (length, characters): a worker serving a name no
    client could send says so at start instead of registering a model nobody reaches."""
    import pytest

    from engine_worker.config import WorkerSettings
    from engine_worker.worker import served_name
    from sluice.models import ModelError

    assert served_name(WorkerSettings(served_model_name="org/Model-1.5B:q4")) == "org/Model-1.5B:q4"
    for bad in ("my model", "a{b}", "m" * 257):
        with pytest.raises(ModelError, match="model name"):
            served_name(WorkerSettings(served_model_name=bad))


def test_a_vllm_engine_whose_core_died_is_unhealthy() -> None:
    """Regression (H200, P/D under load): vLLM's engine core died (EngineDeadError) and the
    worker kept beating, so gateways kept routing there and 871 requests failed. A dead
    core makes the engine unhealthy: its heartbeat pauses (engine_worker/registration.py)."""
    from types import SimpleNamespace

    from engine_worker.engines.vllm_engine import VllmEngine

    engine = VllmEngine(Path("/nonexistent"), served_model_name="x")
    assert engine.healthy  # not started yet: registration waits for the start anyway
    engine._engine = SimpleNamespace(errored=False)
    assert engine.healthy
    engine._engine = SimpleNamespace(errored=True)  # what AsyncLLM says once its core is dead
    assert not engine.healthy


def test_a_worker_started_while_redis_is_away_waits_and_registers_once_it_answers(
        procs: list[Proc], tmp_path: Path) -> None:
    """Regression (the nemesis, Cluster): a worker restarted during a Redis outage exited with
    a traceback (its first ping after 5 s, or its first heartbeat), was restarted into the
    same outage, and after 90 s the harness gave up: the worker stayed down for the rest of
    the run. It now waits for Redis, then serves and registers."""
    port, redis_port = free_port(), free_port()
    argv = [sys.executable, "-m", "sluice", "worker", "--engine", "sim", "--port", str(port),
            "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--served-model-name", "late-redis",
            "--worker-id", "w-late", "--heartbeat-ms", "200"]
    worker = Proc("w-late", argv, tmp_path / "w-late.log", _env())
    procs.append(worker)
    time.sleep(8)  # past the 5 s of pings after which it used to exit
    assert worker.alive(), worker.log_tail()
    with EmbeddedRedis(port=redis_port) as server:
        client = redis.Redis.from_url(server.url)
        try:
            wait_for(lambda: worker_alive(client, "late-redis", "w-late"), 20, "the worker's registration")
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        finally:
            client.close()
        worker.stop()
    assert b"Traceback" not in worker.log_path.read_bytes()
