"""The LoRA adapters one worker holds: loaded at start (``--lora name=path``) or on demand.

A request whose ``model`` is not the worker's base model names an adapter. One the worker
holds runs at once; one it does not is loaded first, from the path in the adapter directory
(:data:`sluice.keys.ADAPTERS`, written by the workers that hold it), if the worker is under
its cap (``--max-loras``): the gateways send an adapter to a worker without it only when
every holder is busy (gateway/admission/adapters.py). Each load is told to the gateways at
once (a beat), so the next request finds this worker among the holders.

>>> adapters = Adapters(engine, "base", {"sql": "/adapters/sql"}, max_loaded=4)
>>> await adapters.start(); await adapters.ensure("sql")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from sluice import keys
from sluice.errors import ModelNotFound, Unavailable

log = logging.getLogger("sluice.worker")


class AdapterEngine(Protocol):
    """What an engine that serves LoRA adapters adds to :class:`~engine_worker.engines.base.Engine`."""

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...


# KEYS adapters. ARGV 1 parent model, 2 TTL (ms), 3.. name, path pairs. Renews this worker's
# entries and drops those nobody renewed (their holders are gone). Returns the entries kept.
_PUBLISH = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for i = 3, #ARGV - 1, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], cjson.encode({parent = ARGV[1], path = ARGV[i + 1],
                                                    ['until'] = now + tonumber(ARGV[2])}))
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if (tonumber(cjson.decode(all[i + 1])['until']) or 0) < now then redis.call('HDEL', KEYS[1], all[i]) end
end
return redis.call('HLEN', KEYS[1])
"""


def parse_loras(specs: list[str]) -> dict[str, str]:
    """``name=path`` flags as {name: path}; a malformed one is a ValueError naming it."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or keys.model_name_problem(name) is not None:
            raise ValueError(f"--lora {spec!r}: expected name=path with a valid model name")
        out[name] = path
    return out


class Adapters:
    def __init__(self, engine: AdapterEngine, model: str, configured: dict[str, str], max_loaded: int) -> None:
        self._engine = engine
        self.model = model
        self._configured = configured
        self.max_loaded = max(max_loaded, len(configured))
        self.held: dict[str, str] = {}
        self._lock = asyncio.Lock()
        #: Set by the worker once registered: tells the gateways now.
        self.changed: Callable[[], Awaitable[None]] | None = None

    @property
    def enabled(self) -> bool:
        return self.max_loaded > 0

    async def start(self) -> None:
        for name, path in self._configured.items():
            await self._engine.load_adapter(name, path)
            self.held[name] = path
            log.info("LoRA adapter %r loaded from %s", name, path)

    def record(self) -> dict[str, object]:
        """The fields of this worker's registry record that routing reads."""
        return {"loras": list(self.held), "lora_max": self.max_loaded} if self.enabled else {}

    async def publish(self, redis: Any, ttl_ms: int = keys.ADAPTER_TTL_MS) -> None:
        if self.held:
            args: list[object] = [self.model, ttl_ms]
            for name, path in self.held.items():
                args += [name, path]
            await redis.eval(_PUBLISH, 1, keys.ADAPTERS, *args)

    async def ensure(self, name: str, redis: Any) -> None:
        """Hold adapter ``name`` (loading it if need be), or raise: 404 if no worker of this
        model has such an adapter, 503 (the gateway retries elsewhere) when at the cap."""
        if name in self.held:
            return
        if not self.enabled:
            raise ModelNotFound(f"this worker serves {self.model!r} and no adapters")
        async with self._lock:
            if name in self.held:
                return
            raw = await redis.hget(keys.ADAPTERS, name)
            entry = orjson.loads(raw) if raw else None
            if entry is None or entry.get("parent") != self.model:
                raise ModelNotFound(f"no adapter {name!r} of {self.model!r} is registered")
            if len(self.held) >= self.max_loaded:
                raise Unavailable(f"this worker holds {self.max_loaded} adapters already", retry_after_s=1)
            await self._engine.load_adapter(name, entry["path"])
            self.held[name] = entry["path"]
            log.info("LoRA adapter %r loaded on demand from %s", name, entry["path"])
        if self.changed is not None:
            await self.changed()

    async def unload(self, name: str) -> bool:
        async with self._lock:
            if self.held.pop(name, None) is None:
                return False
            await self._engine.unload_adapter(name)
            log.info("LoRA adapter %r unloaded", name)
        if self.changed is not None:
            await self.changed()
        return True
