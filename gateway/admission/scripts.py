"""Admission in Lua: each entry point runs atomically in Redis, so every gateway replica
shares one priority queue and one view of worker slots.

KEYS: :class:`sluice.keys.AdmissionKeys`, in its order (all carry the model's hash tag,
so one script touches one Cluster slot, and no script touches a key it was not given).

ARGV (shared): 1 calling gateway process id, 2 lease TTL (ms), 3 gateway liveness TTL (ms),
               4 share of each worker's slots reserved for urgent requests,
               5 highest priority value that counts as urgent (lower is more urgent),
               6 tokens of service one priority level is worth (0: strict classes)

Time is Redis's (``TIME``), never a gateway's: scores, queue deadlines, leases and
liveness all use one clock, whatever the replicas' clocks say.

Queue order. Two queues per model: ``urgent`` (urgent priorities, and every retry or
migration, which go first of all) is always served before ``normal``. Both order
requests by start-time fair queuing over tenants (API keys), charged in tokens: at its
grant an estimate (prompt estimate + output budget, times its generations), corrected
with the real usage when each of its slots is released (before that slot is handed on);
a tenant's finish tag ``F`` advances by the cost of each request it is served, ``V``
is the start tag of the last request served, and a request starts at
``max(V, F[tenant])``. A tenant that floods the queue only pushes
its own requests back; each backlogged tenant gets slots in proportion to work. In the
normal queue the start tag is taken when a request becomes its tenant's head (one
lexicographic zset holds every tenant's entries in order, ``heads`` scores the tenants),
so requests that time out unserved cost their tenant nothing; the small urgent queue
fixes tags at arrival and refunds unserved ones. Priorities within a class add
``priority * step`` to the tag: a level is worth ``step`` tokens of others' service,
so lower priorities age instead of starving.

A request that finds nobody waiting is granted in ACQUIRE itself, charged to its tenant
as the queue would have charged it, without passing through the queue's keys.

A request needs ``need`` slots (its ``n`` times its prompts) and gets all of them in
one grant or none. The scan stops at the first entry that lacks slots (later ones
would otherwise take them forever); entries blocked only by their excluded workers
are skipped.

Urgent headroom: while urgent requests have been seen in the last minute, the other
classes may fill only ``1 - reserve`` of each worker's slots (at least one), so an urgent
arrival finds a slot under overload. The reserve delays requests, it never refuses one:
a request that needs more slots than the unreserved share of its live workers may fill
every slot, so it is granted once that many are free, and, as any head of the queue, it
holds back the requests behind it only until then. (It was refused outright: a queued
normal ``n=8`` on a cap-8 worker became ungrantable after one urgent request, and every
tenant behind it got 429 with 8 of 8 slots free.) Whether ``need`` is valid (400
``too_big``) depends on the live workers' capacity alone, never on traffic; and a waiting
request that the live workers can no longer hold at all (workers left since it queued)
is answered 503 at once instead of holding back the queue until its timeout.

Grants for waiting requests go to the model's grant stream, tagged with the waiting
gateway process; its one listener hands them to local futures. Entries whose gateway
stopped beating (it died) are dropped instead of granted.

Routing: which live worker with a free slot gets a request. ``least``: the lowest share
of slots in use, a request not yet past its first token counting ``1 + prefill`` (12 by
default), and among the workers within ``spread`` requests of it (3 by default), each in
turn (the next id after the last one taken, kept in Redis for every gateway).
Two ways it went wrong, both in a closed loop of users on one H200 with 4 vLLM workers
(issue 24; tests/gateway/test_least_routing.py runs the loop in virtual time):
- It took the single lowest, ties to the registry's first worker: the worker a request just
  left is the least loaded for its user's next request (the slot it freed), so every user
  went back to the worker it left, for good, and the cohorts of the start's burst prefilled,
  decoded and came back together, in lockstep: 3.4x round robin's TTFT. Hence the spread.
- Counting slots alone, with a spread of 1, it sent a worker its requests in waves: the
  users a worker freed at one engine step all found it the least loaded and came back
  together, and their 1,500-token prompts queued in the worker's front end (HTTP, chat
  template, tokenization: one Python process) before the engine saw them: 2.5-3.2x rr's
  TTFT p90, 67-70 % of a worker's arrivals within 10 ms of the one before (rr 5-7 %).
  Hence the weight: a request waiting for its first token is what the next one would wait
  behind, a decoding one costs it next to nothing; at 12 a worker holding one is passed
  over until the others hold one too, so a wave spills to them after its first request.
  In virtual time (tests/gateway/closed_loop.py's ``H200``, 12 seeds) p90 went from 2.66x
  rr's to 1.04x (spread 3; 1.13x at 1), the arrivals in waves from 60 % to 25 % (rr 10 %).

``rr``: round robin. ``cache`` (prefix affinity, see
:mod:`sluice.prefix_index`): each worker costs the prompt blocks it would have to
prefill, plus the prefill it still owes (``prefill`` per pending block: the uncached
blocks of its requests not yet past their first token), plus its load: ``load`` blocks
per request it runs, scaled by its capacity against the mean capacity of the live workers,

    cost(w) = (blocks - cached_blocks(w)) + prefill * pending_blocks(w)
              + load * in_flight(w) * mean_capacity / capacity(w)

the lowest cost wins (ties: the least loaded). Load counts as a share of each worker's
slots (counted in requests, a cap-8 worker filled to 100% beside a cap-64 one at 12%);
in a fleet of equal workers the term is ``load * in_flight(w)``. The engine prefills one
request after another, so the first two terms are the wait for this request's first
token, with the backlog discounted (``prefill`` < 1): a worker holding the prefix keeps
it until its backlog exceeds another's by 1/``prefill`` times the blocks it saves, and
then the prefix spills to a second worker. Not at once (``prefill`` = 1, the greedy choice for
this one request): a spill makes the fleet prefill the prefix again and takes room in
a second cache, and under prefill-bound overload greedy spills fed the overload
(loadtest/README.md). A grant adds its uncached blocks to its worker's count
(``prefill`` hash) and records them with the lease (``lease_prefill``); the request's
first token (PREFILLED, batched per gateway off the request's path), its release or the
reaper takes them off, and the reaper's recount rebuilds the counts from the leases.
Hot-spot guard: a worker whose share of slots in use exceeds the least-loaded
candidate's by more than ``hot`` gets no credit for its cached blocks, so one popular
prefix spreads to a second worker instead of queueing on one, and a cold (new, empty)
worker gets traffic as soon as the others fill up or owe enough prefill. The same
choice serves a request granted from the queue by a release, so queued requests keep
their affinity. A granted request's blocks are marked held by its worker in the index,
in the same script: routing costs no Redis call on the request's path beyond ACQUIRE.

Large fleets. Reading every worker of the model at every request made admission's cost in
Redis grow with the fleet: 2.6 ms of script time per request at 1,024 workers (one Redis then
admits a few hundred requests a second for the whole fleet), 0.7 ms at 256, against 0.16 at 16
(loadtest/admission_cost.py). A model with more than 4 x ``d`` registered workers (``d``:
``route_sample``, 8 by default) routes a request that finds nobody waiting, and needs one slot
of plain generation (no exclusions, session, adapter or role) by least load or by cache, among
``d`` workers drawn at random (``HRANDFIELD``) plus the workers the prefix index names for its
prompt, each hash read for those ids alone (``HMGET``; workers that do not generate, such
as embedding workers, are left out of the sample). This is the "power of d choices": the
least loaded of a few random workers keeps the fleet's load nearly as even as the least loaded
of all, and cache routing still sees every holder of the prompt's prefix. What changes: least
and cache compare the sample, not the fleet (the hot-spot guard's coolest worker and the mean
capacity are the sample's). A sample with no room, ``rr`` (a turn over every worker) and
everything else read the whole fleet as before, as does a Redis without ``HRANDFIELD``
(before 6.2). A full fleet is sampled too: such a request that finds others waiting joins
them and the pump looks at a sample, and a release hands its slot on through a sample with
its worker in it (a saturated 1,024-worker model cost Redis 9 ms a request there). A pump
that sees part of the fleet (``partial``) grants a plain entry from what it sees; an entry it
cannot serve, or one that is not plain (several slots, exclusions, a session, an adapter, a
role, a task), is judged on the whole fleet, read then, so the queue stops, and entries keep
their session's home and their adapter's holders, as with the whole fleet. A partial view
never decides that no worker can serve an entry, nor lets one into the urgent reserve by the
fleet's room, which it cannot know.

Sessions (:mod:`gateway.admission.affinity`): a request naming a session goes to the first
worker of the session's rendezvous rank within a load bound (``bounded``), or cache routing
charges every worker but the session's home a few blocks more (``cost``). LoRA adapters
(:mod:`gateway.admission.adapters`): the workers that cannot hold the adapter are excluded,
and each pick is among its holders while one may take it, else among the workers with room.
"""

