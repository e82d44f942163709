"""The model directory and the registry's epoch, shared by workers and gateways.

The directory (``sl:models``) lists the models that have workers. Every worker beat adds
its model; the gateway that reaps removes a model whose last worker has been gone for
:data:`~sluice.keys.MODEL_FORGET_S` (gateway/admission/reaper.py), so the directory, and every loop
over it, follows the models really served, not every name ever registered.

The epoch (``sl:epoch``) is one id created with the registry, by whichever worker beat or
gateway comes first, on Redis's clock. Redis that loses its data (a restart without
persistence, a failover to a replica that had not synced, ``FLUSHALL``) loses the epoch
too; the next beat creates a new id. A process that knew the previous id (a worker, a
gateway) marks the new epoch as following a loss: a gateway then queues its waiting
requests again, and for :data:`~sluice.keys.REGISTRY_REBUILD_S` a model unknown to the
registry is a 503 to retry (its workers may not have beaten since), not a 404. A fresh
registry (nobody knew an earlier epoch) is not marked: a typo there is a 404 at once.

>>> directory = Directory(redis)
>>> epoch = await directory.epoch(seen=None)
>>> epoch.id, epoch.age_s, epoch.rebuilding
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from sluice import keys

# KEYS epoch. ARGV 1 a new id, used if there is no epoch yet; 2 the id the caller knew ('':
# none). Returns {id, age (ms), 1 if it follows a loss}.
_EPOCH = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local got = redis.call('HMGET', KEYS[1], 'id', 'at', 'lost')
if not got[1] then
  got = {ARGV[1], now, false}
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'at', now)
end
if ARGV[2] ~= '' and ARGV[2] ~= got[1] and not got[3] then
  redis.call('HSET', KEYS[1], 'lost', 1)
  got[3] = '1'
end
-- an epoch without its time (written by hand, or half restored) counts from now, not an error
-- in every process's next beat and look
local at = tonumber(got[2])
if not at then
  at = now
  redis.call('HSET', KEYS[1], 'at', now)
end
return {got[1], now - at, got[3] and 1 or 0}
"""


@dataclass(frozen=True, slots=True)
class Epoch:
    id: str
    age_s: float
    #: Someone knew an earlier epoch: Redis lost its data (rather than starting empty).
    after_loss: bool

    @property
    def rebuilding(self) -> bool:
        """Workers may still be missing from this registry: they have not beaten since the loss;
        or the epoch is too young for every process that knew an earlier one to have marked
        it (a gateway process started after the loss made it: the nemesis, Sentinel, got two
        404s for a served model from a gateway restarted while Redis was away)."""
        if self.after_loss:
            return self.age_s < keys.REGISTRY_REBUILD_S
        return self.age_s < keys.API_KEYS_UNMARKED_S

    @property
    def keys_restore_s(self) -> float:
        """How much longer API keys Redis lacks may be ones gateways are writing back: an
        epoch marked as following a loss gives them :data:`~sluice.keys.API_KEYS_RESTORE_S`;
        an unmarked one :data:`~sluice.keys.API_KEYS_UNMARKED_S`, long enough for any
        process that knew an earlier epoch to mark it. 0 when that time is over."""
        limit = keys.API_KEYS_RESTORE_S if self.after_loss else keys.API_KEYS_UNMARKED_S
        return max(0.0, limit - self.age_s)


class Directory:
    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._epoch = redis.register_script(_EPOCH)

    async def epoch(self, seen: str | None) -> Epoch:
        """The registry's epoch, created now if Redis has none; ``seen``: the id the caller
        knew before (None: none), which marks a new epoch as following a loss."""
        epoch_id, age_ms, lost = await self._epoch(keys=[keys.EPOCH], args=[uuid.uuid4().hex, seen or ""])
        return Epoch(epoch_id.decode() if isinstance(epoch_id, bytes) else str(epoch_id), int(age_ms) / 1000,
                     bool(lost))

    async def register(self, model: str, seen: str | None) -> Epoch:
        """A worker of ``model`` is alive: list the model, and make sure the epoch exists."""
        await self._redis.sadd(keys.MODELS, model)
        return await self.epoch(seen)

    async def models(self) -> list[str]:
        return sorted(m.decode() for m in await self._redis.smembers(keys.MODELS))

    async def listed(self, model: str) -> bool:
        return bool(await self._redis.sismember(keys.MODELS, model))

    @property
    def clustered(self) -> bool:
        return isinstance(self._redis, RedisCluster)

    async def epoch_id(self) -> bytes | None:
        """The epoch's id alone (None: the registry is gone): one command on one server."""
        return await self._redis.hget(keys.EPOCH, "id")

    async def look(self) -> tuple[bytes | None, str]:
        """The epoch's id (None: the registry is gone), and which server processes answer
        (their ``run_id``s; on a Cluster every master's, since a loss on one node leaves the
        epoch, on another, as it was). A new epoch, or other servers (a restart, a failover
        to a replica that lacked the last writes), is when processes that keep copies of
        what Redis may have lost write them back (gateway/streams/journal_keeper.py,
        gateway/admission/key_keeper.py)."""
        if isinstance(self._redis, RedisCluster):
            epoch = await self._redis.hget(keys.EPOCH, "id")
            infos = await self._redis.info("server", target_nodes=RedisCluster.PRIMARIES)
            return epoch, ",".join(sorted(str(info.get("run_id")) for info in infos.values()))
        pipe = self._redis.pipeline(transaction=False)
        self.queue_look(pipe)
        return self.looked(await pipe.execute())

    @staticmethod
    def queue_look(pipe: Any) -> None:
        """Queue :meth:`look`'s commands (one server, not a Cluster) on ``pipe``, after what is
        already queued there: Redis answers them after it, on the same connection."""
        pipe.hget(keys.EPOCH, "id")
        pipe.info("server")

    @staticmethod
    def looked(replies: list[Any]) -> tuple[bytes | None, str]:
        """:meth:`look`'s answer from the replies to :meth:`queue_look`'s commands."""
        epoch, info = replies
        return epoch, str(info.get("run_id"))

    async def forget(self, model: str) -> None:
        await self._redis.srem(keys.MODELS, model)
