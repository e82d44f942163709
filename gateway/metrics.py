"""Prometheus metrics of one gateway process (its own registry, no global state).

Per-request figures are recorded once, when the request ends (from its Tally);
per chunk, a stream counts its inter-token gap in its own :class:`Gaps`.

``sluice gateway --procs N`` runs N processes behind one port, and a scrape lands on
any one of them. So that every scrape sees the whole gateway (not one process's
counters, which would jump back and forth between scrapes), the supervisor gives its
children a shared ``PROMETHEUS_MULTIPROC_DIR``: prometheus_client then keeps each
value in a per-process file there, and ``render`` sums them. A dead process's
counters stay counted; its live gauges (``in_flight``) are dropped by the supervisor.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from sluice.stalls import Stalls

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Gaps:
    """One stream's inter-token gaps, counted by bucket here and added to its model's
    histogram series a bucket at a time: when the stream ends (:meth:`flush`) and every
    :data:`FLUSH_EVERY` gaps, so a long stream's gaps reach a scrape as it goes.

    Why not ``observe`` per chunk: it takes two locks (the sum's and the bucket's) and walks
    the bounds, per relayed chunk: about 5 % of a relaying gateway's CPU per chunk (py-spy,
    128-token streams; loadtest/peers/README.md). prometheus_client has no call that adds
    several observations at once, so this adds to the series' own values (``_buckets``,
    ``_sum``: per bucket its own count, summed up to ``le`` when collected, as ``observe``
    keeps them); tests/gateway/test_metrics.py checks the exposition matches ``observe``'s."""

    __slots__ = ("_bounds", "_counts", "_n", "_sum", "label", "series")

    #: Gaps a stream holds before adding them to the series.
    FLUSH_EVERY = 256

    def __init__(self, series: Any, label: str) -> None:
        self.series, self.label = series, label
        self._bounds = series._upper_bounds  # the buckets' bounds, +Inf last
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0

    def add(self, gap: float) -> None:
        self._counts[bisect_left(self._bounds, gap)] += 1  # the first bound >= gap, as observe's
        self._sum += gap
        self._n += 1
        if self._n >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        buckets = self.series._buckets
        for i, count in enumerate(self._counts):
            if count:
                buckets[i].inc(count)
                self._counts[i] = 0
        self.series._sum.inc(self._sum)
        self._sum, self._n = 0.0, 0


def priority_class(priority: int) -> str:
    return "urgent" if priority < 0 else "default" if priority == 0 else "low"


@dataclass(slots=True)
class ModelSeries:
    """The per-model series every finished request records into, looked up once per model:
    ``labels()`` takes a lock and builds a key each time, a dozen times per request. Not
    frozen: the queue's wait series of a priority class is made when first observed."""

    ttft: Any
    e2e: Any
    prompt_tokens: Any
    completion_tokens: Any
    cached_tokens: Any
    route_expected_tokens: Any
    route_error_tokens: Any
    retries: Any
    migrations: Any
    #: Requests that ended well (the status of most), and the queue's wait by priority class,
    #: each class's series made when first observed: the two ``labels()`` a request still made.
    ok: Any
    queue_wait_family: Any
    model: str
    queue_wait: dict[str, Any] = field(default_factory=dict)

    def waited(self, priority_class: str) -> Any:
        child = self.queue_wait.get(priority_class)
        if child is None:
            child = self.queue_wait[priority_class] = self.queue_wait_family.labels(self.model, priority_class)
        return child


