"""The seam every engine implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine_worker.protocol import Delta, GenerateRequest, KVEvent


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    #: Prompts taken as the gateway's token ids, not tokenized here (engines/prompts.py).
    gateway_prompts: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
        }


class Engine(Protocol):
    """One inference engine with continuous batching.

    ``generate`` yields :class:`Delta` s; closing the iterator early aborts the
    request in the engine and frees its slot.
    """

    name: str
    #: Sequences the engine runs at once; the worker advertises it as its capacity.
    capacity: int
    #: False while the engine cannot serve (an upstream server failing its health check):
    #: the worker stops heartbeating, so gateways stop routing to it until it recovers.
    healthy: bool

    async def start(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]: ...

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        """The prompt's size in tokens, counted as ``generate`` counts it (its usage's
        ``prompt_tokens``), without generating: Anthropic's ``count_tokens``."""
        ...

    def stats(self) -> EngineStats: ...

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix cache changes since the last call, named by :mod:`sluice.prefix` block
        hashes (reported to the gateways' prefix index); [] for engines whose blocks are
        named otherwise."""
        ...

    async def shutdown(self) -> None: ...
