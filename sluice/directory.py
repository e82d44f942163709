"""The model directory and the registry's epoch, shared by workers and gateways.

The directory (``sl:models``) lists the models that have workers. Every worker beat adds
its model; the gateway that reaps removes a model whose last worker has been gone for
:data:`~sluice.keys.MODEL_FORGET_S` (gateway/reaper.py), so the directory, and every loop
over it, follows the models really served, not every name ever registered.

The epoch (``sl:epoch``) is one id created with the registry, by whichever worker beat or
gateway comes first, on Redis's clock. Redis that loses its data (a restart without
persistence, a failover to a replica that had not synced, ``FLUSHALL``) loses the epoch
too; the next beat creates a new id. A gateway that sees the id change knows its queued
requests are no longer in Redis (it queues them again), and a registry younger than
:data:`~sluice.keys.REGISTRY_REBUILD_S` may still miss workers that have not beaten since:
a model unknown to it is a 503 to retry, not a 404.

>>> epoch = await Directory(redis).epoch()
>>> epoch.id, epoch.age_s
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sluice import keys

# KEYS epoch. ARGV a new id, used if there is no epoch yet. Returns {id, age (ms)}.
_EPOCH = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local got = redis.call('HMGET', KEYS[1], 'id', 'at')
if not got[1] then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'at', now)
  return {ARGV[1], 0}
end
return {got[1], now - tonumber(got[2] or now)}
"""


@dataclass(frozen=True, slots=True)
class Epoch:
    id: str
    age_s: float

    @property
    def rebuilding(self) -> bool:
        """Workers may still be missing from a registry this young."""
        return self.age_s < keys.REGISTRY_REBUILD_S


class Directory:
    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._epoch = redis.register_script(_EPOCH)

    async def epoch(self) -> Epoch:
        """The registry's epoch, created now if Redis has none."""
        epoch_id, age_ms = await self._epoch(keys=[keys.EPOCH], args=[uuid.uuid4().hex])
        return Epoch(epoch_id.decode() if isinstance(epoch_id, bytes) else str(epoch_id), int(age_ms) / 1000)

    async def register(self, model: str) -> None:
        """A worker of ``model`` is alive: list the model, and make sure the epoch exists."""
        await self._redis.sadd(keys.MODELS, model)
        await self.epoch()

    async def models(self) -> list[str]:
        return sorted(m.decode() for m in await self._redis.smembers(keys.MODELS))

    async def listed(self, model: str) -> bool:
        return bool(await self._redis.sismember(keys.MODELS, model))

    async def forget(self, model: str) -> None:
        await self._redis.srem(keys.MODELS, model)
