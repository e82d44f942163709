"""Concurrent asks for the same thing share one fetch of it.

A cache with a TTL in front of Redis (the fleet's roles, adapters, whether API keys exist)
expires for every request at once: each request that found the entry stale read Redis for
itself until the first answer came back. At 64 streams that was a herd of dozens of redis-py
calls per expiry, each checking a connection out of the pool (opening new ones when none
was idle): about a sixth of a short request's CPU in all (loadtest/peers/README.md). Here
the first ask starts the fetch and the others await the same one.

>>> flights = SingleFlight[str, bool]()
>>> split = await flights.run(model, lambda: read_roles(model))
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """Fetches in flight by key; a key is held only while its fetch runs (bounded by the
    asks in flight, whatever keys clients name)."""

    def __init__(self) -> None:
        self._flights: dict[K, asyncio.Future[V]] = {}

    async def run(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        """``fetch()``'s result, shared with every ask for ``key`` made while it runs (its
        error too). An ask cancelled meanwhile leaves the fetch to the others."""
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = asyncio.ensure_future(fetch())
            flight.add_done_callback(lambda done: self._landed(key, done))
        return await asyncio.shield(flight)

    def _landed(self, key: K, flight: asyncio.Future[V]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