from __future__ import annotations

from gateway.admission import adapters, affinity
from gateway.admission.lua_prelude import Prelude
from sluice import keys, prefix_index, routing_facts

_PRELUDE = f"local GRANTS_KEPT = {keys.GRANTS_KEPT}\n" + prefix_index.FUNCTIONS + affinity.FUNCTIONS + adapters.FUNCTIONS \
    + routing_facts.FUNCTIONS + r"""
local K_WORKERS, K_ALIVE, K_INFLIGHT, K_LEASES, K_OWNER = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_QURGENT, K_QNORMAL, K_META, K_DEPTH, K_GRANTS = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_GATEWAYS, K_FAIR, K_DONE, K_URGENT_SEEN, K_HEADS = KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15]
local K_PREFIX, K_PREFIX_LRU, K_PREFILL, K_LEASE_PREFILL, K_ROUTING = KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20]
local gateway = ARGV[1]
local lease_ttl, gw_ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, urgent_max, step = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- The pump sees part of the fleet (a large fleet's queue paths, see "Large fleets"): it may
-- grant from what it sees, never decide from it that no worker can serve an entry.
local partial = false

-- The calling gateway is alive (it is running this script) -- recorded only where the model
-- has workers or waiters: a client naming a model nobody serves creates no key. Only a
-- gateway's waiting requests need it (the pump drops those of a gateway that stopped
-- beating), so it is recorded where the caller has a request waiting: ACQUIRE queueing it,
-- its beats (RENEW) while it waits, CANCEL, and a RELEASE that finds requests waiting. A
-- request granted at once and a plain release skip it (two Redis calls of each,
-- loadtest/admission_cost.py), and a model no request of this gateway waited in gets no key.
local function mark_alive()
  if redis.call('EXISTS', K_WORKERS, K_META) > 0 then redis.call('HSET', K_GATEWAYS, gateway, now + gw_ttl) end
end

-- Live workers (heartbeat not expired) with their capacity, slots in use and pending
-- prefill (uncached prompt blocks of the requests they hold, counted by cache routing).
-- Each hash is read whole, once (a call per worker per hash cost Redis 8 us a request
-- per worker: the fleet's admission slowed in proportion to its size; loadtest/admission_cost.py).
local function counts(key)
  local out = {}
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do out[flat[i]] = tonumber(flat[i + 1]) end
  return out
end

-- A hash's fields and values, as they are.
local function fields(key)
  local out = {}
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out
end

-- Built per worker per request, so kept lean (a fleet's admission cost grows with it). Most
-- workers serve generation alone: their routing facts (sluice/routing_facts.py) are
-- "<capacity> <url>", read without decoding JSON, and they share their tables. Decoding
-- every worker's record was about half of ACQUIRE's cost per worker (256 workers:
-- loadtest/admission_cost.py). A plain worker's entry is built in live_workers' loop itself:
-- a function call and a pattern per worker were half of what building the entries cost.
local GENERATE_ONLY, NO_LORAS = {generate = true}, {}
local match, find, sub = string.match, string.find, string.sub

-- The entry of a worker whose facts are its record: id, url, capacity, tasks, role, loras,
-- lora_max, ...
local function record_entry(id, record, used, prefill)
  local w = cjson.decode(record)
  local tasks = w.tasks
  if tasks and not (#tasks == 1 and tasks[1] == 'generate') then
    w.serves = {}
    for _, t in ipairs(tasks) do w.serves[t] = true end
  else
    w.serves = GENERATE_ONLY
  end
  w.id, w.cap, w.used = id, math.max(tonumber(w.capacity) or 1, 1), used
  w.prefill, w.role = prefill, w.role or 'both'
  w.loras, w.lora_max = w.loras or NO_LORAS, tonumber(w.lora_max) or 0
  return w
end

-- The worker's URL: in its record, or after its capacity in its facts.
local function url_of(w)
  return w.url or (w.facts and match(w.facts, ' (.+)$')) or ''
end

-- A live worker's entry from its routing facts `f` (or its record), slots in use and pending prefill.
local function entry_of(id, f, used, pending)
  if pending < 0 then pending = 0 end
  -- "<capacity> <url>": the digits before the space (a record has none there)
  local cap = tonumber(sub(f, 1, (find(f, ' ', 1, true) or 1) - 1))
  if cap then
    return {id = id, facts = f, cap = cap > 1 and cap or 1, used = used, prefill = pending,
            role = 'both', serves = GENERATE_ONLY, loras = NO_LORAS, lora_max = 0}
  end
  return record_entry(id, f, used, pending)
end

-- The slots of the workers among `ws` that generate (embedding workers' are not for `n`).
local function generating_room(ws)
  local room = 0
  for _, w in ipairs(ws) do
    if w.serves.generate then room = room + w.cap end
  end
  return room
end

local function live_workers()
  local alive = redis.call('HGETALL', K_ALIVE)
  local prefill, inflight, facts = counts(K_PREFILL), counts(K_INFLIGHT), fields(K_ROUTING)
  local records = nil  -- read (once) only for a worker without facts: see REAP
  local out, n = {}, 0
  for i = 1, #alive, 2 do
    local id = alive[i]
    if tonumber(alive[i + 1]) >= now then
      local f = facts[id]
      if not f then
        records = records or fields(K_WORKERS)
        f = records[id]
      end
      if f then
        n = n + 1
        out[n] = entry_of(id, f, inflight[id] or 0, prefill[id] or 0)
      end
    else
      redis.call('HDEL', K_WORKERS, id)
      redis.call('HDEL', K_ALIVE, id)
      redis.call('HDEL', K_ROUTING, id)
    end
  end
  return out
end

-- The entries of the live workers among `ids` that generate, each hash read for those ids alone.
local function entries_of(ids)
  if #ids == 0 then return {} end
  local beats = redis.call('HMGET', K_ALIVE, unpack(ids))
  local facts = redis.call('HMGET', K_ROUTING, unpack(ids))
  local inflight = redis.call('HMGET', K_INFLIGHT, unpack(ids))
  local prefill = redis.call('HMGET', K_PREFILL, unpack(ids))
  local out = {}
  for i, id in ipairs(ids) do
    if beats[i] and tonumber(beats[i]) >= now then  -- the dead are left to REAP's full scan to tidy
      local f = facts[i] or redis.call('HGET', K_WORKERS, id)
      local w = f and entry_of(id, f, tonumber(inflight[i]) or 0, tonumber(prefill[i]) or 0)
      if w and w.serves.generate then out[#out + 1] = w end  -- (an embedding worker's is no sample)
    end
  end
  return out
end

-- A sample of the live workers that generate, for a large fleet (see "Large fleets" above):
-- `d` drawn at random, the workers `also` names (the prefix index's holders of the prompt's
-- first blocks, a release's freed worker) and their entries. Nil if this Redis has no
-- HRANDFIELD (before 6.2): the caller reads the whole fleet.
local function sampled_workers(d, also)
  local drawn = redis.pcall('HRANDFIELD', K_ALIVE, d)
  if type(drawn) ~= 'table' or drawn.err then return nil end
  local ids, seen = {}, {}
  for _, id in ipairs(drawn) do
    seen[id] = true
    ids[#ids + 1] = id
  end
  for id in pairs(also) do
    if not seen[id] then
      seen[id] = true
      ids[#ids + 1] = id
    end
  end
  return entries_of(ids)
end

-- The workers a request may not use: those that already failed it (`exclude`), those
-- that do not serve its task (`task`: generate, embed, score, tokenize; see sluice/tasks.py),
-- and, for one hop of a disaggregated request (`role`: prefill, decode; nil for a whole
-- request, which any worker may serve), the workers of another role (sluice/roles.py).
local function exclusions(ws, exclude, task, role)
  local excluded = {}
  for _, id in ipairs(exclude or {}) do excluded[id] = true end
  local wanted = task or 'generate'
  for _, w in ipairs(ws) do
    if not w.serves[wanted] or (role and w.role ~= role) then excluded[w.id] = true end
  end
  return excluded
end

-- Whether some live worker is closed to this entry: then it may be passed over while it
-- waits, since the slots it lacks are not the ones others could use.
local function restricted(ws, excluded)
  for _, w in ipairs(ws) do
    if excluded[w.id] then return true end
  end
  return false
end

-- Whether urgent requests came in the last minute: read once, when first needed (a release
-- with nobody waiting never needs it).
local urgent_recently = nil
local function urgent_seen()
  if urgent_recently == nil then urgent_recently = redis.call('EXISTS', K_URGENT_SEEN) == 1 end
  return urgent_recently
end
local function is_urgent(priority) return priority <= urgent_max end

-- Urgent headroom (see the module docstring): the slots of w that the reserve leaves
-- to requests that are not urgent, never less than one.
local function unreserved(w)
  return math.max(1, w.cap - math.ceil(w.cap * reserve))
end

-- Whether a request may fill every slot of its workers (`full`), or only their unreserved
-- share: every slot for urgent requests, and for all while no urgent traffic is around
-- (the headroom would just be idle capacity); and every slot for a request that needs
-- more than the unreserved share of its workers holds, which the reserve would otherwise
-- make ungrantable for as long as urgent traffic lasts.
local function may_fill(ws, excluded, priority, need)
  if is_urgent(priority) or not urgent_seen() then return true end
  if partial then return false end  -- the fleet's room is unknown: the reserve holds
  local room = 0
  for _, w in ipairs(ws) do
    if not excluded[w.id] then room = room + unreserved(w) end
  end
  return need > room
end

local function eligible(w, excluded, full)
  return w.used < (full and w.cap or unreserved(w)) and not excluded[w.id]
end

-- The ids of `ws` in order, and each one's entry. Sorting the ids themselves (no Lua
-- comparator) took half the time of sorting the entries by id (256 workers: 90 against 220 us).
local function by_id(ws)
  local ids, of = {}, {}
  for i, w in ipairs(ws) do
    ids[i] = w.id
    of[w.id] = w
  end
  table.sort(ids)
  return ids, of
end

-- Round robin: live workers in id order, from a shared counter.
local function rr_pick(ws, excluded, full)
  local ids, of = by_id(ws)
  local start = redis.call('HINCRBY', K_FAIR, 'rr', 1)
  for k = 0, #ids - 1 do
    local w = of[ids[(start + k) % #ids + 1]]
    if eligible(w, excluded, full) then return w end
  end
  return nil
end

-- Least loaded (see the module docstring): the eligible workers within `spread` requests of
-- the lowest load (a request before its first token weighing 1 + route.prefill), taken in
-- turn: the one whose id follows the last one taken (K_FAIR's least:last), else the first by
-- id. One pass over the workers and one over the eligible ones, without sorting: sorting the
-- near workers' ids (an idle fleet's are all near) cost a tenth of ACQUIRE at 64 workers. Two
-- Redis calls (HGET, HSET) where the counter took one (HINCRBY); none for a single candidate.
local function least_pick(ws, excluded, full, route)
  local low, cands, shares, n = nil, {}, {}, 0
  local weight = route.prefill
  for _, w in ipairs(ws) do
    if eligible(w, excluded, full) then
      local share = (w.used + weight * w.prefill) / w.cap
      n = n + 1
      cands[n], shares[n] = w, share
      if low == nil or share < low then low = share end
    end
  end
  if n <= 1 then return cands[1] end  -- no turn to take (nor a last one to move)
  local last = redis.call('HGET', K_FAIR, 'least:last') or ''
  local spread, first, after, near = route.spread, nil, nil, 0
  for i = 1, n do
    local w = cands[i]
    -- Shares compared as computed (the lowest is always near): (29 / 50) * 50 < 29 in
    -- doubles, and with a spread of 0 a load compared against low * cap could leave none.
    if shares[i] <= low + spread / w.cap then
      local id = w.id
      near = near + 1
      if first == nil or id < first.id then first = w end
      if id > last and (after == nil or id < after.id) then after = w end
    end
  end
  if near == 1 then return first end
  local pick = after or first
  redis.call('HSET', K_FAIR, 'least:last', pick.id)
  return pick
end

-- The cheapest eligible worker for cache routing (see the module docstring), least loaded on ties.
local function best_pick(ws, excluded, full, route, matched)
  local cache = route.mode == 'cache'
  local n = #(route.blocks or {})
  local coolest, total_cap = nil, 0
  if cache then
    for _, w in ipairs(ws) do
      total_cap = total_cap + w.cap
      if eligible(w, excluded, full) and (coolest == nil or w.used / w.cap < coolest) then
        coolest = w.used / w.cap
      end
    end
  end
  local best, best_cost = nil, nil
  for _, w in ipairs(ws) do
    if eligible(w, excluded, full) then
      local cost = w.used / w.cap
      if cache then
        local m = matched[w.id] or 0
        if w.used / w.cap - coolest > route.hot then m = 0 end
        cost = (n - m) + route.prefill * w.prefill + route.load * w.used * total_cap / (#ws * w.cap)
        if route.home and w.id ~= route.home then cost = cost + route.away end
      end
      if best == nil or cost < best_cost or (cost == best_cost and w.used / w.cap < best.used / best.cap) then
        best, best_cost = w, cost
      end
    end
  end
  return best
end

-- `need` slots for one request (the same worker may give several), chosen by `route`
-- ({mode, blocks, load, prefill, hot}), or nil (and nothing taken) if they are not all there.
-- picks.matched: worker id -> leading blocks of the prompt the index says it holds;
-- picks.prefill[i]: the blocks pick i adds to its worker's pending prefill (cache routing:
-- the uncached blocks, once per worker -- its other generations reuse the first's prefill).
local function choose(ws, excluded, priority, need, route)
  local matched = {}
  local n = 0
  if route.mode == 'cache' then n = #(route.blocks or {}) end
  if n > 0 then matched = route.matched or prefix_matches(K_PREFIX, route.blocks) end
  local picks, prefill, seen = {}, {}, {}
  local full = may_fill(ws, excluded, priority, need)
  -- The cost variant needs cache routing's cost; under the other routings affinity is bounded.
  local bounded = route.affinity == 'bounded' or route.mode ~= 'cache'
  if route.session and not bounded then route.home = session_home(ws, route.session, excluded) end
  for _ = 1, need do
    local ex = excluded
    if route.adapter then
      ex = adapter_choice(ws, excluded, route.adapter, function(w) return eligible(w, excluded, full) end)
    end
    local function ok(w) return eligible(w, ex, full) end
    local best
    if route.session and bounded then best = session_pick(ws, ok, ex, route) end
    if best ~= nil then
    elseif route.mode == 'rr' then best = rr_pick(ws, ex, full)
    elseif route.mode == 'least' then best = least_pick(ws, ex, full, route)
    else best = best_pick(ws, ex, full, route, matched) end
    if best == nil then
      for i, p in ipairs(picks) do
        p.used = p.used - 1
        p.prefill = p.prefill - prefill[i]
      end
      return nil
    end
    local adds = 0
    -- Pending prefill: cache routing counts the uncached blocks, least the request (once
    -- per worker: its other generations reuse the first one's prefill).
    if not seen[best.id] then adds = route.mode == 'least' and 1 or n - (matched[best.id] or 0) end
    seen[best.id] = true
    best.used = best.used + 1
    best.prefill = best.prefill + adds
    picks[#picks + 1] = best
    prefill[#prefill + 1] = adds
  end
  picks.matched, picks.prefill = matched, prefill
  return picks
end

local function route_of(meta)
  return {mode = meta.mode or 'least', blocks = meta.blocks, load = tonumber(meta.load) or 0,
          prefill = tonumber(meta.prefill) or 0, hot = tonumber(meta.hot) or 1,
          session = meta.session, affinity = meta.affinity, bound = tonumber(meta.bound) or 1,
          away = tonumber(meta.away) or 0, adapter = meta.adapter, spread = tonumber(meta.spread) or 1}
end

-- Whether the live workers not excluded hold `need` slots in all: a waiting request that
-- needs more (workers left since it queued) could never be granted, and as the head of
-- its queue it would hold back every request behind it until its queue timeout.
local function serviceable(ws, excluded, need)
  local slots = 0
  for _, w in ipairs(ws) do
    if not excluded[w.id] then slots = slots + w.cap end
  end
  return slots > 0 and slots >= need
end

local function class_of(priority)
  if priority < 0 then return 'urgent' elseif priority == 0 then return 'default' end
  return 'low'
end

-- Urgent class: a request that leaves unserved (timed out, cancelled, its gateway died)
-- gives its enqueue-time charge back: a tenant is charged for work it got, not for work it
-- asked for and never received. F never falls below V.
local function refund(qi, meta)
  if not meta.tenant or not meta.cost then return end
  local fkey = 'F:' .. qi .. ':' .. meta.tenant
  local f = tonumber(redis.call('HGET', K_FAIR, fkey) or '0')
  local v = tonumber(redis.call('HGET', K_FAIR, 'V:' .. qi) or '0')
  redis.call('HSET', K_FAIR, fkey, math.max(v, f - tonumber(meta.cost)))
end

local function dequeue(queue, req, meta)
  redis.call('ZREM', queue, meta.member or req)
  redis.call('HDEL', K_META, req)
  if redis.call('HINCRBY', K_DEPTH, class_of(tonumber(meta.priority) or 0), -1) < 0 then
    redis.call('HSET', K_DEPTH, class_of(tonumber(meta.priority) or 0), 0)
  end
end

local function publish(meta, req, status, leases)
  redis.call('XADD', K_GRANTS, 'MAXLEN', '~', GRANTS_KEPT, '*', 'g', meta.gw or '', 'r', req,
             's', status, 'l', leases)
end

-- Lease `need` slots to req (lease ids req#0, req#1, ...): count, lease, describe
-- ([lease, worker, url, blocks the index expected cached there, blocks to prefill]).
-- With cache routing, the prompt's blocks are now held by each picked worker (it is about
-- to prefill them), and the blocks it has to prefill count in its pending prefill until
-- its first token (PREFILLED) or the end of its lease, whichever comes first.
-- A lease handed to the caller lives a full TTL; one published to a waiting gateway
-- must be claimed (renewed) within the gateway liveness TTL, so a grant sent to a
-- gateway that has just died idles its slot for seconds, not a whole lease TTL.
local function lease_all(picks, req, ttl, meta)
  local out = {}
  local marked = {}
  local blocks = meta.mode == 'cache' and meta.blocks or {}
  for i, w in ipairs(picks) do
    local lease = req .. '#' .. (i - 1)
    redis.call('HINCRBY', K_INFLIGHT, w.id, 1)
    redis.call('ZADD', K_LEASES, now + ttl, lease)
    redis.call('HSET', K_OWNER, lease, w.id)
    local adds = picks.prefill[i] or 0
    if adds > 0 then
      redis.call('HINCRBY', K_PREFILL, w.id, adds)
      redis.call('HSET', K_LEASE_PREFILL, lease, adds)
    end
    out[#out + 1] = {lease, w.id, url_of(w), picks.matched[w.id] or 0, adds}
    if #blocks > 0 and not marked[w.id] then
      marked[w.id] = true
      holders_add(K_PREFIX, K_PREFIX_LRU, blocks, w.id, now, picks.matched[w.id] or 0)
    end
  end
  return cjson.encode(out)
end

local function gateway_alive(gw)
  return gw == gateway or tonumber(redis.call('HGET', K_GATEWAYS, gw) or '0') >= now
end

-- Normal class, one lexicographic zset: members `tenant|PPPPSSSSSSSSSSSSSSSS|request`
-- (priority + 1000, arrival number), so each tenant's entries are in (priority, arrival)
-- order, and K_HEADS scores each waiting tenant by its head's start tag: max(V, F[tenant])
-- plus the priority offset. F advances only when a request is served, so requests that
-- time out cost their tenant nothing, and its next head is not pushed back.
local function head_of(t)
  local first = redis.call('ZRANGEBYLEX', K_QNORMAL, '[' .. t .. '|', '(' .. t .. '}', 'LIMIT', 0, 1)
  return first[1]
end

local function start_tag(t)
  local vf = redis.call('HMGET', K_FAIR, 'V:2', 'F:2:' .. t)
  return math.max(tonumber(vf[1] or '0'), tonumber(vf[2] or '0'))
end

-- The fair-queuing charge of a request granted in ACQUIRE itself, as the queue would have
-- charged it; retries and migrations (`boost`) are charged nothing.
local function charge_direct(boost, priority, tenant, cost)
  if boost then return end
  if is_urgent(priority) then
    local vf = redis.call('HMGET', K_FAIR, 'V:1', 'F:1:' .. tenant)
    local v = tonumber(vf[1] or '0')
    local tag = math.max(v, tonumber(vf[2] or '0'))
    redis.call('HSET', K_FAIR, 'F:1:' .. tenant, tag + cost)
    if tag > v then redis.call('HSET', K_FAIR, 'V:1', tag) end
  else
    local tag = start_tag(tenant)
    redis.call('HSET', K_FAIR, 'V:2', tag, 'F:2:' .. tenant, tag + cost)
  end
end

local function refresh_head(t)
  local member = head_of(t)
  if member == nil then
    redis.call('ZREM', K_HEADS, t)
    return
  end
  local priority = tonumber(string.sub(member, #t + 2, #t + 5)) - 1000
  local tag = start_tag(t)
  if step > 0 then redis.call('ZADD', K_HEADS, tag + priority * step, t)
  else redis.call('ZADD', K_HEADS, priority * 1e12 + tag, t) end
end

-- What a waiting entry gets now: 'drop' (its waiter gave up, or its gateway died),
-- 'none' (nothing live can ever serve it), its slots (a list of workers), or nil (wait),
-- and the workers closed to it. `held`: workers an entry passed over waits for (not taken).
local function verdict(ws, meta, held)
  local excluded = adapter_unfit(ws, exclusions(ws, meta.exclude, meta.task, meta.role), meta.adapter)
  if (tonumber(meta.deadline) or 0) < now or not gateway_alive(meta.gw or '') then return 'drop', excluded end
  if not serviceable(ws, excluded, tonumber(meta.need) or 1) then
    if partial then return nil, excluded end  -- another worker may serve it: REAP's full pump decides
    return 'none', excluded
  end
  local closed = excluded
  if held and next(held) ~= nil then
    closed = {}
    for id in pairs(excluded) do closed[id] = true end
    for id in pairs(held) do closed[id] = true end
  end
  return choose(ws, closed, tonumber(meta.priority) or 0, tonumber(meta.need) or 1, route_of(meta)), excluded
end

-- Carry out a verdict that is not nil or 'drop', for an entry already dequeued. The
-- calling request's own grant is returned (not published); otherwise `result` stays.
local function deliver(v, req, meta, direct, result)
  if v == 'none' then
    if req == direct then return 'none' end
    publish(meta, req, 'none', '[]')
    return result
  end
  local leases = lease_all(v, req, req == direct and lease_ttl or gw_ttl, meta)
  if req == direct then return leases end
  publish(meta, req, 'ok', leases)
  return result
end

-- Hand free slots to waiting requests: the urgent queue first (in score order; an entry
-- blocked only by its excluded workers is skipped), then the normal class, tenant by
-- tenant in start-tag order. Either stops at the first entry that lacks slots, so later
-- ones cannot take them. `direct` names the calling request, whose grant is returned
-- (`direct_blocks`: its prompt blocks, which its stored meta leaves out).
local function pump(ws, direct, direct_blocks)
  local result = nil
  local function free_of(workers)
    local n = 0
    for _, w in ipairs(workers) do n = n + math.max(0, w.cap - w.used) end
    return n
  end
  local free = free_of(ws)
  -- A sample (`partial`) judges a plain entry it can serve. An entry it cannot serve, or one
  -- that is not plain (several slots, exclusions, a session, an adapter, a role, a task), is
  -- judged on the whole fleet, read once, from then on: the queue stops or goes on as it would
  -- have, the entry keeps its session's home and its adapter's holders, and the slots it
  -- could use elsewhere are not left idle.
  local function judged(meta, held)
    local plain = (tonumber(meta.need) or 1) == 1 and #(meta.exclude or {}) == 0 and not meta.session
                  and not meta.adapter and not meta.role and not meta.task
    if partial and plain then
      local v, excluded = verdict(ws, meta, held)
      if v ~= nil or restricted(ws, excluded) then return v, excluded end
    end
    if partial then
      ws, partial = live_workers(), false
      free = free_of(ws)
    end
    return verdict(ws, meta, held)
  end
  for _, req in ipairs(redis.call('ZRANGE', K_QURGENT, 0, 63)) do
    if free <= 0 then return result end
    local meta = cjson.decode(redis.call('HGET', K_META, req) or '{}')
    if req == direct then meta.blocks = direct_blocks end
    local v, excluded = judged(meta)
    if v == nil then
      if not restricted(ws, excluded) then return result end
    else
      dequeue(K_QURGENT, req, meta)
      if v == 'drop' or v == 'none' then
        refund(1, meta)
      else
        free = free - #v
        if (tonumber(meta.tag) or 0) > tonumber(redis.call('HGET', K_FAIR, 'V:1') or '0') then
          redis.call('HSET', K_FAIR, 'V:1', meta.tag)
        end
      end
      if v ~= 'drop' then result = deliver(v, req, meta, direct, result) end
    end
  end
  -- A tenant's head that waits for workers closed to others (another task's, say) is
  -- passed over, and the workers it may use are held for it: the requests behind it take
  -- only slots it could never have used, so neither task's traffic blocks the other's.
  local passed, npassed, held = {}, 0, {}
  for _ = 1, 256 do
    if free <= 0 then return result end
    local t = nil
    for _, candidate in ipairs(redis.call('ZRANGE', K_HEADS, 0, npassed)) do
      if not passed[candidate] then t = candidate break end
    end
    if t == nil then return result end
    local member = head_of(t)
    local v, excluded, meta, req = nil, nil, nil, nil
    if member ~= nil then
      req = string.match(member, '[^|]*$')
      meta = cjson.decode(redis.call('HGET', K_META, req) or '{}')
      meta.member = member
      if req == direct then meta.blocks = direct_blocks end
      v, excluded = judged(meta, held)
      if v == nil then
        if not restricted(ws, excluded) then return result end
        for _, w in ipairs(ws) do
          if not excluded[w.id] then held[w.id] = true end
        end
        passed[t] = true
        npassed = npassed + 1
      end
    end
    if member ~= nil and v ~= nil then
      dequeue(K_QNORMAL, req, meta)
      if v ~= 'drop' and v ~= 'none' then
        free = free - #v
        local tag = start_tag(t)
        redis.call('HSET', K_FAIR, 'V:2', tag, 'F:2:' .. t, tag + (tonumber(meta.cost) or 1))
      end
      if v ~= 'drop' then result = deliver(v, req, meta, direct, result) end
    end
    if not passed[t] then refresh_head(t) end
  end
  return result
end

-- A lease's prompt is prefilled (or its lease is over): its blocks leave its worker's
-- pending prefill.
local function prefill_done(lease, w)
  local adds = tonumber(redis.call('HGET', K_LEASE_PREFILL, lease) or '0')
  if adds > 0 then
    redis.call('HDEL', K_LEASE_PREFILL, lease)
    if w and redis.call('HINCRBY', K_PREFILL, w, -adds) <= 0 then redis.call('HDEL', K_PREFILL, w) end
  end
end

-- Give a lease's slot (and what is left of its pending prefill) back.
-- Returns 1 and its worker if the lease existed, else 0.
local function free_lease(lease)
  redis.call('ZREM', K_LEASES, lease)
  local w = redis.call('HGET', K_OWNER, lease)
  prefill_done(lease, w)
  if not w then return 0 end
  redis.call('HDEL', K_OWNER, lease)
  -- never below 0 (a count the reaper's recount set lower meanwhile)
  if redis.call('HINCRBY', K_INFLIGHT, w, -1) < 0 then redis.call('HSET', K_INFLIGHT, w, 0) end
  return 1, w
end

local function queue_length()
  return redis.call('ZCARD', K_QURGENT) + redis.call('ZCARD', K_QNORMAL)
end

-- Whether a request waits in either queue (a tenant left in the heads counts: the pump
-- tidies it away).
local function waiting()
  return redis.call('EXISTS', K_QURGENT, K_QNORMAL, K_HEADS) > 0  -- an empty zset is no key
end
"""

