"""Admission in Lua: each entry point runs atomically in Redis, so every gateway replica
shares one priority queue and one view of worker slots.

KEYS (all carry the model's hash tag, so one script touches one Cluster slot):
    1 workers   2 inflight   3 leases   4 lease owners   5 queue   6 queue meta   7 done
    8 urgent-seen marker (exists while urgent requests arrived within the last minute)
ARGV (shared): 1 heartbeat key prefix, 2 grant key prefix, 3 (unused: time comes from Redis),
               4 lease TTL (ms),
               5 share of each worker's slots reserved for urgent requests,
               6 highest priority value that counts as urgent (lower is more urgent)

Grant lists (``sl:{m}:grant:{request}``) are derived inside the scripts from the
grant prefix; they share the model's hash tag, hence the same slot.
"""

from __future__ import annotations

_PRELUDE = r"""
local workers_key, inflight_key, leases_key, owner_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local queue_key, qmeta_key, done_key, urgent_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local hb_prefix, grant_prefix = ARGV[1], ARGV[2]
local lease_ttl = tonumber(ARGV[4])
-- Redis's clock, not the calling gateway's: leases must not depend on replicas' clock skew.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local reserve, urgent_max = tonumber(ARGV[5]), tonumber(ARGV[6])

-- Live workers (heartbeat present) with their capacity and slots in use.
local function live_workers()
  local entries = redis.call('HGETALL', workers_key)
  local out = {}
  for i = 1, #entries, 2 do
    local id, rec = entries[i], entries[i + 1]
    if redis.call('EXISTS', hb_prefix .. id) == 1 then
      local r = cjson.decode(rec)
      out[#out + 1] = {id = id, url = r.url, cap = math.max(tonumber(r.capacity) or 1, 1),
                       used = tonumber(redis.call('HGET', inflight_key, id) or '0')}
    else
      redis.call('HDEL', workers_key, id)
    end
  end
  return out
end

-- Slots a request of this priority may fill on w: all of them for urgent requests,
-- the unreserved share for the rest (never less than one) -- but only while urgent
-- traffic is around; without it, the headroom would just be idle capacity.
local urgent_recently = redis.call('EXISTS', urgent_key) == 1
local function usable(w, priority)
  if priority <= urgent_max or not urgent_recently then return w.cap end
  return math.max(1, w.cap - math.ceil(w.cap * reserve))
end

-- The least-loaded worker with a slot this priority may use, not excluded; nil if none.
local function choose(ws, excluded, priority)
  local best = nil
  for _, w in ipairs(ws) do
    if w.used < usable(w, priority) and not excluded[w.id] then
      if best == nil or w.used / w.cap < best.used / best.cap then best = w end
    end
  end
  return best
end

local function all_excluded(ws, excluded)
  for _, w in ipairs(ws) do
    if not excluded[w.id] then return false end
  end
  return true
end

local function deliver(req, payload)
  local g = grant_prefix .. req
  redis.call('RPUSH', g, payload)
  redis.call('PEXPIRE', g, lease_ttl)
end

-- A slot on w for req: count it, lease it (renewed while the stream runs), tell the waiter.
local function grant(w, req)
  w.used = w.used + 1
  redis.call('HINCRBY', inflight_key, w.id, 1)
  redis.call('ZADD', leases_key, now + lease_ttl, req)
  redis.call('HSET', owner_key, req, w.id)
  deliver(req, cjson.encode({id = w.id, url = w.url}))
end

local function dequeue(req)
  redis.call('ZREM', queue_key, req)
  redis.call('HDEL', qmeta_key, req)
end

local function any_free(ws)
  for _, w in ipairs(ws) do
    if w.used < w.cap then return true end
  end
  return false
end

-- Hand free slots to waiting requests in priority order. An entry that cannot use
-- any free slot (its workers are excluded or full, or only urgent slots are left)
-- is skipped, not allowed to block the ones behind it; the scan is bounded.
local function pump(ws)
  local granted = 0
  local window = redis.call('ZRANGE', queue_key, 0, 63)
  for _, req in ipairs(window) do
    if not any_free(ws) then break end
    local meta = cjson.decode(redis.call('HGET', qmeta_key, req) or '{}')
    local excluded = {}
    for _, id in ipairs(meta.exclude or {}) do excluded[id] = true end
    if (tonumber(meta.deadline) or 0) < now then
      dequeue(req)                                  -- its waiter has given up
    elseif #ws == 0 or all_excluded(ws, excluded) then
      dequeue(req)                                  -- nothing live can ever serve it
      deliver(req, '{"none":true}')
    else
      local w = choose(ws, excluded, tonumber(meta.priority) or 0)
      if w ~= nil then
        dequeue(req)
        grant(w, req)
        granted = granted + 1
      end
    end
  end
  return granted
end

-- Give a lease's slot back. Returns 1 if the lease existed.
local function free_lease(req)
  redis.call('ZREM', leases_key, req)
  local w = redis.call('HGET', owner_key, req)
  if not w then return 0 end
  redis.call('HDEL', owner_key, req)
  if tonumber(redis.call('HGET', inflight_key, w) or '0') > 0 then
    redis.call('HINCRBY', inflight_key, w, -1)
  end
  return 1
end
"""

