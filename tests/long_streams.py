"""Long streams held open to load workers, and the slots they hold, for routing tests."""

from __future__ import annotations

from typing import Any

import httpx
import redis

from sluice import keys


def busy_slots(client: redis.Redis, model: str) -> dict[str, int]:
    """Worker id -> slots in use, workers with none left out."""
    return {k.decode(): int(v) for k, v in client.hgetall(keys.inflight(model)).items() if int(v)}


async def hold(client: httpx.AsyncClient, model: str, **fields: Any) -> None:
    """A completion stream that runs until cancelled (5,000 tokens, EOS ignored)."""
    body = {"model": model, "prompt": "long", "max_tokens": 5000, "ignore_eos": True, "stream": True, **fields}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            pass
