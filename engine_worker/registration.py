"""Registering a worker in Redis and keeping its heartbeat alive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice import keys

log = logging.getLogger("sluice.worker")


class Registration:
    """Heartbeat = the worker's record plus its engine stats, with a TTL of three beats.

    Re-writing the record on every beat lets a worker that Redis forgot (restart,
    reaper) come back on its own.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        model: str,
        worker_id: str,
        url: str,
        engine: str,
        capacity: int,
        heartbeat_ms: int,
        stats: Callable[[], dict[str, float]],
    ) -> None:
        self._redis = redis
        self.model = model
        self.worker_id = worker_id
        self._record = orjson.dumps(
            {"id": worker_id, "url": url, "engine": engine, "capacity": capacity}
        )
        self._period_s = heartbeat_ms / 1000
        self._ttl_ms = heartbeat_ms * keys.HEARTBEAT_MISSES
        self._stats = stats
        self._task: asyncio.Task[None] | None = None
        self._registered = False

    async def beat(self) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.sadd(keys.MODELS, self.model)
        pipe.hset(keys.workers(self.model), self.worker_id, self._record)
        pipe.set(
            keys.heartbeat(self.model, self.worker_id),
            orjson.dumps(self._stats()),
            px=self._ttl_ms,
        )
        await pipe.execute()

    async def start(self) -> None:
        await self.beat()
        self._registered = True
        self._task = asyncio.create_task(self._loop(), name="heartbeat")
        log.info("registered worker %s for model %r", self.worker_id, self.model)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def deregister(self) -> None:
        """Stop beating and vanish from the registry, so no new request is routed here."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not self._registered:
            return
        self._registered = False
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hdel(keys.workers(self.model), self.worker_id)
            pipe.delete(keys.heartbeat(self.model, self.worker_id))
            await pipe.execute()
            log.info("deregistered worker %s", self.worker_id)
        except (RedisError, OSError) as exc:
            log.warning("deregistration failed (the heartbeat will expire): %s", exc)