#: Each script gets the prelude's functions it calls, where it first needs them
#: (gateway/admission/lua_prelude.py: every script defining all of them was ~20 µs a call).
PRELUDE = Prelude(_PRELUDE)

#: ARGV 7 request id, 8 priority, 9 slots needed, 10 queue timeout (ms), 11 max queue length,
#: 12 excluded worker ids (JSON list), 13 boosted (1: a retry or migration), 14 tenant, 15 cost,
#: 16 prompt block hashes (JSON list), 17 routing (least | rr | cache), 18 load (blocks per
#: request in flight), 19 hot-spot guard (share of slots), 20 weight of a pending prefill block
#: (cache) or of a request not yet past its first token (least), 21 the task (generate, embed,
#: score, tokenize), 22 session key ('': none; :mod:`gateway.admission.affinity`), 23 affinity
#: (bounded | cost), 24 its load bound (x the mean share), 25 its cost for a worker other than
#: the session's home, 26 LoRA adapter ('': the base model; :mod:`gateway.admission.adapters`),
#: 27 the role of the workers a disaggregated hop needs ('': any worker; :mod:`sluice.roles`),
#: 28 least's spread (requests above the lowest load still taken in turn), 29 the sample a large
#: fleet's plain request is chosen from (0: the whole fleet always).
#: Returns {'granted', leases JSON [[lease, worker, url, matched blocks, prefill blocks], ...]}
#: | {'queued', position, the grant stream's last id (its grant can only come after it)}
#: | {'full', length} | {'none'} | {'too_big', slots of the live workers it may use}
#: | {'short', the same, the most slots the live generating workers held lately (REAP's; the
#: missing could hold the request)}
#: | {'untasked'} (live workers, none of which serves the task).
ACQUIRE = PRELUDE.script(r"""
local req, priority, need = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local boost, tenant, cost = ARGV[13] == '1', ARGV[14], tonumber(ARGV[15])
local exclude = cjson.decode(ARGV[12])
local task = ARGV[21] or 'generate'
-- A retry or a migration (its client is mid-request) writes first, as every script once did:
-- a Redis that refuses writes is then named as such ("the state store is full"), where the
-- worker it lost would otherwise be all it could report (tests/gateway/test_redis_full.py).
if boost then mark_alive() end
if is_urgent(priority) and redis.call('EXISTS', K_WORKERS) == 1 then
  redis.call('SET', K_URGENT_SEEN, '1', 'PX', 60000)
  urgent_recently = true
end
local adapter = ARGV[26] ~= '' and ARGV[26] or nil
local role = ARGV[27] ~= '' and ARGV[27] or nil
local meta = {deadline = now + tonumber(ARGV[10]), exclude = exclude, priority = priority, need = need,
              gw = gateway, mode = ARGV[17], load = tonumber(ARGV[18]), hot = tonumber(ARGV[19]),
              prefill = tonumber(ARGV[20])}
if task ~= 'generate' then meta.task = task end
if ARGV[17] == 'least' then meta.spread = tonumber(ARGV[28]) end
meta.adapter, meta.role = adapter, role
if ARGV[22] ~= '' then
  meta.session, meta.affinity, meta.bound, meta.away = ARGV[22], ARGV[23], tonumber(ARGV[24]), tonumber(ARGV[25])
end
-- The caller's blocks stay out of its stored meta unless it has to wait (no JSON round trip
-- for a request granted at once).
local direct_blocks = ARGV[17] == 'cache' and cjson.decode(ARGV[16]) or nil

-- A large fleet (more than 4 x ARGV[29] registered workers), one slot of plain generation by
-- least load or by cache (see "Large fleets" above): with nobody waiting, chosen among a
-- sample and granted and charged as below (a sample with no room leaves the choice to the
-- whole fleet); with requests waiting, it joins them, and the pump looks at the sample alone.
local d = tonumber(ARGV[29]) or 0
local ws = nil
if d > 0 and need == 1 and #exclude == 0 and task == 'generate' and not adapter and not role
    and not meta.session and ARGV[17] ~= 'rr' and redis.call('HLEN', K_ALIVE) > 4 * d then
  local waits = redis.call('EXISTS', K_QURGENT, K_QNORMAL) > 0
  local route = route_of(meta)
  route.blocks = direct_blocks
  route.matched = direct_blocks and prefix_matches(K_PREFIX, direct_blocks) or {}
  local sample = sampled_workers(d, route.matched)
  if sample and #sample > 0 then
    if waits then
      ws, partial = sample, true
    else
      local picks = choose(sample, {}, priority, 1, route)
      if picks then
        meta.blocks = direct_blocks
        charge_direct(boost, priority, tenant, cost)
        return {'granted', lease_all(picks, req, lease_ttl, meta)}
      end
    end
  end
end

if partial then
  local length = queue_length()
  if not boost and length >= tonumber(ARGV[11]) then return {'full', length} end
else
  ws = live_workers()
  if #ws == 0 then return {'none'} end
  local excluded = adapter_unfit(ws, exclusions(ws, exclude, task, role), adapter)
  local serving = false
  for _, w in ipairs(ws) do serving = serving or w.serves[task] == true end
  if not serving then return {'untasked'} end
  -- Capacity alone decides whether `need` is valid: never the urgent reserve, which other
  -- traffic switches on and off (the same n flipped between 400 and 200).
  local room = 0
  for _, w in ipairs(ws) do
    if not excluded[w.id] then room = room + w.cap end
  end
  if room == 0 then return {'none'} end
  if room < need then
    -- Too big for the fleet, or for the part of it that is live this moment (a worker
    -- stopped, restarting, or not beaten since Redis came back): the second is a 503 to retry,
    -- when the slots missing could make up the shortfall. A generation on any worker only:
    -- an adapter's or a role's workers are not what REAP notes.
    if task == 'generate' and not adapter and not role then
      local lately = tonumber(redis.call('HGET', K_FAIR, 'cap') or '0') or 0
      if need <= lately and need - room <= lately - generating_room(ws) then return {'short', room, lately} end
    end
    return {'too_big', room}
  end
  local length = 0
  if redis.call('EXISTS', K_QURGENT, K_QNORMAL) > 0 then length = queue_length() end  -- one call while none waits
  -- Retries and migrations are never refused for length: they hold a client mid-request.
  if not boost and length >= tonumber(ARGV[11]) then return {'full', length} end

  -- Nobody waits: the queue's pump would take this request first and alone. Grant it here,
  -- with the same fair-queuing charge as a grant from the queue, and skip the queue's
  -- writes and reads (about half of this script's work for a request granted at once).
  if length == 0 then
    meta.blocks = direct_blocks
    local picks = choose(ws, excluded, priority, need, route_of(meta))
    if picks ~= nil then
      charge_direct(boost, priority, tenant, cost)
      return {'granted', lease_all(picks, req, lease_ttl, meta)}
    end
    meta.blocks = nil
  end
end
""", r"""
mark_alive()  -- it waits: the pump drops the entries of a gateway that stopped beating
if boost then
  redis.call('ZADD', K_QURGENT, -4e15 + now, req)
elseif is_urgent(priority) then
  -- Urgent class: start-time fair queuing with the tag fixed at arrival (refunded if unserved).
  local tag = math.max(tonumber(redis.call('HGET', K_FAIR, 'V:1') or '0'),
                       tonumber(redis.call('HGET', K_FAIR, 'F:1:' .. tenant) or '0'))
  redis.call('HSET', K_FAIR, 'F:1:' .. tenant, tag + cost)
  local score = tag + priority * step
  if step == 0 then score = priority * 1e12 + tag end
  redis.call('ZADD', K_QURGENT, score, req)
  meta.tag, meta.tenant, meta.cost = tag, tenant, cost
else
  local seq = redis.call('HINCRBY', K_FAIR, 'seq', 1)
  meta.member = tenant .. '|' .. string.format('%04d%016d', priority + 1000, seq) .. '|' .. req
  meta.tenant, meta.cost = tenant, cost
  redis.call('ZADD', K_QNORMAL, 0, meta.member)
end
redis.call('HSET', K_META, req, cjson.encode(meta))
redis.call('HINCRBY', K_DEPTH, class_of(priority), 1)
if meta.member then refresh_head(tenant) end
local got = pump(ws, req, direct_blocks)
if got == 'none' then return {'none'} end
if got ~= nil then return {'granted', got} end
if redis.call('HEXISTS', K_META, req) == 0 then return {'none'} end  -- dropped (cannot happen to a live caller)
if direct_blocks then
  meta.blocks = direct_blocks
  redis.call('HSET', K_META, req, cjson.encode(meta))
end
local newest = redis.call('XREVRANGE', K_GRANTS, '+', '-', 'COUNT', 1)
return {'queued', queue_length() - 1, newest[1] and newest[1][1] or '0-0'}
""")

