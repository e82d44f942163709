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
(``sluice_gateway_gc_pause_seconds``, ``sluice_worker_gc_pause_seconds``). Cost: two calls
to ``time.perf_counter`` and one observation a collection (young ones run every 7,000 net
allocations).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

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

    def __init__(self, histogram: Any, process: str, sample_s: float = SAMPLE_S, stall_s: float = STALL_S) -> None:
        self._histogram = histogram
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
    """Times each collection of the garbage collector into ``histogram`` (a prometheus_client
    series labelled by ``generation``), from :meth:`start` until :meth:`close`."""

    def __init__(self, histogram: Any) -> None:
        self._by_generation = [histogram.labels(str(g)) for g in range(3)]
        self._began = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._timed)

    def close(self) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._began)


class Stalls:
    """Both probes of one serving process, started and closed together."""

    def __init__(self, loop_lag: Any, gc_pauses: Any, process: str) -> None:
        self._probes = (LoopLag(loop_lag, process), GcPauses(gc_pauses))

    def start(self) -> None:
        for probe in self._probes:
            probe.start()

    def close(self) -> None:
        for probe in self._probes:
            probe.close()