#: ARGV 7 request id, 8 queue score, 9 queue deadline (ms), 10 max queue length,
#: 11 excluded ids (JSON), 12 priority.
#: Returns {'granted', grant JSON} | {'queued', rank} | {'full', length} | {'none'}.
ACQUIRE = _PRELUDE + r"""
local req = ARGV[7]
if tonumber(ARGV[12]) <= urgent_max then
  redis.call('SET', urgent_key, '1', 'PX', 60000)
  urgent_recently = true
end
local ws = live_workers()
if #ws == 0 then return {'none'} end
local length = redis.call('ZCARD', queue_key)
if length >= tonumber(ARGV[10]) then return {'full', length} end
redis.call('ZADD', queue_key, tonumber(ARGV[8]), req)
redis.call('HSET', qmeta_key, req, cjson.encode({deadline = tonumber(ARGV[9]),
  exclude = cjson.decode(ARGV[11]), priority = tonumber(ARGV[12])}))
pump(ws)
local g = redis.call('LPOP', grant_prefix .. req)
if g then
  if string.find(g, '"none"', 1, true) then return {'none'} end
  return {'granted', g}
end
return {'queued', redis.call('ZRANK', queue_key, req)}
"""

#: ARGV 7 lease (request) id. Frees the slot and hands it to the queue's head.
RELEASE = _PRELUDE + r"""
local freed = free_lease(ARGV[7])
if freed == 1 then
  redis.call('LPUSH', done_key, now)
  redis.call('LTRIM', done_key, 0, 255)
end
pump(live_workers())
return freed
"""

#: ARGV 7 request id. A waiter leaves the queue: {'removed'} | {'granted', grant JSON} | {'gone'}.
CANCEL = _PRELUDE + r"""
local req = ARGV[7]
if redis.call('ZREM', queue_key, req) == 1 then
  redis.call('HDEL', qmeta_key, req)
  return {'removed'}
end
local g = redis.call('LPOP', grant_prefix .. req)
if g and not string.find(g, '"none"', 1, true) then return {'granted', g} end
return {'gone'}
"""

#: Reclaims leases whose holder stopped renewing them (a dead gateway), then pumps.
REAP = _PRELUDE + r"""
local expired = redis.call('ZRANGEBYSCORE', leases_key, '-inf', now, 'LIMIT', 0, 256)
for _, req in ipairs(expired) do free_lease(req) end
pump(live_workers())
return #expired
"""

#: ARGV 7.. lease ids held by the calling gateway: push their expiry to now + TTL.
RENEW = _PRELUDE + r"""
for i = 7, #ARGV do
  redis.call('ZADD', leases_key, 'XX', now + lease_ttl, ARGV[i])
end
return #ARGV - 6
"""
