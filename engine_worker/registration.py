"""Registering a worker in Redis and keeping its heartbeat alive."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.exceptions import RedisError

from sluice import keys, routing_facts
from sluice.directory import Directory
from sluice.roles import BOTH, Role

log = logging.getLogger("sluice.worker")


# KEYS workers, alive, stats, routing (one slot). ARGV id, record JSON, stats JSON, TTL (ms).
# The routing facts come from the record (sluice/routing_facts.py).
_BEAT = routing_facts.FUNCTIONS + r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], now + tonumber(ARGV[4]))
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], routing_facts(ARGV[2]))
return 1
"""

# KEYS workers, alive, stats, routing. ARGV id.
_LEAVE = r"""
for _, k in ipairs(KEYS) do redis.call('HDEL', k, ARGV[1]) end
return 1
"""


class Registration:
    """Heartbeat = the worker's record, an expiry three beats ahead on Redis's clock, and
    its engine stats, written by one script (one Cluster slot).

    Re-writing the record on every beat lets a worker that Redis forgot (restart,
    reaper) come back on its own.
    """

    def __init__(
        self,
        redis: Any,
        *,
        model: str,
        worker_id: str,
        url: str,
        engine: str,
        capacity: int,
        heartbeat_ms: int,
        stats: Callable[[], dict[str, float]],
        healthy: Callable[[], bool] = lambda: True,
        tasks: tuple[str, ...] = ("generate",),
        role: Role = BOTH,
        record: Callable[[], dict[str, object]] = dict,
        also: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``record``: fields added to the registry record at every beat (the LoRA adapters
        held); ``also``: a write to other keys at every beat (the adapter directory)."""
        self._redis = redis
        self.model = model
        self.worker_id = worker_id
        self._record = {"id": worker_id, "url": url, "engine": engine, "capacity": capacity, "tasks": list(tasks),
                        "role": role}
        self._extra = record
        self._also = also
        self._period_s = heartbeat_ms / 1000
        self._ttl_ms = heartbeat_ms * keys.HEARTBEAT_MISSES
        self._stats = stats
        self._healthy = healthy
        self._task: asyncio.Task[None] | None = None
        self._registered = False
        self._beat = redis.register_script(_BEAT)
        self._leave = redis.register_script(_LEAVE)
        self._directory = Directory(redis)
        self._epoch: str | None = None

    async def beat(self) -> None:
        # The directory and the epoch live in other slots: separate, idempotent writes.
        self._epoch = (await self._directory.register(self.model, self._epoch)).id
        await self._beat(keys=keys.worker_keys(self.model),
                         args=[self.worker_id, orjson.dumps({**self._record, **self._extra()}),
                               orjson.dumps(self._stats()), self._ttl_ms])
        if self._also is not None:
            await self._also()

    async def start(self) -> None:
        """Register and keep beating. Redis away at start (a restart, a failover, a Cluster
        without a quorum) is no reason to exit: the beats register the worker once Redis
        answers (the nemesis: workers restarted during a Cluster outage died with a
        traceback at their first beat, again and again, and stayed down)."""
        self._registered = True
        try:
            await self.beat()
            log.info("registered worker %s for model %r", self.worker_id, self.model)
        except (RedisError, OSError) as exc:
            log.warning("worker %s: Redis did not take the registration (%s); registering with the next "
                        "heartbeat that it takes", self.worker_id, exc)
        self._task = asyncio.create_task(self._loop(), name="heartbeat")

    async def _loop(self) -> None:
        beating = True
        spent = 0.0
        while True:
            # A beat every period, not a period after the last one ended: a beat that takes its
            # time (three round trips on a loaded Cluster) no longer stretches the gap that the
            # expiry, HEARTBEAT_MISSES periods, has to cover.
            await asyncio.sleep(max(0.0, self._period_s - spent))
            began = time.monotonic()
            if self._healthy() != beating:
                beating = not beating
                log.warning("engine %s: heartbeat %s", "healthy again" if beating else "unhealthy",
                            "resumed" if beating else "paused (gateways stop routing here)")
            if not beating:
                spent = 0.0
                continue
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
            spent = time.monotonic() - began

    async def deregister(self) -> None:
        """Stop beating and vanish from the registry, so no new request is routed here."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not self._registered:
            return
        self._registered = False
        try:
            await self._leave(keys=keys.worker_keys(self.model), args=[self.worker_id])
            log.info("deregistered worker %s", self.worker_id)
        except (RedisError, OSError) as exc:
            log.warning("deregistration failed (the heartbeat will expire): %s", exc)