#: ARGV 7 lease id, 8 the sample a large fleet's freed slot is handed on through (0: the whole
#: fleet); optionally 9 tenant, 10 the class its grant charged (1 urgent, 2 normal), 11 tokens
#: its generation really used minus what its grant charged. Corrects the charge, frees the
#: slot and hands it on to the queue. Returns 1 if the lease existed.
RELEASE = PRELUDE.script(r"""
local freed, freed_on = free_lease(ARGV[7])
-- The last 256 completions are what RETRY_AFTER reads; trimmed in steps of 32, not each time.
if freed == 1 and redis.call('LPUSH', K_DONE, now) > 288 then redis.call('LTRIM', K_DONE, 0, 255) end
-- Grants charge an estimate (gateway/admission/caps.py: queue_cost); the real usage replaces it
-- before the slot is handed on, so the next grant already sees the tenant's real service.
-- F never falls below V: a tenant banks no credit for its overestimates.
-- With nobody waiting there is no head to re-score and no slot to hand on: the queue's keys
-- and the workers need not be read (nor the queue's functions defined, below).
local busy = waiting()
if ARGV[9] then
  local fkey = 'F:' .. ARGV[10] .. ':' .. ARGV[9]
  local vf = redis.call('HMGET', K_FAIR, 'V:' .. ARGV[10], fkey)
  local v, f = tonumber(vf[1] or '0'), tonumber(vf[2] or '0')
  redis.call('HSET', K_FAIR, fkey, math.max(v, f + tonumber(ARGV[11])))
end
if not busy then return freed end
""", r"""
if ARGV[9] and ARGV[10] == '2' then refresh_head(ARGV[9]) end
mark_alive()  -- as before every script did: a beat that runs late keeps a margin under load
-- A large fleet's freed slot goes to the queue through a sample with its worker in it (see
-- "Large fleets"); REAP's pump, once a second, still sees the whole fleet.
local d = tonumber(ARGV[8]) or 0
local ws = nil
if freed_on and d > 0 and redis.call('HLEN', K_ALIVE) > 4 * d then
  ws = sampled_workers(d, {[freed_on] = true})
  for _, w in ipairs(ws or {}) do partial = partial or w.id == freed_on end  -- (not an embedding worker's)
end
pump(partial and ws or live_workers(), nil)
return freed
""")

