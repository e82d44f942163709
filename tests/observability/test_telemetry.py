"""Traces across gateway and worker, Prometheus metrics on both, the access log."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for


def _spans(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _families(url: str) -> dict:
    resp = httpx.get(url + "/metrics")
    assert resp.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def _count(families: dict, name: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == name + "_count" and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def traced(start_worker, start_gateway, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    worker_file, gateway_file = folder / "worker.jsonl", folder / "gateway.jsonl"
    worker = start_worker("traced", sim_token_ms=2, env={"SLUICE_TRACE_FILE": str(worker_file)})
    gateway = start_gateway(env={"SLUICE_TRACE_FILE": str(gateway_file),
                                 # Long enough for /metrics polls to see a queued request: in the full
                                 # suite a poll walks every model in the shared Redis.
                                 "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "3"})
    return worker, gateway, worker_file, gateway_file


def test_one_trace_across_gateway_and_worker(traced) -> None:
    worker, gateway, worker_file, gateway_file = traced
    body = {"model": "traced", "stream": True, "max_tokens": 5, "priority": 3,
            "messages": [{"role": "user", "content": "trace me"}]}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body,
                      headers={"x-request-id": "trace-1"}) as resp:
        assert resp.read().endswith(b"data: [DONE]\n\n")
    deadline = time.monotonic() + 5
    while True:
        spans = _spans(gateway_file) if gateway_file.exists() else []
        root = [s for s in spans if s["attributes"].get("sluice.request_id") == "trace-1"]
        if root and worker_file.exists():
            break
        assert time.monotonic() < deadline, "spans never written"
        time.sleep(0.05)
    root_span = root[0]
    assert root_span["name"] == "chat.completions" and root_span["parent_id"] is None
    attrs = root_span["attributes"]
    assert attrs["gen_ai.request.model"] == "traced" and attrs["sluice.priority"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == 5 and attrs["sluice.status"] == "ok"
    assert "first_token" in root_span["events"]
    trace_id = root_span["trace_id"]
    children = {s["name"]: s for s in spans if s["trace_id"] == trace_id and s["parent_id"] == root_span["span_id"]}
    assert {"queue.wait", "upstream"} <= set(children)
    assert children["upstream"]["attributes"]["sluice.worker_id"] == worker.name
    worker_spans = [s for s in _spans(worker_file) if s["trace_id"] == trace_id]
    assert len(worker_spans) == 1
    assert worker_spans[0]["name"] == "worker.generate"
    assert worker_spans[0]["parent_id"] == children["upstream"]["span_id"]
    assert worker_spans[0]["service"] == "sluice-worker" and root_span["service"] == "sluice-gateway"


def test_metrics_on_both_processes(traced) -> None:
    worker, gateway, _, _ = traced
    for i in range(3):
        httpx.post(gateway.url + "/v1/completions", json={"model": "traced", "prompt": f"m{i}", "max_tokens": 4})
    g = _families(gateway.url)
    for histogram in ("sluice_gateway_time_to_first_token_seconds", "sluice_gateway_request_duration_seconds",
                      "sluice_gateway_queue_wait_seconds", "sluice_gateway_inter_token_latency_seconds"):
        assert _count(g, histogram, model="traced") > 0, histogram
    completion = [s for s in g["sluice_gateway_completion_tokens"].samples
                  if s.name == "sluice_gateway_completion_tokens_total" and s.labels["model"] == "traced"]
    assert completion and completion[0].value >= 12
    assert [s.value for s in g["sluice_gateway_live_workers"].samples if s.labels["model"] == "traced"] == [1]
    assert _count(g, "sluice_gateway_event_loop_lag_seconds") > 0  # sampled from the start, requests or not
    w = _families(worker.url)
    assert w["sluice_worker_requests"].samples[0].value >= 3
    assert _count(w, "sluice_worker_event_loop_lag_seconds") > 0  # the worker's loop too, as it serves
    for families, name in ((g, "sluice_gateway_gc_pause_seconds"), (w, "sluice_worker_gc_pause_seconds")):
        # timed as they come (tests/test_stalls.py); a young one may not have run yet
        assert {s.labels["generation"] for s in families[name].samples} == {"0", "1", "2"}, name


def test_rejection_is_counted_and_logged(traced, start_worker) -> None:
    _, gateway, _, _ = traced
    start_worker("rej", sim_max_seqs=1, sim_token_ms=10)
    blocker = {"model": "rej", "prompt": "b", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=blocker, timeout=30) as held:
        lines = held.iter_lines()
        next(lines)  # the only slot is taken; the next request waits 3 s and is turned away
        waiting = threading.Thread(target=httpx.post, args=(gateway.url + "/v1/completions",),
                                   kwargs={"json": {"model": "rej", "prompt": "w", "max_tokens": 2, "priority": 5}})
        waiting.start()

        def depth() -> list[float]:
            return [s.value for s in _families(gateway.url)["sluice_gateway_queue_depth"].samples
                    if s.labels == {"model": "rej", "priority_class": "low"}]

        # Polled, not slept on: on a busy machine the request may take a while to arrive.
        wait_for(lambda: depth() == [1.0], 5, "the waiting request in the low-priority queue")
        waiting.join(10)
        resp = httpx.post(gateway.url + "/v1/completions", headers={"x-request-id": "rejected-1"},
                          json={"model": "rej", "prompt": "late", "max_tokens": 2})
        assert resp.status_code == 429
    g = _families(gateway.url)
    rejected = [s.value for s in g["sluice_gateway_rejections"].samples
                if s.name == "sluice_gateway_rejections_total" and s.labels == {"model": "rej", "reason": "queue_timeout"}]
    assert rejected == [2.0]
    log = [json.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith("{")]
    access = [e for e in log if e.get("request_id") == "rejected-1"]
    assert access and access[0]["status"] == "429" and access[0]["error"] == "queue_timeout"
    assert access[0]["logger"] == "sluice.access"


def test_metrics_refuse_non_admin_when_key_set(start_gateway) -> None:
    gateway = start_gateway(env={"SLUICE_GATEWAY_ADMIN_KEY": "s3cret"})
    assert httpx.get(gateway.url + "/metrics").status_code == 401
    ok = httpx.get(gateway.url + "/metrics", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and "sluice_gateway_requests" in ok.text
