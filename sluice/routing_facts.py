"""A worker's routing facts: what admission reads of each worker at every request.

Admission (gateway/admission/scripts.py) ranks every live worker of a model at each
request. It used to read every worker's JSON registry record and decode each one: at 256
workers, decoding alone was about a third of a request's time in Redis
(loadtest/admission_cost.py). Most workers serve generation alone, in both roles, without
LoRA adapters; for those, the capacity and the URL are all routing needs. So each worker
has facts beside its record (:func:`sluice.keys.routing`):

- ``"<capacity> <url>"`` for such a worker (a whole capacity of at least 1), read with one
  pattern match;
- its record itself (JSON) for any other, decoded as before.

Facts are derived from the record by :data:`FUNCTIONS`, in Lua, in one place: the worker's
beat writes both (engine_worker/registration.py), and the reap (once a second, by one
gateway) writes them again where they differ from the record, so a worker of an earlier
version, which writes only its record, gets facts within a reap, and stale facts never last
longer than that.
"""

from __future__ import annotations

#: Lua: ``routing_facts(record)``, the facts of a worker from its registry record (JSON).
FUNCTIONS = r"""
local function routing_facts(record)
  local ok, w = pcall(cjson.decode, record)
  if not ok or type(w) ~= 'table' then return record end  -- no record of ours: as it is
  local cap, tasks = w.capacity, w.tasks
  if type(cap) == 'number' and cap >= 1 and cap < 2^31 and cap == math.floor(cap) and type(w.url) == 'string'
     and type(tasks) == 'table' and #tasks == 1 and tasks[1] == 'generate'
     and (w.role == nil or w.role == 'both') and w.loras == nil and w.lora_max == nil then
    return string.format('%d %s', cap, w.url)
  end
  return record
end
"""
