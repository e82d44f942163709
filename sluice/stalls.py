"""What stalls a serving process: its event loop's backlog, and the garbage collector's pauses.

A gateway process runs every request on one event loop; a worker process runs its streams'
HTTP side and the engine's frontend (vLLM's, in a vLLM worker) on one. When that loop is busy,
each step of a request (its arrival, admission's reply from Redis, the engine's first token,
the release) waits behind the callbacks queued before it, and none of the request metrics
shows that wait apart: it is spread over a request's hops. On this repository's 2-core
machine, 64 one-token streams on one gateway process added +9 ms to TTFT that way, about a
third at each of admission, the app's other steps and outside the app, while Redis ran each
ACQUIRE in 43 µs (loadtest/peers/README.md, 2026-12-06 night). A rising lag says the process
is short of CPU: run more of them (``--procs``), or give them cores.

:class:`LoopLag`: every :data:`SAMPLE_S` the probe queues one callback and times how long it
waits to run (``sluice_gateway_event_loop_lag_seconds``, ``sluice_worker_event_loop_lag_seconds``):
what any step ready at that moment waits. A loop
blocked outright (a synchronous call, the process stopped or starved of CPU) delays the
probe's timer or its callback: a sample that runs :data:`STALL_S` or more after it was due
counts that whole delay, and is logged (at most once per :data:`LOG_EVERY_S`, with the count
of the others). Below that, a timer's lateness is not counted: the loop's timers fire up to a
millisecond late by design (libuv's clock), which would hide the backlog under its noise.

Cost: ten timer callbacks a second and one histogram observation each.

:class:`GcPauses`: the cyclic garbage collector stops the whole process while it walks its
objects, and a full collection walks every object not frozen (``sluice.serve.settle_gc``); a
process whose heap grows (a worker holding vLLM's frontend: 650,962 objects once started) can
stall every stream it serves for a quarter of a second at a time, which the loop's samples
catch only when one falls inside. Each collection's duration is counted, by generation
(``sluice_gateway_gc_pause_seconds``, ``sluice_worker_gc_pause_seconds``), into the
histogram at the loop-lag probe's next sample. Cost: two calls to ``time.perf_counter`` and
one observation a collection (young ones run every 7,000 net allocations).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("sluice.stalls")

#: Seconds between samples.
SAMPLE_S = 0.1
#: A sample run this long after it was due means the loop was blocked, not merely busy.
STALL_S = 0.5
#: At most one log line per this many seconds about stalls.
LOG_EVERY_S = 10.0
#: Histogram bounds (seconds) of both probes' series.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LoopLag:
    """Samples the running loop's lag into ``histogram`` (a prometheus_client series)."""

    def __init__(self, histogram: Any, process: str, sample_s: float = SAMPLE_S, stall_s: float = STALL_S,
                 each_sample: Callable[[], None] | None = None) -> None:
        self._histogram = histogram
        self._each_sample = each_sample  # more work on the loop at each sample (GcPauses.drain)
        self._process = process  # "gateway" or "worker", for the log line
        self._sample_s = sample_s
        self._stall_s = stall_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._queued = 0.0
        self._stalls = 0  # stalls since the last log line
        self._logged = -LOG_EVERY_S

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = time.monotonic() + self._sample_s
        self._timer = self._loop.call_later(self._sample_s, self._fired)

    def _fired(self) -> None:
        if self._loop is None:
            return
        self._queued = time.monotonic()
        self._loop.call_soon(self._ran)

    def _ran(self) -> None:
        if self._loop is None:
            return
        now = time.monotonic()
        lag = now - self._queued
        blocked = now - self._due  # the timer's lateness and the wait behind the queue
        if blocked >= self._stall_s:
            lag = blocked
            self._stalled(blocked)
        self._histogram.observe(lag)
        if self._each_sample is not None:
            self._each_sample()
        self._schedule()

    def _stalled(self, late_s: float) -> None:
        self._stalls += 1
        now = time.monotonic()
        if now - self._logged < LOG_EVERY_S:
            return
        others = self._stalls - 1
        log.warning("this %s process's event loop was blocked for %.2f s (a synchronous call, or the process "
                    "stopped or starved of CPU); every request in flight there waited as long%s", self._process, late_s,
                    f" ({others} more such stalls since the last line)" if others else "")
        self._logged, self._stalls = now, 0


class GcPauses:
    """Times each collection of the garbage collector, from :meth:`start` until :meth:`close`;
    :meth:`drain` puts the pauses timed so far into ``histogram`` (a prometheus_client series
    labelled by ``generation``).

    The collector's callback only appends to a deque: a collection starts wherever an
    allocation happens, and prometheus_client's multiprocess mode (a ``--procs`` gateway)
    guards every value with one process-wide lock that is not reentrant, held while a new
    series is made, which allocates; an observation from the callback there would wait on
    its own thread forever. The drain runs on the event loop (with the loop-lag samples)."""

    def __init__(self, histogram: Any) -> None:
        self._by_generation = [histogram.labels(str(g)) for g in range(3)]
        self._began = 0.0
        self._timed: deque[tuple[int, float]] = deque(maxlen=4096)  # between two drains

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.drain()

    def drain(self) -> None:
        while self._timed:
            generation, seconds = self._timed.popleft()
            self._by_generation[generation].observe(seconds)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began:  # (a callback added during a collection sees its stop alone)
            self._timed.append((info["generation"], time.perf_counter() - self._began))
            self._began = 0.0


class Stalls:
    """Both probes of one serving process (``process``: "gateway" or "worker"), their two series
    declared in ``registry``, the probes started and closed together."""

    def __init__(self, process: str, registry: CollectorRegistry) -> None:
        self.loop_lag = Histogram(
            f"sluice_{process}_event_loop_lag_seconds",
            f"How long ready work waits on this {process} process's event loop (sluice/stalls.py)",
            buckets=BUCKETS, registry=registry)
        self.gc_pauses = Histogram(
            f"sluice_{process}_gc_pause_seconds",
            f"Collections of Python's garbage collector, each a stall of every request this {process} "
            "process serves (sluice/stalls.py)", ["generation"], buckets=BUCKETS, registry=registry)
        pauses = GcPauses(self.gc_pauses)
        self._probes = (LoopLag(self.loop_lag, process, each_sample=pauses.drain), pauses)

    def start(self) -> None:
        for probe in self._probes:
            probe.start()

    def close(self) -> None:
        for probe in self._probes:
            probe.close()
