"""Choosing a worker: the least-loaded live worker of a model, atomically in Redis.

A worker is live while its heartbeat key exists. In-flight counts live in
``sl:{m}:inflight``, so every gateway replica sees the same load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from sluice import keys
from sluice.errors import ModelNotFound, Unavailable

# KEYS: workers hash, inflight hash. ARGV: heartbeat prefix, random rotation, excluded ids...
# Returns {live_count} when nothing can be picked, else {live_count, id, record}.
_PICK = """
local entries = redis.call('HGETALL', KEYS[1])
local n = #entries / 2
local excluded = {}
for i = 3, #ARGV do excluded[ARGV[i]] = true end
local live, best, best_load, best_rec = 0, nil, nil, nil
local rot = tonumber(ARGV[2]) % math.max(n, 1)
for j = 0, n - 1 do
  local i = ((j + rot) % n) * 2 + 1
  local id, rec = entries[i], entries[i + 1]
  if redis.call('EXISTS', ARGV[1] .. id) == 1 then
    live = live + 1
    if not excluded[id] then
      local cap = tonumber(cjson.decode(rec).capacity) or 1
      local load = tonumber(redis.call('HGET', KEYS[2], id) or '0') / math.max(cap, 1)
      if best == nil or load < best_load then best, best_load, best_rec = id, load, rec end
    end
  else
    redis.call('HDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  end
end
if best == nil then return {live} end
redis.call('HINCRBY', KEYS[2], best, 1)
return {live, best, best_rec}
"""

# KEYS: inflight hash. ARGV: worker id. Never lets a count go below zero.
_RELEASE = """
local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if v > 0 then redis.call('HINCRBY', KEYS[1], ARGV[1], -1) end
return v
"""

# KEYS: workers hash. ARGV: heartbeat prefix. Returns the number of live workers.
_LIVE = """
local ids = redis.call('HKEYS', KEYS[1])
local live = 0
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[1] .. id) == 1 then live = live + 1 end
end
return live
"""


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker chosen for one request; hand it back with :meth:`Router.release`."""

    model: str
    worker_id: str
    url: str


class Router:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pick = redis.register_script(_PICK)
        self._release = redis.register_script(_RELEASE)
        self._live = redis.register_script(_LIVE)

    async def acquire(self, model: str, exclude: list[str] | tuple[str, ...] = ()) -> Lease:
        result = await self._pick(
            keys=[keys.workers(model), keys.inflight(model)],
            args=[keys.heartbeat_prefix(model), random.randrange(1 << 30), *exclude],
        )
        live = int(result[0])
        if len(result) == 1:
            if live == 0 and not await self._redis.sismember(keys.MODELS, model):
                raise ModelNotFound(f"The model '{model}' does not exist", param="model")
            reason = "no live worker" if live == 0 else "every live worker failed this request"
            raise Unavailable(f"model '{model}' is unavailable: {reason}", retry_after_s=2)
        record = orjson.loads(result[2])
        return Lease(model=model, worker_id=result[1].decode(), url=record["url"])

    async def release(self, lease: Lease) -> None:
        await self._release(keys=[keys.inflight(lease.model)], args=[lease.worker_id])

    async def live_workers(self, model: str) -> int:
        return int(await self._live(keys=[keys.workers(model)], args=[keys.heartbeat_prefix(model)]))

    async def live_models(self) -> list[str]:
        models = sorted(m.decode() for m in await self._redis.smembers(keys.MODELS))
        return [m for m in models if await self.live_workers(m) > 0]
