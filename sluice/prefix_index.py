"""The prefix index every gateway replica shares: which workers hold which prompt blocks.

One hash per model maps a block hash (:mod:`sluice.prefix`) to the workers believed to
hold it; a zset keeps each block's last use, and the index drops its least recently
used blocks past :data:`sluice.keys.PREFIX_BLOCKS_KEPT` and its oldest holders past
:data:`sluice.keys.PREFIX_HOLDERS` per block, so it stays bounded whatever the traffic.

Three writers keep it close to the truth:

- routing (the admission scripts, in the same call that grants the slot): a request's
  blocks are marked held by the worker it was sent to -- the engine is about to cache
  them. This is the approximate part: it is right as soon as the worker has prefilled;
- the engines (:data:`EVENTS`): a worker reports the blocks its engine stored and
  evicted (KV events), so evictions leave the index (precise wherever the engine names
  blocks with these hashes, as the simulator does);
- every response (:data:`CORRECT`): when the engine reports fewer ``cached_tokens``
  than the router expected, the blocks past what it really had are no longer credited
  to that worker.

The Lua functions here are shared by the admission scripts (``gateway/admission/scripts.py``)
and this module's scripts; both touch only the keys of :func:`sluice.keys.prefix_index`,
which carry the model's hash tag (one Cluster slot).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from redis.exceptions import RedisError

from sluice import keys

log = logging.getLogger("sluice.prefix")

#: Lua: index helpers; expects ``now`` (ms) in scope where ``holders_add`` is called.
FUNCTIONS = f"local PREFIX_KEPT, PREFIX_HOLDERS = {keys.PREFIX_BLOCKS_KEPT}, {keys.PREFIX_HOLDERS}\n" + r"""
local function holds(list, w)
  return string.find(' ' .. list .. ' ', ' ' .. w .. ' ', 1, true) ~= nil
end

-- For each worker id, how many leading blocks of `hashes` it holds.
local function prefix_matches(hkey, hashes)
  local out = {}
  if #hashes == 0 then return out end
  local vals = redis.call('HMGET', hkey, unpack(hashes))
  local alive = nil
  for i = 1, #hashes do
    local v = vals[i]
    if not v then break end
    local nxt, any = {}, false
    for id in string.gmatch(v, '%S+') do
      if alive == nil or alive[id] then
        nxt[id] = true
        out[id] = i
        any = true
      end
    end
    if not any then break end
    alive = nxt
  end
  return out
end

-- Mark `hashes` held by worker w (most recent holder last), refresh their recency, and
-- drop the least recently used blocks past the cap. The first `known` blocks are already
-- known to be held by w (they are only touched).
local function holders_add(hkey, lkey, hashes, w, at, known)
  if #hashes == 0 then return end
  known = known or 0
  local vals = {}
  if known < #hashes then vals = redis.call('HMGET', hkey, unpack(hashes, known + 1)) end
  local sets, touch = {}, {}
  for i, h in ipairs(hashes) do
    local v = vals[i - known]
    if i <= known then
    elseif not v then
      sets[#sets + 1] = h
      sets[#sets + 1] = w
    elseif not holds(v, w) then
      local list = {}
      for id in string.gmatch(v, '%S+') do list[#list + 1] = id end
      list[#list + 1] = w
      while #list > PREFIX_HOLDERS do table.remove(list, 1) end
      sets[#sets + 1] = h
      sets[#sets + 1] = table.concat(list, ' ')
    end
    touch[#touch + 1] = at
    touch[#touch + 1] = h
  end
  if #sets > 0 then redis.call('HSET', hkey, unpack(sets)) end
  redis.call('ZADD', lkey, unpack(touch))
  local excess = redis.call('ZCARD', lkey) - PREFIX_KEPT
  if excess > 0 then
    local old = redis.call('ZRANGE', lkey, 0, math.min(excess, 1024) - 1)
    redis.call('HDEL', hkey, unpack(old))
    redis.call('ZREM', lkey, unpack(old))
  end
end

-- Worker w no longer holds `hashes`.
local function holders_remove(hkey, hashes, w)
  if #hashes == 0 then return end
  local vals = redis.call('HMGET', hkey, unpack(hashes))
  for i, h in ipairs(hashes) do
    local v = vals[i]
    if v and holds(v, w) then
      local list = {}
      for id in string.gmatch(v, '%S+') do
        if id ~= w then list[#list + 1] = id end
      end
      if #list == 0 then redis.call('HDEL', hkey, h) else redis.call('HSET', hkey, h, table.concat(list, ' ')) end
    end
  end
end
"""

_CLOCK = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

#: KEYS prefix, prefix_lru. ARGV 1 worker id, 2 KV events JSON [{type, block_hashes}, ...]
#: in order. Returns the number of events applied.
EVENTS = FUNCTIONS + _CLOCK + r"""
local events = cjson.decode(ARGV[2])
for _, e in ipairs(events) do
  if e.type == 'stored' then holders_add(KEYS[1], KEYS[2], e.block_hashes, ARGV[1], now)
  elseif e.type == 'removed' then holders_remove(KEYS[1], e.block_hashes, ARGV[1]) end
end
return #events
"""

#: KEYS prefix, prefix_lru. ARGV 1 worker id, 2.. block hashes it did not have after all.
CORRECT = FUNCTIONS + r"""
local hashes = {}
for i = 2, #ARGV do hashes[#hashes + 1] = ARGV[i] end
holders_remove(KEYS[1], hashes, ARGV[1])
return #hashes
"""


class PrefixIndex:
    """The index's writers outside admission: engine KV events and response corrections."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._events = redis.register_script(EVENTS)
        self._correct = redis.register_script(CORRECT)

    async def report(self, model: str, worker_id: str, events: list[Any]) -> None:
        """A worker's engine KV events (stored / removed blocks), oldest first."""
        for start in range(0, len(events), 256):
            await self._events(keys=keys.prefix_index(model),
                               args=[worker_id, orjson.dumps(events[start:start + 256])])

    async def correct(self, model: str, worker_id: str, hashes: list[str]) -> None:
        """``worker_id`` did not have ``hashes`` cached, whatever the index said."""
        if not hashes:
            return
        try:
            await self._correct(keys=keys.prefix_index(model), args=[worker_id, *hashes])
        except (RedisError, OSError) as exc:
            log.warning("could not correct the prefix index: %s", exc)
