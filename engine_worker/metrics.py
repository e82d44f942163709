"""Prometheus metrics for a worker: the engine's, read at scrape time, and the process's stalls
(its event loop's lag, the garbage collector's pauses: sluice/stalls.py), counted as they come."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.stalls import Stalls

if TYPE_CHECKING:
    from engine_worker.worker import Worker


class WorkerCollector(Collector):
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self._worker
        stats = w.engine.stats()
        labels = ["model", "engine"]
        values = [w.model, w.engine.name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("sluice_engine_running_requests", "Sequences the engine is running", stats.running)
        yield gauge("sluice_engine_waiting_requests", "Sequences waiting inside the engine", stats.waiting)
        yield gauge("sluice_engine_kv_cache_usage_ratio", "KV cache in use (0-1)", stats.kv_usage)
        yield gauge("sluice_worker_capacity", "Sequences this worker advertises", w.engine.capacity)
        yield gauge("sluice_worker_in_flight_requests", "Streams open on this worker", w.in_flight)
        yield counter("sluice_engine_prefix_cache_queries", "Prefix cache lookups (tokens or blocks)",
                      stats.prefix_queries)
        yield counter("sluice_engine_prefix_cache_hits", "Prefix cache hits (tokens or blocks)",
                      stats.prefix_hits)
        yield counter("sluice_worker_gateway_prompt_ids", "Prompts taken as the gateway's token ids "
                      "(its tokenizer has this worker's digest), not tokenized here", stats.gateway_prompts)
        yield counter("sluice_worker_requests", "Streams finished on this worker", w.served)


class WorkerMetrics:
    """A worker process's registry: the engine's figures and the process's stalls."""

    def __init__(self, worker: Worker) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        r.register(WorkerCollector(worker))
        self.stalls = Stalls("worker", r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