#: ARGV 7 request id, 8 slots it needed. A waiter leaves the queue:
#: {'removed'} | {'granted', leases JSON as ACQUIRE's, the prefix match unknown (0) but the
#: pending prefill kept, so the first token still takes it off} (a grant raced in: serve or
#: release it) | {'gone'}.
CANCEL = PRELUDE.script(r"""
mark_alive()
local req, need = ARGV[7], tonumber(ARGV[8])
local raw = redis.call('HGET', K_META, req)
if raw then
  local meta = cjson.decode(raw)
  if meta.member then
    dequeue(K_QNORMAL, req, meta)
    refresh_head(meta.tenant)
  else
    dequeue(K_QURGENT, req, meta)
    refund(1, meta)
  end
  return {'removed'}
end
local out = {}
for i = 0, need - 1 do
  local lease = req .. '#' .. i
  local w = redis.call('HGET', K_OWNER, lease)
  if w then
    local rec = redis.call('HGET', K_WORKERS, w)
    out[#out + 1] = {lease, w, rec and cjson.decode(rec).url or '', 0,
                     tonumber(redis.call('HGET', K_LEASE_PREFILL, lease) or '0')}
  end
end
if #out == 0 then return {'gone'} end
return {'granted', cjson.encode(out)}
""")

#: ARGV 7 1 to recount ``inflight`` and the pending prefill from the leases, 8 how long (ms)
#: the most slots the live workers held is kept once fewer are live. Reclaims leases whose
#: holder stopped renewing them (a dead gateway), forgets long-dead gateways, notes the live
#: workers' slots, then pumps. Returns {leases reclaimed, counter corrections}.
REAP = PRELUDE.script(r"""
local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, 256)
for _, lease in ipairs(expired) do free_lease(lease) end
local gws = redis.call('HGETALL', K_GATEWAYS)
for i = 1, #gws, 2 do
  if tonumber(gws[i + 1]) < now - 60000 then redis.call('HDEL', K_GATEWAYS, gws[i]) end
end

-- Set the per-worker counter hash `key` to `counts`; returns how many entries were wrong.
local function recount(key, counts)
  local wrong = 0
  local recorded = redis.call('HGETALL', key)
  for i = 1, #recorded, 2 do
    local id, n = recorded[i], tonumber(recorded[i + 1])
    if (counts[id] or 0) ~= n then wrong = wrong + 1 end
    if counts[id] then redis.call('HSET', key, id, counts[id]) else redis.call('HDEL', key, id) end
    counts[id] = nil
  end
  for id, n in pairs(counts) do
    redis.call('HSET', key, id, n)
    wrong = wrong + 1
  end
  return wrong
end

local corrections = 0
if ARGV[7] == '1' then
  local slots, owner_of = {}, {}
  local owners = redis.call('HGETALL', K_OWNER)
  for i = 1, #owners, 2 do
    owner_of[owners[i]] = owners[i + 1]
    slots[owners[i + 1]] = (slots[owners[i + 1]] or 0) + 1
  end
  local prefill = {}
  local adds = redis.call('HGETALL', K_LEASE_PREFILL)
  for i = 1, #adds, 2 do
    local w = owner_of[adds[i]]
    if w then
      prefill[w] = (prefill[w] or 0) + tonumber(adds[i + 1])
    else
      redis.call('HDEL', K_LEASE_PREFILL, adds[i])  -- its lease is gone
      corrections = corrections + 1
    end
  end
  corrections = corrections + recount(K_INFLIGHT, slots) + recount(K_PREFILL, prefill)
end
-- The registry. Entries without a heartbeat go (live_workers drops those whose heartbeat
-- lapsed, and reads no others): a worker a gateway found unreachable (its heartbeat deleted),
-- or facts a gateway of an earlier version left when it dropped their worker. Each worker's
-- routing facts are made again from its record where they differ: a worker of an earlier
-- version writes none, and a worker id run again by one would keep stale facts.
local alive, facts = fields(K_ALIVE), fields(K_ROUTING)
local records = redis.call('HGETALL', K_WORKERS)
for i = 1, #records, 2 do
  local id = records[i]
  if not alive[id] then
    redis.call('HDEL', K_WORKERS, id)
    redis.call('HDEL', K_ROUTING, id)
  else
    local f = routing_facts(records[i + 1])
    if facts[id] ~= f then redis.call('HSET', K_ROUTING, id, f) end
  end
  facts[id] = nil
end
for id in pairs(facts) do
  if not alive[id] then redis.call('HDEL', K_ROUTING, id) end
end
local ws = live_workers()
-- The most slots the live generating workers held lately (ACQUIRE's 'short'): the current
-- room where it is more, or as much and noted over a minute ago, or where the note is older
-- than ARGV[8] ms (a fleet scaled down for good). A write a minute in a steady fleet, none for
-- a model nobody serves (whose keys are being forgotten); and a pcall: a Redis at its
-- maxmemory refuses it, and what REAP frees and pumps must not wait for it.
local room, noted = generating_room(ws), redis.call('HMGET', K_FAIR, 'cap', 'cap:at')
local lately, at = tonumber(noted[1] or '0') or 0, tonumber(noted[2] or '0') or 0
if room > 0 and (room > lately or (room == lately and at < now - 60000)
                 or (room < lately and at < now - tonumber(ARGV[8]))) then
  redis.pcall('HSET', K_FAIR, 'cap', room, 'cap:at', now)
end
pump(ws, nil)
return {#expired, corrections}
""")

