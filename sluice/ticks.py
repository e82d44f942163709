"""Timeouts for many requests on one loop timer, to a tick's precision.

Why: each request a gateway served ran two ``asyncio.timeout`` scopes (the route's bound on
every wait before its response, an attempt's wait for its first token) and a loop timer for
its stream's disconnect watch. The two scopes, each a timer handle made, scheduled and
cancelled, were 3.3 % of a gateway process's CPU at 64 one-token streams (py-spy,
``loadtest/peers/profile_gateway.py --max-tokens 1 --keep-alive``; a scope 5.0 µs against
2.2 here, timeit under uvloop; loadtest/peers/README.md). Neither needs better than a few
hundredths of a second: they bound waits of seconds. Here a scope joins the set of the tick
it is due in (a set add) and leaves it when its block ends (a discard), and one loop timer,
set for the earliest tick that has entries, fires them. (The watch's timer gained nothing
so, and stays the loop's.)

A scope fires at most :data:`TICK_S` after it is due (plus the loop's own lateness), never
before. :func:`timeout` is ``asyncio.timeout`` with that precision: the task is cancelled at
the deadline, and the block raises ``TimeoutError`` (a cancellation from elsewhere stays a
cancellation).

What the wheel holds is bounded by what runs: a scope leaves its set when its block ends, and
an emptied set is dropped at once. Its heap (and the set of the ticks in it) keeps each tick
that had a set once until the tick comes or becomes the earliest: at most one per tick up to
the longest deadline ahead (an hour's bound: 144,000 ints), whatever the request rate. The
timer is set only for a tick that still has scopes. This mirrors Python 3.11's
``asyncio.timeout`` (3.12's also chains the cancellation to the ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref
from types import TracebackType

#: Seconds per tick: the precision of every timeout made here.
TICK_S = 0.025


class _Wheel:
    """One event loop's timeout scopes, in sets by the tick they are due in."""

    __slots__ = ("_armed", "_buckets", "_handle", "_loop", "_queued", "_ticks")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._buckets: dict[int, set[Timeout]] = {}
        self._ticks: list[int] = []  # a heap of the ticks to come that had a set
        self._queued: set[int] = set()  # the ticks in that heap
        self._armed: int | None = None
        self._handle: asyncio.TimerHandle | None = None

    def add(self, scope: Timeout, when: float) -> None:
        """``scope`` is due at ``when`` (the loop's clock)."""
        tick = math.ceil(when / TICK_S)
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = set()
            if tick not in self._queued:
                self._queued.add(tick)
                heapq.heappush(self._ticks, tick)
                if self._armed is None or tick < self._armed:
                    self._arm(tick)
        bucket.add(scope)
        scope._bucket, scope._tick, scope._wheel = bucket, tick, self

    def drop(self, tick: int, bucket: set[Timeout]) -> None:
        """An emptied set leaves at once (its tick stays in the heap until it comes)."""
        if self._buckets.get(tick) is bucket:
            del self._buckets[tick]

    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def close(self) -> None:
        """Its loop is closed: nothing more fires, and nothing is held."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._armed = None
        self._buckets.clear()
        self._ticks.clear()
        self._queued.clear()

    def pending(self) -> int:
        """Scopes waiting (for tests and figures)."""
        return sum(len(bucket) for bucket in self._buckets.values())

    def _arm(self, tick: int) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            self.close()
            return
        if self._handle is not None:
            self._handle.cancel()
        self._armed = tick
        self._handle = loop.call_at(tick * TICK_S, self._fire)

    def _fire(self) -> None:
        self._handle = self._armed = None
        loop = self._loop()
        if loop is None:
            return
        # uvloop's clock is in whole milliseconds: a timer on time can read a hair before its
        # tick (k * 0.025 > 25 * k / 1000 for a third of k), and re-armed for that tick it fired
        # again at once until the millisecond turned (hundreds of empty turns a tick).
        due = math.floor(loop.time() / TICK_S + 1e-6)
        ticks = self._ticks
        try:
            while ticks and ticks[0] <= due:
                tick = heapq.heappop(ticks)
                self._queued.discard(tick)
                bucket = self._buckets.pop(tick, None)
                for scope in list(bucket or ()):
                    scope._bucket = None
                    scope._expire()
        finally:
            while ticks and ticks[0] not in self._buckets:  # ticks whose scopes all ended: no wake-up
                self._queued.discard(heapq.heappop(ticks))
            if ticks:
                self._arm(ticks[0])


#: Each loop's wheel by the loop's id. A wheel holds its loop weakly, but its armed timer
#: holds it strongly: a closed loop's wheel is let go of (timer cancelled, entries dropped)
#: when the next loop's wheel is made (tests run a loop each).
_wheels: dict[int, _Wheel] = {}
#: The last loop's wheel: a server runs one loop, so the lookup is mostly one comparison.
_last: _Wheel | None = None


def wheel(loop: asyncio.AbstractEventLoop | None = None) -> _Wheel:
    """The running (or given) loop's wheel."""
    global _last
    loop = loop or asyncio.get_running_loop()
    last = _last
    if last is not None and last.loop() is loop:
        return last
    found = _wheels.get(id(loop))
    if found is None or found.loop() is not loop:
        for key, other in list(_wheels.items()):
            gone = other.loop()
            if gone is None or gone.is_closed():
                other.close()
                del _wheels[key]
        found = _wheels[id(loop)] = _Wheel(loop)
    _last = found
    return found


class Timeout:
    """``async with timeout(delay_s) as scope``: see the module docstring."""

    __slots__ = ("_bucket", "_cancelling", "_delay_s", "_state", "_task", "_tick", "_wheel")

    def __init__(self, delay_s: float) -> None:
        self._bucket: set[Timeout] | None = None  # the set of its tick while its block runs
        self._tick = 0
        self._wheel: _Wheel | None = None
        self._delay_s = delay_s
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._state = "new"

    def expired(self) -> bool:
        """Whether the deadline came while the block ran (as ``asyncio.Timeout.expired``)."""
        return self._state in ("expiring", "expired")

    async def __aenter__(self) -> Timeout:
        if self._state != "new":
            raise RuntimeError("a timeout scope is entered once")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a timeout must be used inside a task")
        loop = task.get_loop()
        self._task, self._cancelling, self._state = task, task.cancelling(), "entered"
        wheel(loop).add(self, loop.time() + self._delay_s)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        bucket, self._bucket = self._bucket, None
        if bucket is not None:
            bucket.discard(self)
            if not bucket and self._wheel is not None:
                self._wheel.drop(self._tick, bucket)
        task, self._task = self._task, None
        if self._state == "expiring":
            self._state = "expired"
            if task is not None and task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc  # our own cancellation, and no other came meanwhile
        elif self._state == "entered":
            self._state = "exited"

    def _expire(self) -> None:
        """Its tick came (the wheel calls it)."""
        if self._state == "entered" and self._task is not None:
            self._state = "expiring"
            self._task.cancel()


def timeout(delay_s: float) -> Timeout:
    """A scope that ends its block with ``TimeoutError`` after ``delay_s`` (a tick late at most)."""
    return Timeout(delay_s)
