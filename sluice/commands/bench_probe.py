"""What a benchmark watches while its load runs: Redis connections per gateway, queue
length, slots in use, leases, gateway memory, and (optionally) what workers really run.

>>> outcomes, sampler, after = await watched(stack, shots, processes=1)
>>> sampler.max_connections, sampler.max_rss_mib, after["inflight_after"]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import httpx
from redis.exceptions import RedisError

from sluice import keys
from sluice.commands.bench_load import LEAD_S, Outcome, Shot, fire
from sluice.commands.bench_stack import MODEL, Stack
from sluice.redis_pool import RedisClient, connections_by_name, create_pool


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    queued: int
    inflight: int
    leases: int
    #: Redis connections per gateway (index as in the stack); -1 once it is gone.
    connections: tuple[int, ...]
    #: Sequences the workers report running; -1 when not sampled.
    running: int = -1
    #: Lease ids present (sampled with ``running``), to tell how long each lived.
    lease_ids: frozenset[bytes] = frozenset()


async def queued(redis: RedisClient) -> int:
    return sum([int(await redis.zcard(q)) for q in keys.queues(MODEL)])


async def slots_in_use(redis: RedisClient) -> tuple[int, int]:
    """(sum of ``inflight`` over workers, number of leases)."""
    inflight = sum(int(v) for v in await redis.hvals(keys.inflight(MODEL)))
    return inflight, int(await redis.zcard(keys.leases(MODEL)))


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the command name (which may hold spaces): utime, stime are 14, 15.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def settle(redis: RedisClient, timeout_s: float = 15.0) -> tuple[int, int, float]:
    """Wait for every slot and lease to come back: (inflight, leases, seconds waited)."""
    started = time.monotonic()
    while True:
        inflight, leases = await slots_in_use(redis)
        waited = time.monotonic() - started
        if (inflight == 0 and leases == 0) or waited > timeout_s:
            return inflight, leases, waited
        await asyncio.sleep(0.2)


class Sampler:
    def __init__(self, redis: RedisClient, stack: Stack, start: float, *, period_s: float = 0.2,
                 running: bool = False) -> None:
        """``running``: also sample what the workers run and which leases exist."""
        self._redis = redis
        self._stack = stack
        self._start = start
        self._period_s = period_s
        self._running = running
        self._names = [f"sluice-gateway-{g.pid}" for g in stack.gateways]
        self.samples: list[Sample] = []
        self._stopped = asyncio.Event()
        self.max_connections = [0] * len(stack.gateways)
        self.max_rss_mib = [0.0] * len(stack.gateways)
        #: CPU seconds each child used, as last seen (by child name: gateway-0, worker-1, ...).
        self.cpu_s: dict[str, float] = {}

    async def run(self) -> None:
        """Sample every ``period_s`` until the ``async with`` block ends."""
        async with httpx.AsyncClient(timeout=2) as http:
            while not self._stopped.is_set():
                # A sample lost under load is a gap in the series, not a failed run.
                with contextlib.suppress(RedisError, OSError, httpx.HTTPError, KeyError, ValueError):
                    self.samples.append(await self._sample(http))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self._period_s)

    async def _sample(self, http: httpx.AsyncClient) -> Sample:
        t_s = time.monotonic() - self._start
        by_name = await connections_by_name(self._redis)
        conns = []
        for i, (child, name) in enumerate(zip(self._stack.gateways, self._names, strict=True)):
            alive = child.alive()
            conns.append(by_name.get(name, 0) if alive else -1)
            self.max_connections[i] = max(self.max_connections[i], conns[-1])
            if alive and (rss := rss_mib(child.pid)) is not None:
                self.max_rss_mib[i] = max(self.max_rss_mib[i], rss)
        for child in [*self._stack.gateways, *self._stack.workers]:
            if child.alive() and (used := cpu_s(child.pid)) is not None:
                self.cpu_s[child.name] = used
        inflight, leases = await slots_in_use(self._redis)
        running, lease_ids = -1, frozenset[bytes]()
        if self._running:
            bodies = [(await http.get(u + "/health")).json() for u in self._stack.worker_urls]
            running = sum(int(b["worker"]["stats"]["running"]) for b in bodies)
            lease_ids = frozenset(cast(list[bytes], await self._redis.zrange(keys.leases(MODEL), 0, -1)))
        return Sample(t_s, await queued(self._redis), inflight, leases, tuple(conns), running, lease_ids)

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.create_task(self.run(), name="bench-sampler")
        return self

    async def __aexit__(self, *exc: object) -> None:
        # An event, not cancel(): a cancellation that lands inside the Redis client's
        # pool wait can come back as a connection error, which the loop would survive.
        self._stopped.set()
        await self._task


def cpu(sampler: Sampler, load_cpu_s: float) -> dict[str, Any]:
    """CPU seconds by process kind, and the machine's load average (other work shares the cores)."""
    def of(kind: str) -> list[float]:
        return [round(v, 1) for k, v in sorted(sampler.cpu_s.items()) if k.startswith(kind)]

    return {"cpu_s_gateways": of("gateway"), "cpu_s_workers": of("worker"), "cpu_s_load": round(load_cpu_s, 1),
            "loadavg": [round(x, 1) for x in os.getloadavg()]}


async def watched(
    stack: Stack, shots: list[Shot], processes: int, *, period_s: float = 0.2, running: bool = False,
    during: Callable[[float], Awaitable[None]] | None = None,
) -> tuple[list[Outcome], Sampler, dict[str, float]]:
    """Fire ``shots`` at the stack's gateways while sampling it, then wait for its slots to settle.

    ``during(start)`` runs beside the load (a kill, say), given the plan's time zero.
    Returns the outcomes, the sampler, and inflight / leases / seconds waited after
    and the load processes' CPU seconds.
    """
    redis = await create_pool(stack.redis_url, client_name="sluice-bench")
    try:
        start = time.monotonic() + LEAD_S + 0.5 * processes
        async with Sampler(redis, stack, start, period_s=period_s, running=running) as sampler:
            load = fire(stack.gateway_urls, shots, processes=processes, start=start)
            if during is None:
                outcomes, load_cpu_s = await load
            else:
                (outcomes, load_cpu_s), _ = await asyncio.gather(load, during(start))
        inflight, leases, waited = await settle(redis)
    finally:
        await redis.aclose()
    return outcomes, sampler, {"inflight_after": inflight, "leases_after": leases, "settle_s": waited,
                               "load_cpu_s": load_cpu_s}
