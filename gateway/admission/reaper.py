"""The lease reaper: one gateway process per period, whatever the number of processes.

Every gateway process wakes each ``reap_interval_s``, but only the one that takes the
period's lock (``SET sl:reaper NX PX interval``) reaps: for each model of the directory it
reclaims leases whose holder stopped renewing them (REAP, gateway/admission/scripts.py), and checks
whether anything still serves the model (:data:`VACANCY`). So Redis does one reap per model
per period plus one ``SET`` per process, not one reap per model per process.

A model with no worker, no lease and no waiter is marked vacant; one vacant for
:data:`~sluice.keys.MODEL_FORGET_S` (``model_forget_s``) leaves the directory, and its keys
(fair-queuing clock, completion times, prefix index...) are deleted. A worker that comes
back registers its model again with its next beat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from gateway.config import GatewaySettings
from sluice import keys
from sluice.directory import Directory

log = logging.getLogger("sluice.admission")

#: Every this many reaps, ``inflight`` is recounted from the leases.
_RECONCILE_EVERY = 10

#: KEYS :func:`sluice.keys.model_keys` (the admission keys first: workers, alive, inflight,
#: leases, lease_owner, urgent queue, normal queue, ...; stats and vacant last). ARGV 1 how
#: long (ms) a model stays vacant before it is forgotten (the vacancy mark expires after
#: twice that, at least a minute, so it never outlives a forgotten model). Also drops the engine stats of
#: workers that are no longer registered. Returns 1 when the model was forgotten (its keys
#: deleted: the caller takes it out of the directory), else 0.
VACANCY = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local K_WORKERS, K_LEASES, K_QURGENT, K_QNORMAL = KEYS[1], KEYS[4], KEYS[6], KEYS[7]
local K_STATS, K_VACANT = KEYS[#KEYS - 1], KEYS[#KEYS]
for _, id in ipairs(redis.call('HKEYS', K_STATS)) do
  if redis.call('HEXISTS', K_WORKERS, id) == 0 then redis.call('HDEL', K_STATS, id) end
end
if redis.call('HLEN', K_WORKERS) > 0 or redis.call('ZCARD', K_LEASES) > 0
   or redis.call('ZCARD', K_QURGENT) > 0 or redis.call('ZCARD', K_QNORMAL) > 0 then
  redis.call('DEL', K_VACANT)
  return 0
end
local since = tonumber(redis.call('GET', K_VACANT) or '0')
if since == 0 then
  -- With a TTL: a reaper that listed the model just before another forgot it comes here
  -- after its keys are gone, and a marker without one outlived the model for good.
  redis.call('SET', K_VACANT, now, 'PX', math.max(2 * tonumber(ARGV[1]), 60000))
  return 0
end
if now - since < tonumber(ARGV[1]) then return 0 end
redis.call('DEL', unpack(KEYS))
return 1
"""

ReapModel = Callable[[str, bool], Awaitable[tuple[int, int]]]


class Reaper:
    def __init__(self, redis: Any, settings: GatewaySettings, reap_model: ReapModel, owner: str) -> None:
        self._redis = redis
        self._s = settings
        self._reap_model = reap_model
        self._owner = owner
        self._directory = Directory(redis)
        self._vacancy = redis.register_script(VACANCY)
        self._reaps = 0

    async def reap_once(self, reconcile: bool | None = None, *, contend: bool = True) -> int | None:
        """Reap every model of the directory, if this process holds this period's lock (or
        ``contend`` is off). Returns the leases reclaimed, or None when another process
        reaps this period. Every tenth reap (or when asked) also recounts slots in use."""
        if contend and not await self._redis.set(keys.REAPER, self._owner, nx=True,
                                                 px=max(1, int(self._s.reap_interval_s * 1000))):
            return None
        self._reaps += 1
        if reconcile is None:
            reconcile = self._reaps % _RECONCILE_EVERY == 0
        reaped = 0
        for model in await self._directory.models():
            expired, corrections = await self._reap_model(model, reconcile)
            reaped += expired
            if corrections:
                log.warning("recounted slots in use for %r from its leases (%d corrected)", model, corrections)
            if await self._vacancy(keys=keys.model_keys(model), args=[int(self._s.model_forget_s * 1000)]):
                await self._directory.forget(model)
                log.info("forgot model %r: no worker, lease or waiter for %gs", model, self._s.model_forget_s)
        if reaped:
            log.warning("reclaimed %d expired lease(s) of a gateway that stopped renewing", reaped)
        return reaped

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._s.reap_interval_s)
            try:
                await self.reap_once()
            except (RedisError, OSError) as exc:
                log.warning("lease reaper failed: %s", exc)