class GatewayMetrics:
    def __init__(self) -> None:
        #: By model label: what admission has seen exist, or "unknown" (bounded like the series).
        self._series: dict[str, ModelSeries] = {}
        r = self.registry = CollectorRegistry(auto_describe=True)
        # Which process answered: a --procs gateway's processes share one port, and each
        # scrape reaches one of them (benchmarks sum them by this label).
        Gauge("sluice_gateway_process", "This gateway process", ["pid"], registry=r).labels(pid=str(os.getpid())).set(1)
        self.requests = Counter("sluice_gateway_requests", "Requests finished, by status", ["model", "status"], registry=r)
        self.errors = Counter("sluice_gateway_errors", "Errors by OpenAI error type", ["model", "type"], registry=r)
        self.rejections = Counter("sluice_gateway_rejections", "Requests turned away (429/503) by reason",
                                  ["model", "reason"], registry=r)
        self.ttft = Histogram("sluice_gateway_time_to_first_token_seconds", "Arrival to first token",
                              ["model"], buckets=_LATENCY, registry=r)
        self.itl = Histogram("sluice_gateway_inter_token_latency_seconds", "Gap between relayed chunks",
                             ["model"], buckets=_ITL, registry=r)
        self.queue_wait = Histogram("sluice_gateway_queue_wait_seconds", "Time waiting for a worker slot",
                                    ["model", "priority_class"], buckets=_LATENCY, registry=r)
        self.stalls = Stalls("gateway", r)  # its loop's backlog, the collector's pauses (started by the app)
        #: sluice/connection_bounds.py's shedding, told by the app once it runs on its loop.
        self.connections_shed = Counter(
            "sluice_gateway_connections_shed", "Client connections closed for a newcomer (closed), refused "
            "with 503 (refused) or cut for not taking their answer (cut) at this process's bounds",
            ["reason"], registry=r)
        self.e2e = Histogram("sluice_gateway_request_duration_seconds", "Arrival to last byte",
                             ["model"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("sluice_gateway_prompt_tokens", "Prompt tokens", ["model"], registry=r)
        self.completion_tokens = Counter("sluice_gateway_completion_tokens", "Completion tokens", ["model"],
                                         registry=r)
        self.cached_tokens = Counter("sluice_gateway_cached_tokens", "Prompt tokens served from prefix caches",
                                     ["model"], registry=r)
        # Cache hit rate: cached_tokens / prompt_tokens. Routing accuracy:
        # 1 - prefix_error_tokens / prompt_tokens (0 error: the index knew exactly).
        self.route_expected_tokens = Counter(
            "sluice_gateway_prefix_expected_tokens", "Prompt tokens the router expected the engine to have cached",
            ["model"], registry=r)
        self.route_error_tokens = Counter(
            "sluice_gateway_prefix_error_tokens",
            "Sum over requests of |tokens the router expected cached - cached tokens the engine reported|",
            ["model"], registry=r)
        self.retries = Counter("sluice_gateway_retries", "Attempts retried before the first token", ["model"],
                               registry=r)
        self.migrations = Counter("sluice_gateway_migrations", "Streams moved to another worker mid-stream",
                                  ["model"], registry=r)
        self.in_flight = Gauge("sluice_gateway_in_flight_requests", "Requests this gateway is serving",
                               registry=r, multiprocess_mode="livesum")
        # Read from Redis by whichever process is scraped: the latest reading is the gateway's.
        self.queue_depth = Gauge("sluice_gateway_queue_depth", "Requests waiting in the shared queue",
                                 ["model", "priority_class"], registry=r, multiprocess_mode="mostrecent")
        self.live_workers = Gauge("sluice_gateway_live_workers", "Workers with a fresh heartbeat", ["model"],
                                  registry=r, multiprocess_mode="mostrecent")

    def series(self, model: str) -> ModelSeries:
        found = self._series.get(model)
        if found is None:
            found = self._series[model] = ModelSeries(
                self.ttft.labels(model), self.e2e.labels(model), self.prompt_tokens.labels(model),
                self.completion_tokens.labels(model), self.cached_tokens.labels(model),
                self.route_expected_tokens.labels(model), self.route_error_tokens.labels(model),
                self.retries.labels(model), self.migrations.labels(model), self.requests.labels(model, "ok"),
                self.queue_wait, model)
        return found

    def render(self) -> bytes:
        if not os.environ.get(MULTIPROC_DIR_ENV):
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)


def forget_process(pid: int, directory: str) -> None:
    """Drop a dead gateway process's live gauges (its counters stay summed)."""
    multiprocess.mark_process_dead(pid, directory)
