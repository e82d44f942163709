"""How long the gateway's event loop keeps ready work waiting: one process's backlog.

Each gateway process runs every request on one event loop. When it is busy, each step of a
request (its arrival, admission's reply from Redis, the engine's first token, the release)
waits behind the callbacks queued before it, and none of the request metrics shows that wait
apart: it is spread over a request's hops. On this repository's 2-core machine, 64 one-token
streams on one process added +9 ms to TTFT that way, about a third at each of admission, the
app's other steps and outside the app, while Redis ran each ACQUIRE in 43 µs
(loadtest/peers/README.md, 2026-12-06 night). A rising lag says the process is short of CPU:
run more of them (``--procs``), or give them cores.

Every :data:`SAMPLE_S` the probe queues one callback and times how long it waits to run
(``sluice_gateway_event_loop_lag_seconds``): what any step ready at that moment waits. A loop
blocked outright (a synchronous call, the process stopped or starved of CPU) delays the
probe's timer or its callback: a sample that runs :data:`STALL_S` or more after it was due
counts that whole delay, and is logged (at most once per :data:`LOG_EVERY_S`, with the count
of the others). Below that, a timer's lateness is not counted: the loop's timers fire up to a
millisecond late by design (libuv's clock), which would hide the backlog under its noise.

Cost: ten timer callbacks a second and one histogram observation each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("sluice.gateway")

#: Seconds between samples.
SAMPLE_S = 0.1
#: A sample run this long after it was due means the loop was blocked, not merely busy.
STALL_S = 0.5
#: At most one log line per this many seconds about stalls.
LOG_EVERY_S = 10.0


class LoopLag:
    """Samples the running loop's lag into ``histogram`` (a prometheus_client series)."""

    def __init__(self, histogram: Any, sample_s: float = SAMPLE_S, stall_s: float = STALL_S) -> None:
        self._histogram = histogram
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
        log.warning("this gateway process's event loop was blocked for %.2f s (a synchronous call, or the process "
                    "stopped or starved of CPU); every request in flight there waited as long%s", late_s,
                    f" ({others} more such stalls since the last line)" if others else "")
        self._logged, self._stalls = now, 0
