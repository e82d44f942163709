"""Admission: one priority queue per model in Redis, shared by every gateway replica.

A request either gets a slot on a live worker at once or waits in the model's
queue (a sorted set) until a released slot is handed to it, its queue deadline
passes (429 + ``Retry-After``), or its client leaves (removed from the queue).
Every granted slot is a lease that this gateway renews while the stream runs;
a reaper on every gateway reclaims the leases of gateways that died.

Queue order: lower score first, with ``score = arrival_ms + priority * aging_ms``
when aging is on (a request one priority level lower overtakes after waiting
``aging_ms`` longer), else ``priority * 1e12 + arrival_ms`` (strict classes).
Retries and migrations are boosted ahead of everything.

Headroom: while urgent requests (priority <= ``urgent_priority_max``) have
arrived within the last minute, a share of every worker's slots
(``reserved_slots``) is kept for them, so under overload the top class waits for
one of those rather than for the next release of a full worker. Without urgent
traffic every slot is usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway import scripts
from gateway.config import GatewaySettings
from gateway.metrics import priority_class
from sluice import keys
from sluice.errors import ModelNotFound, RateLimited, SluiceError, Unavailable

log = logging.getLogger("sluice.admission")

_STRICT = 1e12
_BOOST = -1e15
_RATE_WINDOW_MS = 30_000


class ClientGone(SluiceError):
    """The client disconnected while its request waited (nginx's 499)."""

    status = 499
    type = "client_closed_request"


def as_sluice_error(exc: BaseException) -> SluiceError:
    """What the client is told about an exception that is not already a SluiceError."""
    if isinstance(exc, SluiceError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return ClientGone("the request was cancelled")
    if isinstance(exc, (RedisError, OSError)):
        return Unavailable("the gateway's state store is unreachable", retry_after_s=2)
    return SluiceError("internal error in the gateway")


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker slot granted to one attempt; hand it back with :meth:`Admission.release`."""

    model: str
    lease_id: str
    worker_id: str
    url: str


class Admission:
    def __init__(self, redis: Redis, settings: GatewaySettings) -> None:
        self._redis = redis
        self._s = settings
        self._acquire = redis.register_script(scripts.ACQUIRE)
        self._release = redis.register_script(scripts.RELEASE)
        self._cancel = redis.register_script(scripts.CANCEL)
        self._reap = redis.register_script(scripts.REAP)
        self._renew = redis.register_script(scripts.RENEW)
        self._live = redis.register_script(_LIVE)
        self._active: dict[str, str] = {}  # lease id -> model, renewed in the background
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:
        return f"Admission(active_leases={len(self._active)})"

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name="lease-renewal"),
            asyncio.create_task(self._reap_loop(), name="lease-reaper"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _args(self, model: str, *extra: object) -> list[object]:
        return [
            keys.heartbeat_prefix(model), keys.grant_prefix(model), int(time.time() * 1000),
            int(self._s.lease_ttl_s * 1000), self._s.reserved_slots, self._s.urgent_priority_max,
            *extra,
        ]

    def score(self, priority: int, boost: bool) -> float:
        now_ms = time.time() * 1000
        if boost:
            return _BOOST + now_ms
        if self._s.priority_aging_s > 0:
            return now_ms + priority * self._s.priority_aging_s * 1000
        return priority * _STRICT + now_ms

    async def acquire(
        self,
        model: str,
        lease_id: str,
        *,
        priority: int = 0,
        exclude: list[str] | tuple[str, ...] = (),
        queue_deadline: float | None = None,
        boost: bool = False,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> Lease:
        """A slot now, or after waiting in the queue until ``queue_deadline`` (epoch seconds)."""
        deadline = queue_deadline or time.time() + self._s.queue_timeout_s
        result = await self._acquire(
            keys=keys.admission(model),
            args=self._args(model, lease_id, self.score(priority, boost), int(deadline * 1000),
                            self._s.max_queue, orjson.dumps(list(exclude)).decode(), priority),
        )
        status = result[0].decode()
        if status == "granted":
            return self._granted(model, lease_id, result[1])
        if status == "none":
            raise await self._no_worker(model, bool(exclude))
        if status == "full":
            raise RateLimited(
                f"the queue for '{model}' is full ({int(result[1])} waiting)",
                retry_after_s=await self.retry_after_s(model, int(result[1])), code="queue_full",
            )
        return await self._wait(model, lease_id, deadline, disconnected)

    async def _wait(
        self, model: str, lease_id: str, deadline: float,
        disconnected: Callable[[], Awaitable[bool]] | None,
    ) -> Lease:
        grant_key = keys.grant_prefix(model) + lease_id
        try:
            while (remaining := deadline - time.time()) > 0.001:
                # Redis counts BLPOP timeouts in whole milliseconds, and 0 means forever.
                got = await self._redis.blpop([grant_key], timeout=max(0.01, min(remaining, 1.0)))
                if got is not None:
                    if b'"none"' in got[1]:
                        raise await self._no_worker(model, True)
                    return self._granted(model, lease_id, got[1])
                if disconnected is not None and await disconnected():
                    await self._leave_and_release(model, lease_id)
                    raise ClientGone("client disconnected while queued")
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await self._leave_and_release(model, lease_id)
            raise
        rank = await self._redis.zrank(keys.queue(model), lease_id)
        lease = await self._leave(model, lease_id)
        if lease is not None:
            return lease  # granted at the last moment: serve it
        position = int(rank) if rank is not None else 0
        raise RateLimited(
            f"no capacity for '{model}' within the queue timeout ({position} ahead)",
            retry_after_s=await self.retry_after_s(model, position), code="queue_timeout",
        )

    async def _leave_and_release(self, model: str, lease_id: str) -> None:
        lease = await self._leave(model, lease_id)
        if lease is not None:
            await self.release(lease)

    async def _leave(self, model: str, lease_id: str) -> Lease | None:
        """Leave the queue; if a grant raced in, return it (the caller serves or releases it)."""
        result = await self._cancel(keys=keys.admission(model), args=self._args(model, lease_id))
        if result[0] == b"granted":
            return self._granted(model, lease_id, result[1])
        return None

    def _granted(self, model: str, lease_id: str, grant: bytes) -> Lease:
        record = orjson.loads(grant)
        self._active[lease_id] = model
        return Lease(model=model, lease_id=lease_id, worker_id=record["id"], url=record["url"])

    async def _no_worker(self, model: str, retried: bool) -> SluiceError:
        if not retried and await self.live_workers(model) == 0:
            if not await self._redis.sismember(keys.MODELS, model):
                return ModelNotFound(f"The model '{model}' does not exist", param="model")
            return Unavailable(f"model '{model}' has no live worker", retry_after_s=2)
        return Unavailable(f"every live worker for '{model}' failed this request", retry_after_s=1)

    async def release(self, lease: Lease) -> None:
        """Give the slot back; with Redis unreachable the lease simply expires and is reaped."""
        self._active.pop(lease.lease_id, None)
        try:
            await self._release(keys=keys.admission(lease.model), args=self._args(lease.model, lease.lease_id))
        except (RedisError, OSError) as exc:
            log.warning("could not release lease %s (%s); it will expire", lease.lease_id, exc)

    async def retry_after_s(self, model: str, position: int) -> float:
        """Seconds until ``position`` requests ahead have drained at the recent service rate."""
        stamps = [int(x) for x in await self._redis.lrange(keys.done(model), 0, -1)]
        now_ms = time.time() * 1000
        recent = [t for t in stamps if now_ms - t <= _RATE_WINDOW_MS]
        if len(recent) < 2:
            return float(min(self._s.queue_timeout_s, 60))
        span_s = max((now_ms - min(recent)) / 1000, 1.0)
        rate = len(recent) / span_s
        return float(min(max(1, math.ceil((position + 1) / rate)), 120))

    async def queue_depths(self, model: str) -> dict[str, int]:
        """Waiting requests per priority class (reads the queue's metadata; bounded by max_queue)."""
        depths = {"urgent": 0, "default": 0, "low": 0}
        for raw in await self._redis.hvals(keys.admission(model)[5]):
            depths[priority_class(int(orjson.loads(raw).get("priority") or 0))] += 1
        return depths

    async def live_workers(self, model: str) -> int:
        return int(await self._live(keys=[keys.workers(model)], args=[keys.heartbeat_prefix(model)]))

    async def live_models(self) -> list[str]:
        models = sorted(m.decode() for m in await self._redis.smembers(keys.MODELS))
        return [m for m in models if await self.live_workers(m) > 0]

    async def _renew_loop(self) -> None:
        period = self._s.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            by_model: dict[str, list[str]] = {}
            for lease_id, model in list(self._active.items()):
                by_model.setdefault(model, []).append(lease_id)
            for model, lease_ids in by_model.items():
                try:
                    await self._renew(keys=keys.admission(model), args=self._args(model, *lease_ids))
                except (RedisError, OSError) as exc:
                    log.warning("lease renewal failed: %s", exc)

    async def reap_once(self) -> int:
        reaped = 0
        for model in await self._redis.smembers(keys.MODELS):
            m = model.decode()
            reaped += int(await self._reap(keys=keys.admission(m), args=self._args(m)))
        if reaped:
            log.warning("reclaimed %d expired lease(s) of a gateway that stopped renewing", reaped)
        return reaped

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._s.reap_interval_s)
            try:
                await self.reap_once()
            except (RedisError, OSError) as exc:
                log.warning("lease reaper failed: %s", exc)


# KEYS: workers hash. ARGV: heartbeat prefix. Returns the number of live workers.
_LIVE = """
local ids = redis.call('HKEYS', KEYS[1])
local live = 0
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[1] .. id) == 1 then live = live + 1 end
end
return live
"""
