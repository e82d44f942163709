"""LoRA adapters: which base model serves a name, and which workers may serve an adapter.

Workers that serve adapters (``sluice worker --lora name=path``) list them in their registry
record (``loras``, and ``lora_max``: how many they may hold) and in the adapter directory
(:data:`sluice.keys.ADAPTERS`: name -> parent model, path, expiry), renewed by every beat.
A request naming an adapter is admitted on its parent model's queue and slots (one fleet,
one queue), with the adapter as a routing constraint (:data:`FUNCTIONS`):

- workers that neither hold it nor have room under their cap never get it;
- its holders get it whenever one of them has a slot it may use;
- when every holder is busy, a worker with room gets it and loads the adapter (from the
  directory's path) before it generates: the adapter spreads under load, within each
  worker's cap.

Everything else (the name in responses and metrics, the key's limits, priorities, the
per-name limits of :mod:`gateway.admission.name_limits`) sees the adapter's own name.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from sluice import keys
from sluice.single_flight import SingleFlight

#: Lua, loaded with the admission scripts (see the module docstring).
FUNCTIONS = r"""
local function holds_adapter(w, name)
  for _, a in ipairs(w.loras) do if a == name then return true end end
  return false
end

-- `excluded` plus the workers that can never serve adapter `name` (a new table).
local function adapter_unfit(ws, excluded, name)
  if not name then return excluded end
  local out = {}
  for id in pairs(excluded) do out[id] = true end
  for _, w in ipairs(ws) do
    if not holds_adapter(w, name) and #w.loras >= w.lora_max then out[w.id] = true end
  end
  return out
end

-- For one pick: leave the holders of `name` when one of them may take it now (`ok`),
-- else the workers that would load it.
local function adapter_choice(ws, excluded, name, ok)
  local free = false
  for _, w in ipairs(ws) do
    if holds_adapter(w, name) and ok(w) then free = true end
  end
  local out = {}
  for id in pairs(excluded) do out[id] = true end
  for _, w in ipairs(ws) do
    if holds_adapter(w, name) ~= free then out[w.id] = true end
  end
  return out
end
"""


class AdapterDirectory:
    """Adapter name -> parent model, from :data:`sluice.keys.ADAPTERS`, cached for a second.

    Asked for every request's model: a name that is no adapter (every base model) is
    remembered as such too, so the common case costs no Redis call; the cache is cleared
    when it reaches :data:`CACHED` names, which bounds it whatever names clients send.
    """

    CACHED = 4096

    def __init__(self, redis: Any, ttl_s: float = 1.0) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, str | None]] = {}
        self._flights = SingleFlight[str, str | None]()

    async def parent(self, name: str) -> str | None:
        """The base model of adapter ``name``, or None if no live worker serves such an adapter."""
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and hit[0] > now:
            return hit[1]
        return await self._flights.run(name, lambda: self._read(name, now))  # one read for all who ask

    async def _read(self, name: str, now: float) -> str | None:
        raw = await self._redis.hget(keys.ADAPTERS, name)
        entry = _live(raw)
        if len(self._cache) >= self.CACHED:
            self._cache.clear()
        parent = entry["parent"] if entry else None
        self._cache[name] = (now + self._ttl_s, parent)
        return parent

    async def listed(self) -> list[dict[str, Any]]:
        """Every live adapter: {name, parent, path}, by name."""
        out = []
        for name, raw in (await self._redis.hgetall(keys.ADAPTERS)).items():
            entry = _live(raw)
            if entry is not None:
                out.append({"name": name.decode() if isinstance(name, bytes) else name, **entry})
        return sorted(out, key=lambda e: e["name"])


def _live(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    entry: dict[str, Any] = orjson.loads(raw)
    return entry if entry.get("until", 0) > time.time() * 1000 else None