#: ARGV 7.. lease ids held by the calling gateway: push their expiry to now + TTL.
#: Also keeps the calling gateway alive (mark_alive), so its queued requests stay.
#: Returns the lease ids that no longer exist (reaped: their slot is gone).
RENEW = PRELUDE.script(r"""
mark_alive()
local lost = {}
for i = 7, #ARGV do
  if redis.call('ZADD', K_LEASES, 'XX', 'CH', now + lease_ttl, ARGV[i]) == 0
     and not redis.call('ZSCORE', K_LEASES, ARGV[i]) then
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
""")

#: ARGV 7.. pairs of lease id and worker id: leases of running streams that Redis lost with
#: its data. Each one missing is leased again on its worker (the stream holds that slot).
#: Returns how many were missing.
RECLAIM = PRELUDE.script(r"""
local missing = 0
for i = 7, #ARGV - 1, 2 do
  if not redis.call('ZSCORE', K_LEASES, ARGV[i]) then
    redis.call('ZADD', K_LEASES, now + lease_ttl, ARGV[i])
    redis.call('HSET', K_OWNER, ARGV[i], ARGV[i + 1])
    redis.call('HINCRBY', K_INFLIGHT, ARGV[i + 1], 1)
    missing = missing + 1
  end
end
return missing
""")

#: ARGV 7.. lease ids whose first token arrived: their prompts are prefilled, so their
#: uncached blocks leave their workers' pending prefill. Returns how many leases.
PREFILLED = PRELUDE.script(r"""
for i = 7, #ARGV do prefill_done(ARGV[i], redis.call('HGET', K_OWNER, ARGV[i])) end
return #ARGV - 6
""")

#: ARGV 7 queue position. Returns seconds until that many requests have drained at the
#: recent completion rate (the last 30 s), or -1 when too few completions to tell.
RETRY_AFTER = PRELUDE.script(r"""
local stamps = redis.call('LRANGE', K_DONE, 0, 255)
local count, oldest = 0, now
for _, t in ipairs(stamps) do
  t = tonumber(t)
  if now - t <= 30000 then
    count = count + 1
    if t < oldest then oldest = t end
  end
end
if count < 2 then return -1 end
local rate = count / math.max((now - oldest) / 1000, 1)
return math.ceil((tonumber(ARGV[7]) + 1) / rate)
""")

#: KEYS workers, alive. Returns the number of workers with a live heartbeat.
LIVE = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local live = 0
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if tonumber(redis.call('HGET', KEYS[2], id) or '0') >= now then live = live + 1 end
end
return live
"""
